"""Start, watch and stop a vLLM OpenAI-compatible server on loopback.

``EngineServer`` runs ``<python> -m vllm.entrypoints.openai.api_server`` in its own process
group, bound to 127.0.0.1, with the weight-sync worker extension on its path
(:mod:`.engine_ext.composer_weight_sync`, a standalone module the engine imports without
this package) and the development endpoints on (``/collective_rpc``,
``/reset_prefix_cache``). ``start()`` waits for ``/health`` and, on a timeout or an early
exit, raises with the tail of the server's log. The server is stopped on every exit path:
the context manager, ``stop()``, and an ``atexit`` hook for an interpreter that ends
without either; stopping kills the whole process group (the engine core is a child).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from composer_replication.config.inference import VllmInferenceConfig

SERVED_MODEL_NAME = "policy"
EXTENSION_DIR = Path(__file__).resolve().parent / "engine_ext"
EXTENSION_CLS = "composer_weight_sync.WeightSyncExtension"
LOG_TAIL_LINES = 40


class EngineStartError(RuntimeError):
    """The engine server did not become healthy."""


#: seconds between the lines that say an engine is still starting
PROGRESS_EVERY_S = 15.0


def endpoint_problem(url: str, *, timeout_s: float = 3.0) -> str | None:
    """Why nothing can answer at ``url`` (``connection refused``, an unknown host, no answer
    within ``timeout_s``), or None when something accepts connections there."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    host = parts.hostname or ""
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        return f"its port is not a number ({url})"
    try:
        with socket.create_connection((host, port), timeout=timeout_s):
            return None
    except ConnectionRefusedError:
        return f"nothing listens at {host}:{port} (connection refused)"
    except socket.gaierror:
        return f"the host {host!r} is unknown"
    except TimeoutError:
        return f"{host}:{port} did not answer within {timeout_s:g} s"
    except OSError as err:
        return f"{host}:{port} cannot be reached ({err.strerror or err})"


def dead_endpoint(url: str) -> Exception | None:
    """The one-line usage error for ``inference.url`` when nothing can answer there, or
    None."""
    from composer_replication.common.errors import UsageError

    problem = endpoint_problem(url)
    if problem is None:
        return None
    return UsageError(
        f"inference.url={url!r}: {problem}; start the engine server there, or drop "
        "inference.url to let the run start one"
    )


def _say(line: str) -> None:
    import sys

    print(line, file=sys.stderr, flush=True)


def free_loopback_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def _cpu_flags(config: VllmInferenceConfig) -> list[str]:
    """Whole prefills on a machine without CUDA: the CPU build cannot rewind a seeded
    request's generator after a partial (chunked) prefill and fails the whole engine
    ("RuntimeError: CPU Generator does not use offset") once a batch's prompts exceed one
    step's token budget, as a held-out evaluation's do."""
    import torch

    if torch.cuda.is_available():
        return []
    budget = max(config.max_model_len, 8192)
    return ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(budget)]


def engine_python(config: VllmInferenceConfig) -> Path:
    """The engine's interpreter (``inference.python``, relative to the working directory).

    Raises:
        FileNotFoundError: it does not exist (one line naming the setting and the fix).
    """
    python = Path(config.python).expanduser()
    if not python.is_absolute():
        python = Path.cwd() / python
    if not python.exists():
        raise FileNotFoundError(
            f"inference.python={config.python!r}: {python} does not exist; build the "
            "engine's virtualenv with `make vllm-env`, or set inference.python / "
            "inference.command / inference.url"
        )
    return python


def server_argv(
    config: VllmInferenceConfig, model_dir: str | Path, port: int, *, lora_rank: int | None = None
) -> list[str]:
    """The command line of the server (launcher + model + loopback address + engine flags);
    ``lora_rank`` turns on runtime LoRA adapters of up to that rank."""
    if config.command:
        launcher = list(config.command)
    else:
        launcher = [str(engine_python(config)), "-m", "vllm.entrypoints.openai.api_server"]
    return [
        *launcher,
        "--model",
        str(model_dir),
        "--served-model-name",
        SERVED_MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        config.dtype,
        "--max-model-len",
        str(config.max_model_len),
        "--gpu-memory-utilization",
        str(config.gpu_memory_utilization),
        "--optimization-level",
        str(config.optimization_level),
        # the model's generation_config.json must not change the sampler's distribution
        "--generation-config",
        "vllm",
        # log-probs of the distribution actually sampled from (after temperature)
        "--logprobs-mode",
        "processed_logprobs",
        "--worker-extension-cls",
        EXTENSION_CLS,
        "--disable-uvicorn-access-log",
        *_cpu_flags(config),
        *(_lora_flags(lora_rank) if lora_rank else ()),
        *config.extra_args,
    ]


def _lora_flags(rank: int) -> list[str]:
    # two slots: the new version loads before the previous one is unloaded
    return ["--enable-lora", "--max-lora-rank", str(_supported_rank(rank)), "--max-loras", "2"]


def _supported_rank(rank: int) -> int:
    """The smallest rank vLLM accepts for --max-lora-rank that fits ``rank``."""
    for allowed in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= allowed:
            return allowed
    raise ValueError(f"LoRA rank {rank} is above the engine's largest (512)")


def server_env(config: VllmInferenceConfig) -> dict[str, str]:
    env = dict(os.environ)
    # our package's venv must not leak into the engine's interpreter
    for key in ("VIRTUAL_ENV", "PYTHONHOME"):
        env.pop(key, None)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(EXTENSION_DIR), env.get("PYTHONPATH", "")) if p
    )
    env["VLLM_SERVER_DEV_MODE"] = "1"
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(config.kv_cache_gib)))
    env.setdefault("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "1")
    env.setdefault("VLLM_NO_USAGE_STATS", "1")
    env.setdefault("DO_NOT_TRACK", "1")
    env.setdefault("HF_HUB_OFFLINE", "1")
    env.setdefault("TRANSFORMERS_OFFLINE", "1")
    return env


class EngineServer:
    """One vLLM server process (or an already running one at ``config.url``)."""

    def __init__(
        self,
        config: VllmInferenceConfig,
        model_dir: str | Path,
        *,
        log_path: str | Path,
    ) -> None:
        self.config = config
        self.lora_rank = config.max_lora_rank if config.lora_sync == "adapter" else None
        self.model_dir = Path(model_dir)
        self.log_path = Path(log_path)
        self.process: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None
        self._port = config.port
        self.base_url = config.url.rstrip("/") if config.url else ""

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> EngineServer:
        if self.config.url:  # someone else's server: only check it answers
            problem = dead_endpoint(self.config.url)
            if problem is not None:  # dead: say so now, not after startup_timeout_s
                raise problem
            self._wait_healthy(time.monotonic())
            return self
        if self.process is not None:
            return self
        port = self._port or free_loopback_port()
        argv = server_argv(self.config, self.model_dir, port, lora_rank=self.lora_rank)
        self.base_url = f"http://127.0.0.1:{port}"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        t0 = time.monotonic()
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                argv,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=server_env(self.config),
                start_new_session=True,  # its own process group: stop() kills the engine core too
            )
        atexit.register(self.stop)
        try:
            self._wait_healthy(t0)
        except BaseException:
            self.stop()
            raise
        self.startup_s = time.monotonic() - t0
        return self

    def stop(self) -> None:
        process, self.process = self.process, None
        if process is None:
            return
        with contextlib.suppress(Exception):
            atexit.unregister(self.stop)
        if process.poll() is None:
            self._signal_group(process, signal.SIGTERM)
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self._signal_group(process, signal.SIGKILL)
                process.wait(timeout=20)
        # the engine core may outlive its parent for a moment: clean the group up
        self._signal_group(process, signal.SIGKILL)

    @staticmethod
    def _signal_group(process: subprocess.Popen[bytes], sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, sig)

    def __enter__(self) -> EngineServer:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    # ------------------------------------------------------------------ health

    def healthy(self) -> bool:
        import httpx

        try:
            return httpx.get(f"{self.base_url}/health", timeout=5.0).status_code == 200
        except httpx.HTTPError:
            return False

    def _wait_healthy(self, t0: float, say: Any = _say) -> None:
        """Wait for ``/health``, a line every ``PROGRESS_EVERY_S`` seconds saying so."""
        deadline = t0 + self.config.startup_timeout_s
        next_line = t0 + PROGRESS_EVERY_S
        while time.monotonic() < deadline:
            now = time.monotonic()
            if now >= next_line:
                say(
                    f"waiting for the engine server at {self.base_url or '(starting)'}: "
                    f"{now - t0:.0f} s of {self.config.startup_timeout_s:.0f} s "
                    "(inference.startup_timeout_s)"
                )
                next_line = now + PROGRESS_EVERY_S
            if self.process is not None and self.process.poll() is not None:
                raise EngineStartError(
                    f"the engine server exited with code {self.process.returncode} before "
                    f"answering /health; last lines of {self.log_path}:\n{log_tail(self.log_path)}"
                )
            if self.healthy():
                return
            time.sleep(0.5)
        where = self.base_url or "(not started)"
        raise EngineStartError(
            f"the engine server at {where} was not healthy after "
            f"{self.config.startup_timeout_s:.0f} s (inference.startup_timeout_s); last lines of "
            f"{self.log_path}:\n{log_tail(self.log_path) if self.process else '(external server)'}"
        )


__all__ = [
    "EXTENSION_CLS",
    "EXTENSION_DIR",
    "SERVED_MODEL_NAME",
    "EngineServer",
    "EngineStartError",
    "dead_endpoint",
    "endpoint_problem",
    "engine_python",
    "free_loopback_port",
    "server_argv",
    "server_env",
]
