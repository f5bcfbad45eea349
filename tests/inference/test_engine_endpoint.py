"""An engine endpoint that is dead fails at once, in one line; a slow one is waited for with
a line every few seconds."""

from __future__ import annotations

import http.server
import socket
import threading

import pytest

from composer_replication.common.errors import UsageError
from composer_replication.config.inference import inference_config
from composer_replication.inference import server as engine_server
from composer_replication.inference.server import EngineServer, EngineStartError, endpoint_problem
from composer_replication.preflight import check_inference_engine


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # nothing listens once it is closed


class _Starting(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # a server still loading its model
        self.send_response(503)
        self.end_headers()

    def log_message(self, *args):
        pass


def test_a_dead_url_is_refused_before_anything_loads_and_when_the_engine_starts(tmp_path):
    url = f"http://127.0.0.1:{_closed_port()}"
    assert "connection refused" in endpoint_problem(url)
    assert "unknown" in endpoint_problem("http://no-such-host.invalid:8000")
    config = inference_config(engine="vllm", url=url)
    with pytest.raises(UsageError, match=r"connection refused\); start the engine server there"):
        check_inference_engine(config)
    with pytest.raises(UsageError, match=r"inference\.url="):
        EngineServer(config, tmp_path, log_path=tmp_path / "engine.log").start()
    missing = inference_config(engine="vllm", python=str(tmp_path / "no-venv" / "bin" / "python"))
    with pytest.raises(UsageError, match="make vllm-env"):
        check_inference_engine(missing)
    check_inference_engine(inference_config())  # in process: nothing to check


def test_a_slow_engine_is_waited_for_with_a_line_every_few_seconds(tmp_path, monkeypatch):
    httpd = http.server.HTTPServer(("127.0.0.1", 0), _Starting)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{httpd.server_address[1]}"
        assert endpoint_problem(url) is None
        monkeypatch.setattr(engine_server, "PROGRESS_EVERY_S", 0.3)
        config = inference_config(engine="vllm", url=url, startup_timeout_s=1.5)
        lines: list[str] = []
        engine = EngineServer(config, tmp_path, log_path=tmp_path / "engine.log")
        with pytest.raises(EngineStartError, match="not healthy after 2 s"):
            engine._wait_healthy(__import__("time").monotonic(), say=lines.append)
        assert len(lines) >= 2 and all(
            f"waiting for the engine server at {url}" in x for x in lines
        )
    finally:
        httpd.shutdown()
