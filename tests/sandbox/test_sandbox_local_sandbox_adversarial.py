"""Adversarial tests of `LocalSubprocessSandbox` on the real bubblewrap path: one property each.

Every test runs hostile code through `exec` and then checks the host side: the file is
untouched, the server saw no connection, no process survived, the memory stayed bounded.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
import uuid
from pathlib import Path

import pytest

from composer_replication.sandbox.local import LocalSubprocessSandbox

pytestmark = pytest.mark.integration

if not os.access("/usr/bin/bwrap", os.X_OK) and not any(
    os.access(os.path.join(d, "bwrap"), os.X_OK) for d in os.environ.get("PATH", "").split(":")
):
    pytest.skip("bubblewrap is not installed", allow_module_level=True)


def _sandbox(workdir: Path, **kwargs: object) -> LocalSubprocessSandbox:
    sandbox = LocalSubprocessSandbox(workdir, **kwargs)  # type: ignore[arg-type]
    assert sandbox.isolated, "bubblewrap is installed but unusable here"
    return sandbox


def _processes_with(marker: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if marker.encode() in fh.read():
                    found.append(int(pid))
        except OSError:
            continue
    return found


def _wait_until_gone(marker: str, seconds: float = 3.0) -> list[int]:
    deadline = time.monotonic() + seconds
    while (left := _processes_with(marker)) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


def test_infinite_loop_is_killed_at_the_timeout(workdir: Path) -> None:
    sandbox = _sandbox(workdir, exec_timeout_s=1.5)
    output = sandbox.exec({"command": "while :; do :; done"})
    entry = sandbox.trajectory()[-1]
    assert "[timed out after 1.5 s; process group killed]" in output
    assert entry["timed_out"] is True
    assert 1.5 <= entry["duration_s"] < 15


def test_cpu_limit_kills_a_busy_loop_before_the_wall_clock(workdir: Path) -> None:
    sandbox = _sandbox(workdir, exec_timeout_s=30, cpu_time_s=1)
    output = sandbox.exec({"command": "exec python3 -c 'while True: pass'"})
    entry = sandbox.trajectory()[-1]
    assert entry["timed_out"] is False
    # bubblewrap reports a signal death as 128 + N: SIGKILL (9) or SIGXCPU (24) from RLIMIT_CPU
    assert entry["exit_code"] in (128 + 9, 128 + 24)
    assert output.endswith(f"[exit code {entry['exit_code']}]")
    assert entry["duration_s"] < 20  # long before the 30 s wall clock


def test_memory_bomb_hits_the_address_space_limit(workdir: Path) -> None:
    sandbox = _sandbox(workdir, mem_limit_mb=256)
    code = (
        "chunks = []\n"
        "try:\n"
        "    while True:\n"
        "        chunks.append(bytearray(10 * 1024 * 1024))\n"
        "except MemoryError:\n"
        "    print('MemoryError after', len(chunks), 'chunks')\n"
    )
    output = sandbox.exec({"command": f'python3 -c "{code}"'})
    assert "MemoryError after" in output
    chunks = int(output.split("MemoryError after")[1].split()[0])
    assert chunks < 26  # 256 MiB address space, 10 MiB per chunk, minus the interpreter


@pytest.mark.slow
def test_fork_bomb_is_contained_and_fully_reaped(workdir: Path) -> None:
    marker = f"forkbomb-{uuid.uuid4().hex}"
    sandbox = _sandbox(workdir, exec_timeout_s=3, max_processes=24)
    code = (
        f"import os, sys  # {marker}\n"
        "told = False\n"
        "while True:\n"
        "    try:\n"
        "        os.fork()\n"
        "    except OSError:\n"
        "        if not told:\n"
        "            print('fork refused', flush=True)\n"
        "            told = True\n"
    )
    output = sandbox.exec({"command": f'python3 -c "{code}"'})
    assert "fork refused" in output  # RLIMIT_NPROC stopped it, not the host running dry
    assert sandbox.trajectory()[-1]["timed_out"] is True
    assert _wait_until_gone(marker) == []


def test_writes_outside_the_workdir_never_reach_the_host(shared_dir: Path, workdir: Path) -> None:
    victim = shared_dir / "victim.txt"
    victim.write_text("original")
    os.chmod(victim, 0o666)  # world-writable: only the isolation can protect it
    etc_probe = Path(f"/etc/cr-sandbox-probe-{uuid.uuid4().hex}")
    sandbox = _sandbox(workdir)
    sandbox.exec({"command": f"echo pwned > {victim}; cat {victim}"})
    output = sandbox.exec({"command": f"echo pwned > {etc_probe}"})
    assert victim.read_text() == "original"
    assert "Read-only file system" in output
    assert not etc_probe.exists()


def test_secrets_outside_the_workdir_are_unreadable(shared_dir: Path, workdir: Path) -> None:
    token = uuid.uuid4().hex
    tmp_secret = shared_dir / "secret.txt"
    tmp_secret.write_text(f"tmp-secret-{token}")
    os.chmod(tmp_secret, 0o644)  # world-readable on the host
    root_secret = Path(f"/root/.cr-secret-{token}")
    root_secret.write_text(f"root-secret-{token}")
    try:
        sandbox = _sandbox(workdir)
        output = sandbox.exec({"command": f"cat {tmp_secret}; cat {root_secret}"})
    finally:
        root_secret.unlink()
    assert f"tmp-secret-{token}" not in output
    assert f"root-secret-{token}" not in output
    assert output.count("No such file or directory") == 2  # /tmp and /root are hidden


def test_network_to_a_host_server_on_loopback_fails(workdir: Path) -> None:
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    accepted: list[object] = []

    def accept() -> None:
        server.settimeout(5)
        with contextlib.suppress(OSError):
            accepted.append(server.accept())

    thread = threading.Thread(target=accept)
    thread.start()
    try:
        sandbox = _sandbox(workdir)
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=2)"
        output = sandbox.exec({"command": f'python3 -c "{code}"; echo exit=$?'})
        assert "exit=1" in output
        assert "Errno" in output or "timed out" in output
        assert accepted == []  # the host server never saw the sandbox
        socket.create_connection(("127.0.0.1", port), timeout=2).close()  # host path works
        thread.join(5)
        assert len(accepted) == 1
    finally:
        server.close()
        thread.join(5)


def test_huge_output_is_truncated_without_holding_it(workdir: Path) -> None:
    sandbox = _sandbox(workdir, max_output_bytes=10_000)
    code = "import sys; sys.stdout.write('START' + 'x' * 50_000_000 + 'END')"
    output = sandbox.exec({"command": f'python3 -c "{code}"'})
    entry = sandbox.trajectory()[-1]
    assert entry["output_bytes"] == 50_000_008
    assert entry["truncated"] is True
    assert output.startswith("START")
    assert output.endswith("END")
    assert "bytes of output omitted" in output
    assert len(output) < 10_100


def test_a_child_that_outlives_its_parent_is_killed(workdir: Path) -> None:
    marker = f"orphan-{uuid.uuid4().hex}"
    sandbox = _sandbox(workdir)
    code = (
        f"import os, time  # {marker}\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    time.sleep(600)\n"
        "print('parent exits', flush=True)\n"
    )
    output = sandbox.exec({"command": f'python3 -c "{code}"'})
    assert "parent exits" in output
    assert _wait_until_gone(marker) == []
