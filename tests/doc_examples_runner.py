"""Runs documentation examples, each in a fresh forked process: ``python doc_examples_runner.py``
reads ``{"examples": [{"id", "code", "filename"}], "timeout_s"}`` as JSON on stdin and
writes ``{id: {"status", "output"}}`` as JSON on stdout.

The parent imports the heavy libraries once (torch, transformers, the embedded tokenizer's
files into the page cache) and runs no tensor operation, so every forked child starts warm
and single-threaded. A child gets its own temporary working directory (also first on
``sys.path``, so an example may write a module and import it) and its own process group; one
past ``timeout_s`` is killed with everything it started. ``status`` is ``"passed"``,
``"failed"`` (``output`` ends with the traceback) or ``"timeout"``.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path


def _preload() -> None:
    import torch  # noqa: F401
    import transformers  # noqa: F401
    from transformers import LlamaForCausalLM  # noqa: F401

    from composer_replication.model.loading import load_tokenizer

    load_tokenizer()  # reads the embedded tokenizer's files once


def _child(code: str, filename: str, workdir: Path) -> None:
    """Runs in the forked process; never returns."""
    status = 1
    try:
        os.setsid()
        log = os.open(workdir / "output.txt", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.chdir(workdir)
        sys.path.insert(0, str(workdir))
        exec(compile(code, filename, "exec"), {"__name__": "__main__"})
        status = 0
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


def run_one(code: str, filename: str, timeout_s: float) -> dict[str, str]:
    with tempfile.TemporaryDirectory(prefix="doc-example-") as tmp:
        workdir = Path(tmp)
        pid = os.fork()
        if pid == 0:
            _child(code, filename, workdir)
        deadline = time.monotonic() + timeout_s
        status = "timeout"
        while time.monotonic() < deadline:
            done, code_ = os.waitpid(pid, os.WNOHANG)
            if done:
                status = "passed" if os.waitstatus_to_exitcode(code_) == 0 else "failed"
                break
            time.sleep(0.02)
        # the example's group: a timed-out example, and anything it left running
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)
        if status == "timeout":
            os.waitpid(pid, 0)
        output = workdir / "output.txt"
        text = output.read_text(errors="replace") if output.exists() else ""
        return {"status": status, "output": text[-6000:]}


def main() -> None:
    spec = json.load(sys.stdin)
    _preload()
    results = {
        ex["id"]: run_one(ex["code"], ex["filename"], float(spec["timeout_s"]))
        for ex in spec["examples"]
    }
    json.dump(results, sys.stdout)


if __name__ == "__main__":
    main()
