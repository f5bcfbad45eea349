"""`testing.openai_server`: the local OpenAI-compatible server the replay tests stand on."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from composer_replication.testing import Fault, LocalOpenAIServer

pytestmark = pytest.mark.integration


def chat(server: LocalOpenAIServer, model: str = "m", content: str = "abcdefghijkl", **body):
    payload = {"model": model, "messages": [{"role": "user", "content": content}], **body}
    return httpx.post(f"{server.base_url}/chat/completions", json=payload, timeout=5)


def test_completion_and_usage_accounting():
    with LocalOpenAIServer(lambda model, messages: "hello world!") as server:
        response = chat(server)
    assert response.status_code == 200
    data = response.json()
    assert data["choices"][0]["message"] == {"role": "assistant", "content": "hello world!"}
    assert data["choices"][0]["finish_reason"] == "stop"
    # prompt: 3 priming + (4 per message + ceil(12 / 4)); completion: ceil(12 / 4)
    assert data["usage"] == {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13}
    assert data["model"] == "m"


def test_max_tokens_is_honoured_unless_disabled():
    reply = "x" * 40  # 10 tokens
    with LocalOpenAIServer(lambda m, msgs: reply) as server:
        data = chat(server, max_tokens=2).json()
    assert data["choices"][0]["message"]["content"] == "xxxxxxxx"
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == 2
    with LocalOpenAIServer(lambda m, msgs: reply, honour_max_tokens=False) as server:
        data = chat(server, max_tokens=2).json()
    assert data["usage"]["completion_tokens"] == 10


def test_faults_per_model_in_order():
    with LocalOpenAIServer() as server:
        server.add_faults(
            Fault("status", status=429, retry_after="3"), Fault("malformed"), model="a"
        )
        server.add_faults(Fault("no_choices"), Fault("no_usage"))  # any model
        first = chat(server, "a")
        assert first.status_code == 429 and first.headers["retry-after"] == "3"
        assert first.json()["error"]["code"] == 429
        second = chat(server, "a")
        assert second.status_code == 200
        with pytest.raises(ValueError):
            second.json()
        assert "choices" not in chat(server, "b").json()
        assert "usage" not in chat(server, "b").json()
        assert chat(server, "b").json()["usage"]["completion_tokens"] > 0  # queue drained
        assert [r.fault for r in server.requests] == [
            "status",
            "malformed",
            "no_choices",
            "no_usage",
            None,
        ]
        assert server.request_count == 5


def test_fault_fn_hang_and_drop():
    def fault_fn(model, body):
        return {"hang": Fault("hang", delay_s=3.0), "drop": Fault("drop")}.get(model)

    with LocalOpenAIServer(fault_fn=fault_fn) as server:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(
                f"{server.base_url}/chat/completions",
                json={"model": "hang", "messages": []},
                timeout=0.3,
            )
        with pytest.raises(httpx.RemoteProtocolError):
            chat(server, "drop")
        assert chat(server, "fine").status_code == 200


def test_api_key_models_and_bad_requests():
    with LocalOpenAIServer(api_key="sk-local") as server:
        assert chat(server).status_code == 401
        ok = httpx.post(
            f"{server.base_url}/chat/completions",
            json={"model": "m1", "messages": [{"role": "user", "content": "hi"}]},
            headers={"Authorization": "Bearer sk-local"},
        )
        assert ok.status_code == 200
        assert server.requests[-1].authorization == "Bearer sk-local"
        models = httpx.get(f"{server.base_url}/models").json()["data"]
        assert sorted(m["id"] for m in models) == ["m", "m1"]
        bad = httpx.post(f"{server.base_url}/chat/completions", content=b"{not json")
        assert bad.status_code == 400
        assert httpx.get(f"{server.base_url}/nope").status_code == 404


@pytest.mark.asyncio
async def test_serves_64_concurrent_requests_at_once():
    with LocalOpenAIServer(latency_s=0.3) as server:
        limits = httpx.Limits(max_connections=64)
        async with httpx.AsyncClient(limits=limits, timeout=10) as client:
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            responses = await asyncio.gather(
                *(client.post(f"{server.base_url}/chat/completions", json=body) for _ in range(64))
            )
        assert all(r.status_code == 200 for r in responses)
        # every request was in the server at the same time: it is not the bottleneck
        assert server.max_in_flight == 64


def test_lifecycle_errors():
    server = LocalOpenAIServer()
    with pytest.raises(RuntimeError, match="not running"):
        _ = server.base_url
    with server, pytest.raises(RuntimeError, match="already running"):
        server.start()
    server.stop()  # stopping twice is harmless


def test_runs_as_its_own_process():
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "composer_replication.testing", "--reply", "pong"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    try:
        base_url = proc.stdout.readline().strip()
        assert base_url.startswith("http://127.0.0.1:") and base_url.endswith("/v1")
        body = {"model": "m", "messages": [{"role": "user", "content": "ping"}]}
        reply = httpx.post(f"{base_url}/chat/completions", json=body, timeout=10).json()
        assert reply["choices"][0]["message"]["content"] == "pong"
        stats = httpx.get(base_url.removesuffix("/v1") + "/_stats").json()
        assert stats == {"requests": 1, "max_in_flight": 1}
    finally:
        proc.terminate()
        assert proc.wait(timeout=10) == 0  # SIGTERM is a clean shutdown
