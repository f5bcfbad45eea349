"""`LocalSubprocessSandbox` behaviour: commands, tests, limits, trajectory, degraded mode."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from composer_replication.sandbox import Sandbox
from composer_replication.sandbox.local import LocalSubprocessSandbox
from composer_replication.sandbox.workdir import check_reachable

pytestmark = pytest.mark.integration

HAVE_BWRAP = shutil.which("bwrap") is not None
needs_bwrap = pytest.mark.skipif(not HAVE_BWRAP, reason="bubblewrap is not installed")
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="uid switching needs root")

SUITE = """\
import pytest


def test_ok():
    assert 1 + 1 == 2


def test_bad():
    assert 1 + 1 == 3


class TestGroup:
    @pytest.mark.parametrize("x", [1, 2])
    def test_param(self, x):
        assert x == 1

    @pytest.mark.skip(reason="not today")
    def test_skipped(self):
        pass
"""


def _write_suite(workdir: Path) -> None:
    (workdir / "tests").mkdir()
    (workdir / "tests" / "test_suite.py").write_text(SUITE)


def test_is_a_sandbox(workdir: Path) -> None:
    assert isinstance(LocalSubprocessSandbox(workdir), Sandbox)


@needs_bwrap
@needs_root
def test_exec_runs_as_an_own_uid_in_the_workdir_with_python_on_path(workdir: Path) -> None:
    from composer_replication.sandbox.uid_pool import FIRST_UID, POOL_SIZE

    sandbox = LocalSubprocessSandbox(workdir, exec_timeout_s=30)
    out = sandbox.exec({"command": "id -u; pwd; python --version; echo hi > made.txt"})
    lines = out.splitlines()
    uid = int(lines[0])
    assert FIRST_UID <= uid < FIRST_UID + POOL_SIZE  # a leased uid, not a shared one
    assert lines[1] == str(workdir.resolve())
    assert lines[2].startswith("Python 3.")
    assert (workdir / "made.txt").read_text() == "hi\n"
    assert (workdir / "made.txt").stat().st_uid == uid
    fixed = LocalSubprocessSandbox(workdir, exec_timeout_s=30, run_as_uid=65534)
    assert fixed.exec({"command": "id -u"}).splitlines()[0] == "65534"


@needs_bwrap
@needs_root
def test_concurrent_runs_get_distinct_uids(workdir: Path, shared_dir: Path) -> None:
    from concurrent.futures import ThreadPoolExecutor

    dirs = [shared_dir / f"w{i}" for i in range(3)]
    for d in dirs:
        d.mkdir()
        d.chmod(0o755)
    boxes = [LocalSubprocessSandbox(d, exec_timeout_s=30) for d in dirs]
    with ThreadPoolExecutor(3) as pool:
        outs = list(pool.map(lambda b: b.exec({"command": "id -u; sleep 1"}), boxes))
    assert len({o.splitlines()[0] for o in outs}) == 3


@needs_bwrap
def test_a_sandbox_that_cannot_start_reports_an_infrastructure_error(workdir: Path) -> None:
    ok = LocalSubprocessSandbox(workdir, exec_timeout_s=30)
    ok.exec({"command": "exit 1"})
    assert ok.trajectory()[-1]["infrastructure_error"] is None  # the command ran and failed
    broken = LocalSubprocessSandbox(workdir, exec_timeout_s=30, pytest_from="python")
    broken.ro_binds = ("/nonexistent/dir",)  # a bind bubblewrap cannot make
    result = broken.run_tests("python -m pytest -q", [])
    assert result.infrastructure_error and "did not start" in result.infrastructure_error


@needs_bwrap
def test_resource_limits_are_in_force_inside(workdir: Path) -> None:
    sandbox = LocalSubprocessSandbox(
        workdir, mem_limit_mb=300, cpu_time_s=7, max_file_mb=5, max_open_files=77, max_processes=33
    )
    code = (
        "import resource as r; "
        "print(*[r.getrlimit(getattr(r, n))[0] for n in "
        "('RLIMIT_AS', 'RLIMIT_CPU', 'RLIMIT_FSIZE', 'RLIMIT_NOFILE', 'RLIMIT_NPROC')])"
    )
    out = sandbox.exec({"command": f'python3 -c "{code}"'})
    assert out.split() == [str(300 * 2**20), "7", str(5 * 2**20), "77", "33"]


def test_nonzero_exit_is_reported_in_output_and_trajectory(workdir: Path) -> None:
    sandbox = LocalSubprocessSandbox(workdir)
    out = sandbox.exec({"command": "echo oops >&2; exit 3"})
    assert out == "oops\n\n[exit code 3]"
    entry = sandbox.trajectory()[-1]
    assert (entry["type"], entry["exit_code"], entry["allowed"]) == ("exec", 3, True)


def test_denied_command_is_not_run_and_is_recorded(workdir: Path) -> None:
    sandbox = LocalSubprocessSandbox(workdir)
    out = sandbox.exec({"command": "sudo touch pwned"})
    assert out == "command not allowed: 'sudo' is in SANDBOX_DENYLIST"
    assert not (workdir / "pwned").exists()
    assert sandbox.trajectory() == [
        {
            "type": "exec",
            "command": "sudo touch pwned",
            "isolated": sandbox.isolated,
            "allowed": False,
            "output": out,
            "exit_code": None,
            "timed_out": False,
        }
    ]


def test_malformed_action_raises(workdir: Path) -> None:
    with pytest.raises(ValueError, match="'command'"):
        LocalSubprocessSandbox(workdir).exec({"cmd": "ls"})


def test_run_tests_parses_per_test_outcomes(workdir: Path) -> None:
    _write_suite(workdir)
    sandbox = LocalSubprocessSandbox(workdir, exec_timeout_s=60)
    result = sandbox.run_tests("python -m pytest -q", [])
    assert (result.passed, result.failed, result.errors, result.skipped) == (2, 2, 0, 1)
    assert result.outcomes == {
        "tests/test_suite.py::test_ok": "passed",
        "tests/test_suite.py::test_bad": "failed",
        "tests/test_suite.py::TestGroup::test_param[1]": "passed",
        "tests/test_suite.py::TestGroup::test_param[2]": "failed",
        "tests/test_suite.py::TestGroup::test_skipped": "skipped",
    }
    assert result.exit_code == 1
    assert not result.ok
    assert result.isolated is HAVE_BWRAP
    assert not list(workdir.glob(".cr-junit-*"))  # the report is removed after parsing
    assert not (workdir / ".pytest_cache").exists()


def test_a_repository_asking_pytest_for_colour_gets_plain_output(workdir: Path) -> None:
    _write_suite(workdir)
    (workdir / "pytest.ini").write_text("[pytest]\naddopts = --color=yes\n")
    result = LocalSubprocessSandbox(workdir, exec_timeout_s=60).run_tests("python -m pytest", [])
    assert result.failed == 2 and "FAILED tests/test_suite.py::test_bad" in result.output
    assert "\x1b[" not in result.output  # no terminal escapes for a model (or a report) to read


def test_run_tests_selects_node_ids_and_reports_ok(workdir: Path) -> None:
    _write_suite(workdir)
    sandbox = LocalSubprocessSandbox(workdir, exec_timeout_s=60)
    result = sandbox.run_tests("pytest", ["tests/test_suite.py::test_ok"])
    assert result.outcomes == {"tests/test_suite.py::test_ok": "passed"}
    assert result.ok
    entry = sandbox.trajectory()[-1]
    assert entry["type"] == "run_tests"
    assert entry["tests"] == ["tests/test_suite.py::test_ok"]
    assert entry["result"]["passed"] == 1


def test_collection_error_is_an_error_not_a_pass(workdir: Path) -> None:
    (workdir / "tests").mkdir()
    (workdir / "tests" / "test_broken.py").write_text("import not_a_module_anywhere\n")
    result = LocalSubprocessSandbox(workdir).run_tests("python -m pytest -q", [])
    assert result.outcomes == {"tests/test_broken.py": "error"}
    assert (result.errors, result.exit_code, result.ok) == (1, 1, False)


def test_one_module_that_fails_to_collect_does_not_stop_the_others(workdir: Path) -> None:
    (workdir / "tests").mkdir()
    (workdir / "tests" / "test_broken.py").write_text("import not_a_module_anywhere\n")
    (workdir / "tests" / "test_fine.py").write_text("def test_fine():\n    assert True\n")
    result = LocalSubprocessSandbox(workdir).run_tests("python -m pytest -q", [])
    assert result.outcomes == {
        "tests/test_broken.py": "error",
        "tests/test_fine.py::test_fine": "passed",
    }
    assert (result.passed, result.errors, result.ok) == (1, 1, False)


def test_non_pytest_command_is_judged_by_exit_code(workdir: Path) -> None:
    sandbox = LocalSubprocessSandbox(workdir)
    assert sandbox.run_tests("python -c 'raise SystemExit(0)'", []).ok
    failing = sandbox.run_tests("python -c 'raise SystemExit(4)'", [])
    assert (failing.ok, failing.exit_code, failing.outcomes) == (False, 4, {})


def test_missing_interpreter_is_data_not_a_crash(workdir: Path) -> None:
    sandbox = LocalSubprocessSandbox(workdir, python="/nonexistent/python3", pytest_from="python")
    result = sandbox.run_tests("python -m pytest", [])
    assert not result.ok
    assert result.errors == 1  # no junit report: fail closed


@needs_root
def test_unreachable_workdir_is_refused_with_the_fix(tmp_path: Path) -> None:
    hidden = tmp_path / "private"
    hidden.mkdir(mode=0o700)
    (hidden / "work").mkdir()
    with pytest.raises(ValueError, match=r"not reachable by uid 65534.*make_shared_tempdir"):
        LocalSubprocessSandbox(hidden / "work")
    check_reachable(hidden / "work", 0, 0)  # root itself may pass


def test_missing_workdir_is_refused(shared_dir: Path) -> None:
    with pytest.raises(ValueError, match="not an existing directory"):
        LocalSubprocessSandbox(shared_dir / "nope")


@needs_root
def test_degraded_mode_warns_marks_results_and_is_visibly_unisolated(
    shared_dir: Path, workdir: Path
) -> None:
    victim = shared_dir / "victim.txt"
    victim.write_text("original")
    os.chmod(victim, 0o666)
    with pytest.warns(RuntimeWarning, match="WITHOUT namespace isolation"):
        sandbox = LocalSubprocessSandbox(workdir, bwrap_path=None, mem_limit_mb=300)
    assert sandbox.isolated is False
    out = sandbox.exec({"command": f"id -u; ulimit -v; echo changed > {victim}"})
    uid, limit = out.split()
    assert int(uid) != 0 and limit == str(300 * 1024)  # uid drop and limits still apply
    assert victim.read_text() == "changed\n"  # but nothing stops host writes
    _write_suite(workdir)
    assert (
        sandbox.run_tests("python -m pytest -q", ["tests/test_suite.py::test_ok"]).isolated is False
    )


def test_require_isolation_fails_closed(workdir: Path) -> None:
    with pytest.raises(RuntimeError, match="isolation required"):
        LocalSubprocessSandbox(workdir, bwrap_path=None, require_isolation=True)


def test_unusable_bwrap_binary_degrades_with_the_reason(workdir: Path) -> None:
    with pytest.warns(RuntimeWarning, match="bwrap failed"):
        sandbox = LocalSubprocessSandbox(workdir, bwrap_path="/bin/false")
    assert sandbox.isolated is False


@needs_bwrap
def test_hidden_directories_stay_hidden_and_those_under_tmp_leave_no_name(workdir: Path) -> None:
    import tempfile

    under_tmp = Path(tempfile.mkdtemp(prefix="cr-hidden-", dir="/tmp"))
    elsewhere = Path(tempfile.mkdtemp(prefix="cr-hidden-", dir="/var/tmp"))
    try:
        for secret in (under_tmp, elsewhere):
            (secret / "answer.txt").write_text("the-hidden-answer")
        sandbox = LocalSubprocessSandbox(
            workdir, exec_timeout_s=30, hide_paths=(str(under_tmp), str(elsewhere))
        )
        out = sandbox.exec(
            {
                "command": f"ls /tmp; echo ---; cat {under_tmp}/answer.txt {elsewhere}/answer.txt; "
                f"echo ---; ls -A {elsewhere}"
            }
        )
        listing, reads, hidden_listing = out.split("---")[:3]
        assert under_tmp.name not in listing.split()  # the sandbox's /tmp is its own
        assert "the-hidden-answer" not in reads  # neither secret can be read
        assert hidden_listing.split() == []  # the one outside /tmp is an empty cover
    finally:
        shutil.rmtree(under_tmp)
        shutil.rmtree(elsewhere)


REAL_SUITE = """\
import concurrent.futures
import os
import socket
import subprocess
import sys
import tempfile
import threading


def test_threads():
    results = []
    start = threading.Barrier(32)

    def work(k):
        start.wait()  # all alive at once, each allocating from the C heap
        results.append(len(bytes(200_000)) + k)

    workers = [threading.Thread(target=work, args=(k,)) for k in range(32)]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    assert sorted(results) == [200_000 + k for k in range(32)]


def test_a_thread_pool():
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        assert list(pool.map(lambda x: x * x, range(64))) == [x * x for x in range(64)]


def test_subprocesses():
    out = subprocess.run([sys.executable, "-c", "print(6 * 7)"], capture_output=True, text=True)
    assert out.stdout.strip() == "42"


def test_temporary_files():
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "x.txt")
        with open(path, "w") as fh:
            fh.write("kept")
        assert open(path).read() == "kept"


def test_a_socket_on_loopback():
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]

    def serve():
        conn, _ = server.accept()
        conn.sendall(conn.recv(5).upper())
        conn.close()

    thread = threading.Thread(target=serve)
    thread.start()
    with socket.create_connection(("127.0.0.1", port), timeout=5) as client:
        client.sendall(b"hello")
        assert client.recv(5) == b"HELLO"
    thread.join()
    server.close()
"""


@needs_bwrap
def test_real_suites_run_inside_the_sandbox_as_outside(workdir: Path) -> None:
    """Threads (a gigabyte of address space used to run out at ten: glibc's per-thread
    malloc arenas), a thread pool, subprocesses, temporary files, a server on loopback."""
    (workdir / "test_real.py").write_text(REAL_SUITE)
    sandbox = LocalSubprocessSandbox(workdir, exec_timeout_s=120, mem_limit_mb=1024)
    try:
        result = sandbox.run_tests("python -m pytest -q", [])
    finally:
        sandbox.close()
    assert result.isolated
    assert result.outcomes == {
        f"test_real.py::{name}": "passed"
        for name in (
            "test_threads",
            "test_a_thread_pool",
            "test_subprocesses",
            "test_temporary_files",
            "test_a_socket_on_loopback",
        )
    }, result.output[-3000:]
