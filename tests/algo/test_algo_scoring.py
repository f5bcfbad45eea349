"""Prefill scorers against a naive full-logits computation on the tiny model.

The endpoint scorer talks to a real HTTP server (stdlib, loopback) that answers vLLM's
``prompt_logprobs`` form and the ``echo`` form from the tiny model's own log-probs.
"""

from __future__ import annotations

import asyncio
import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from composer_replication.algo.scoring import (
    EndpointPrefillScorer,
    LocalPrefillScorer,
    PrefillScorer,
)

SEQUENCES = [[1, 520, 9531, 198, 31041, 665, 2], [1, 4093, 198, 6004], [1, 330, 1012, 42, 7, 8]]
STARTS = [4, 1, 3]


def naive_logprobs(model, seq, temperature=1.0):
    """log p(seq[t] | seq[:t]) for t >= 1, from the full logits."""
    with torch.no_grad():
        logits = model(torch.tensor([seq])).logits[0, :-1].double() / temperature
    lp = logits.log_softmax(-1).gather(1, torch.tensor(seq[1:])[:, None]).squeeze(1)
    return [0.0, *lp.tolist()]


def test_local_scorer_matches_naive(tiny):
    model, _ = tiny
    scorer = LocalPrefillScorer(model, batch_size=2, chunk_size=3)
    assert isinstance(scorer, PrefillScorer)
    got = asyncio.run(scorer.score(SEQUENCES, STARTS))
    for seq, start, values in zip(SEQUENCES, STARTS, got):
        assert len(values) == len(seq) - start
        torch.testing.assert_close(
            torch.tensor(values, dtype=torch.float64),
            torch.tensor(naive_logprobs(model, seq)[start:], dtype=torch.float64),
            rtol=0,
            atol=2e-5,
        )


def test_local_scorer_temperature(tiny):
    model, _ = tiny
    got = asyncio.run(LocalPrefillScorer(model, temperature=0.7).score(SEQUENCES[:1], [1]))
    torch.testing.assert_close(
        torch.tensor(got[0], dtype=torch.float64),
        torch.tensor(naive_logprobs(model, SEQUENCES[0], 0.7)[1:], dtype=torch.float64),
        rtol=0,
        atol=2e-5,
    )


def test_scorer_request_checks(tiny):
    scorer = LocalPrefillScorer(tiny[0])
    with pytest.raises(ValueError, match="token 0 has no log-prob"):
        asyncio.run(scorer.score([[1, 2]], [0]))
    with pytest.raises(ValueError, match="2 sequences but 1 start"):
        asyncio.run(scorer.score([[1, 2], [1, 2]], [1]))


class _Server:
    """Loopback completions server backed by the tiny model; records what it received."""

    def __init__(self, model, *, fail_first: int = 0, status: int = 200, api_key=None):
        self.model, self.fail_first, self.status, self.api_key = model, fail_first, status, api_key
        self.requests: list[dict] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep test output quiet
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests.append(
                        {"path": self.path, "auth": self.headers.get("Authorization"), **body}
                    )
                    failing = outer.fail_first > 0
                    outer.fail_first -= failing
                if failing or outer.status != 200:
                    self._send(503 if failing else outer.status, {"error": "unavailable"})
                    return
                self._send(200, outer.answer(body))

            def _send(self, code, payload):
                data = json.dumps(payload).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def answer(self, body):
        ids = body["prompt"]
        values = naive_logprobs(self.model, ids)
        if body.get("echo"):
            assert (body["logprobs"], body["max_tokens"]) == (0, 0)
            return {"choices": [{"text": "", "logprobs": {"token_logprobs": [None, *values[1:]]}}]}
        assert (body["prompt_logprobs"], body["max_tokens"]) == (0, 1)
        entries = [None] + [
            # vLLM lists the prompt token plus the top-k; a decoy entry must be skipped
            {str(tok): {"logprob": v, "rank": 3, "decoded_token": "x"}, "0": {"logprob": -0.1}}
            for tok, v in zip(ids[1:], values[1:])
        ]
        return {"choices": [{"text": "!", "prompt_logprobs": entries}]}

    @property
    def base_url(self):
        return f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join()


@pytest.mark.parametrize("mode", ["vllm", "echo"])
def test_endpoint_scorer_matches_naive(tiny, mode):
    model, _ = tiny
    with _Server(model) as server:
        scorer = EndpointPrefillScorer(server.base_url, "tiny", mode=mode)
        got = asyncio.run(scorer.score(SEQUENCES, STARTS))
    for seq, start, values in zip(SEQUENCES, STARTS, got):
        assert values == naive_logprobs(model, seq)[start:]  # JSON float round trip is exact
    assert {r["path"] for r in server.requests} == {"/v1/completions"}
    assert sorted(r["prompt"] for r in server.requests) == sorted(SEQUENCES)
    assert all(r["model"] == "tiny" and r["auth"] is None for r in server.requests)


def test_endpoint_scorer_retries_and_sends_the_key(tiny, monkeypatch):
    monkeypatch.setenv("TEST_PREFILL_KEY", "sk-test")
    with _Server(tiny[0], fail_first=2) as server:
        scorer = EndpointPrefillScorer(
            server.base_url + "/", "tiny", api_key_env="TEST_PREFILL_KEY", backoff_s=0.0
        )
        got = asyncio.run(scorer.score(SEQUENCES[:1], [1]))
    assert got[0] == naive_logprobs(tiny[0], SEQUENCES[0])[1:]
    assert len(server.requests) == 3
    assert {r["auth"] for r in server.requests} == {"Bearer sk-test"}


def test_endpoint_scorer_gives_up(tiny):
    with _Server(tiny[0], fail_first=10) as server:
        scorer = EndpointPrefillScorer(server.base_url, "tiny", max_retries=1, backoff_s=0.0)
        with pytest.raises(RuntimeError, match="failed after 2 attempts"):
            asyncio.run(scorer.score(SEQUENCES[:1], [1]))
    assert len(server.requests) == 2
    with _Server(tiny[0], status=400) as server:
        scorer = EndpointPrefillScorer(server.base_url, "tiny", backoff_s=0.0)
        with pytest.raises(Exception, match="400"):
            asyncio.run(scorer.score(SEQUENCES[:1], [1]))
    assert len(server.requests) == 1  # client errors are not retried


def test_endpoint_scorer_needs_its_key(monkeypatch):
    monkeypatch.delenv("TEST_PREFILL_MISSING", raising=False)
    with pytest.raises(RuntimeError, match="TEST_PREFILL_MISSING"):
        EndpointPrefillScorer("http://127.0.0.1:1/v1", "m", api_key_env="TEST_PREFILL_MISSING")
    with pytest.raises(ValueError, match="mode="):
        EndpointPrefillScorer("http://127.0.0.1:1/v1", "m", mode="chat")
