"""The command policy, `TestRunResult`, `FakeSandbox` and the bounded process runner."""

from __future__ import annotations

import os
import sys

import pytest

from composer_replication.datagen import sandbox as sandbox_module
from composer_replication.sandbox import (
    SANDBOX_DENYLIST,
    FakeSandbox,
    Sandbox,
    TestRunResult,
)
from composer_replication.sandbox.base import first_command_token, is_command_allowed
from composer_replication.sandbox.process import OutputCapture, ResourceLimits, run_bounded


@pytest.mark.parametrize(
    ("command", "token"),
    [
        ("ls -la", "ls"),
        ("/usr/bin/sudo rm -rf /", "sudo"),
        ("FOO=1 BAR=x curl http://x", "curl"),
        ("'python3' -c 'print(1)'", "python3"),
        ("", None),
        ("echo 'unbalanced", None),
        ("A=1", None),
    ],
)
def test_first_command_token(command: str, token: str | None) -> None:
    assert first_command_token(command) == token


@pytest.mark.parametrize(
    ("command", "allowed"),
    [
        ("python -m pytest -q", True),
        ("cat tests/test_x.py | grep sudo", True),  # only the first word counts
        ("sudo ls", False),
        ("/usr/bin/wget http://example.com", False),
        ("HTTPS_PROXY=x curl x", False),
        ("docker ps", False),
        ("echo 'open quote", False),
        ("   ", False),
    ],
)
def test_is_command_allowed(command: str, allowed: bool) -> None:
    assert is_command_allowed(command) is allowed


def test_denylist_covers_escalation_and_network_tools() -> None:
    assert {"sudo", "su", "nsenter", "mount", "curl", "wget", "nc", "ssh", "docker"} <= set(
        SANDBOX_DENYLIST
    )
    with pytest.raises(TypeError, match="must be a str"):
        is_command_allowed(["ls"])  # type: ignore[arg-type]


def test_test_run_result_ok_and_helpers() -> None:
    green = TestRunResult(passed=2, failed=0, errors=0, exit_code=0, outcomes={"a": "passed"})
    red = TestRunResult(
        passed=1, failed=1, errors=0, exit_code=1, outcomes={"b": "failed", "a": "passed"}
    )
    assert green.ok and not red.ok
    assert not TestRunResult(2, 0, 0, exit_code=0, timed_out=True).ok
    assert red.ids_with("passed") == ["a"]
    assert red.to_dict()["outcomes"] == {"b": "failed", "a": "passed"}
    assert TestRunResult.__test__ is False


def test_fake_sandbox_scripts_outputs_and_records() -> None:
    fake = FakeSandbox({"ls": "a.py\n"}, default_output="?")
    assert isinstance(fake, Sandbox)
    fake.boot("python:3.11")
    assert fake.exec({"command": "ls"}) == "a.py\n"
    assert fake.exec({"command": "pwd"}) == "?"
    assert fake.exec({"command": "sudo x"}) == "command not allowed: 'sudo' is in SANDBOX_DENYLIST"
    assert [(e["type"], e.get("command"), e.get("allowed")) for e in fake.trajectory()] == [
        ("boot", None, None),
        ("exec", "ls", True),
        ("exec", "pwd", True),
        ("exec", "sudo x", False),
    ]


def test_fake_sandbox_test_results_in_order_then_repeat() -> None:
    first = TestRunResult(0, 1, 0, exit_code=1)
    second = TestRunResult(1, 0, 0, exit_code=0)
    fake = FakeSandbox(test_results=[first, second])
    assert fake.run_tests("pytest", ["t1"]) is first
    assert fake.run_tests("pytest", []) is second
    assert fake.run_tests("pytest", []) is second
    assert fake.trajectory()[0]["tests"] == ["t1"]


def test_fake_sandbox_callable_scripts_and_missing_script_error() -> None:
    fake = FakeSandbox(
        lambda cmd: cmd.upper(),
        test_results=lambda cmd, tests: TestRunResult(len(tests), 0, 0, exit_code=0),
    )
    assert fake.exec({"command": "echo hi"}) == "ECHO HI"
    assert fake.run_tests("pytest", ["a", "b"]).passed == 2
    with pytest.raises(RuntimeError, match="no scripted result"):
        FakeSandbox().run_tests("pytest", [])


def test_sandbox_module_reexports_and_the_first_public_paths() -> None:
    import composer_replication.datagen.docker_sandbox as old_docker
    import composer_replication.sandbox as new_module
    import composer_replication.sandbox.docker as new_docker
    from composer_replication.datagen.sandbox import LocalSubprocessSandbox as OldLocal
    from composer_replication.sandbox.local import LocalSubprocessSandbox

    assert {"SANDBOX_DENYLIST", "FakeSandbox", "LocalSubprocessSandbox", "Sandbox"} <= set(
        sandbox_module.__all__
    )
    # the old paths are the same module objects, not copies
    assert sandbox_module is new_module and old_docker is new_docker
    assert OldLocal is LocalSubprocessSandbox and sandbox_module.FakeSandbox is FakeSandbox


def test_output_capture_keeps_head_and_tail() -> None:
    capture = OutputCapture(400)
    for _ in range(20):
        capture.add(b"a" * 50)
    capture.add(b"b" * 1000)
    data, truncated = capture.result()
    assert truncated and capture.total == 2000
    assert data.startswith(b"a" * 300) and data.endswith(b"b" * 100)
    assert b"[... 1600 bytes of output omitted ...]" in data


def test_output_capture_small_output_is_exact() -> None:
    capture = OutputCapture(400)
    capture.add(b"x" * 350)
    capture.add(b"y" * 50)
    assert capture.result() == (b"x" * 350 + b"y" * 50, False)


def test_resource_limits_validate() -> None:
    with pytest.raises(ValueError, match="mem_mb must be a positive int"):
        ResourceLimits(mem_mb=0)
    with pytest.raises(ValueError, match="file_bytes must be an int >= 0 or None"):
        ResourceLimits(file_bytes=-1)


def test_file_bytes_lowers_the_file_size_limit_to_the_byte() -> None:
    import resource

    def fsize(limits: ResourceLimits) -> int:
        return dict(limits.as_rlimits())[resource.RLIMIT_FSIZE]

    assert fsize(ResourceLimits(file_mb=2)) == 2 * 1024 * 1024
    assert fsize(ResourceLimits(file_mb=2, file_bytes=12_288)) == 12_288
    assert fsize(ResourceLimits(file_mb=2, file_bytes=0)) == 0
    assert fsize(ResourceLimits(file_mb=2, file_bytes=5 * 1024 * 1024)) == 2 * 1024 * 1024


@pytest.mark.integration
def test_run_bounded_captures_exit_code_and_output(tmp_path) -> None:
    code = "import sys; sys.stdout.write('a' * 1000); sys.stderr.write('b' * 1000); sys.exit(3)"
    outcome = run_bounded(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={},
        timeout_s=30,
        max_output_bytes=400,
    )
    assert (outcome.exit_code, outcome.total_bytes, outcome.truncated) == (3, 2000, True)
    assert outcome.output.startswith(b"a" * 300) and outcome.output.endswith(b"b" * 100)
    assert not outcome.timed_out


def test_run_bounded_rejects_bad_arguments(tmp_path) -> None:
    with pytest.raises(ValueError, match="timeout_s"):
        run_bounded(["true"], cwd=tmp_path, env={}, timeout_s=0, max_output_bytes=100)
    with pytest.raises(ValueError, match="max_output_bytes"):
        run_bounded(["true"], cwd=tmp_path, env={}, timeout_s=1, max_output_bytes=10)


def test_action_command_accepts_only_a_str_command() -> None:
    from composer_replication.sandbox.base import action_command

    assert action_command({"command": "ls -la"}) == "ls -la"
    for bad in ({"command": ["ls"]}, {"cmd": "ls"}, "ls", None):
        with pytest.raises(ValueError, match="a str 'command'"):
            action_command(bad)  # type: ignore[arg-type]


def test_start_marker_separates_a_started_command_from_a_failed_start(tmp_path) -> None:
    from composer_replication.sandbox.process import (
        ProcessOutcome,
        strip_start_marker,
        with_start_marker,
    )

    outcome = run_bounded(
        with_start_marker(["/bin/sh", "-c", "echo 'hello $1'; exit 4"]),
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        timeout_s=30,
        max_output_bytes=1000,
    )
    started = strip_start_marker(outcome)
    assert started is not None
    assert (started.output, started.total_bytes, started.exit_code) == (b"hello $1\n", 9, 4)
    never_ran = ProcessOutcome(1, b"bwrap: Can't fork\n", 18, False, False, 0.0)
    assert strip_start_marker(never_ran) is None


def test_exec_suffix_names_how_a_command_ended() -> None:
    from composer_replication.sandbox.process import ProcessOutcome, exec_suffix

    def ended(exit_code, timed_out=False, stopped=None):
        return ProcessOutcome(exit_code, b"", 0, False, timed_out, 1.0, stopped=stopped)

    assert exec_suffix(ended(0), 5) == ""
    assert exec_suffix(ended(2), 5) == "\n[exit code 2]"
    assert exec_suffix(ended(-9), 5) == "\n[killed by signal 9]"
    assert exec_suffix(ended(None, timed_out=True), 5) == (
        "\n[timed out after 5 s; process group killed]"
    )
    assert exec_suffix(ended(None, stopped="over quota"), 5) == (
        "\n[stopped: over quota; process group killed]"
    )


def test_resolve_identity_as_root_and_as_a_user(monkeypatch) -> None:
    from composer_replication.sandbox import uid_pool

    monkeypatch.setattr(os, "geteuid", lambda: 0)
    assert uid_pool.resolve_identity(None, None) == (uid_pool.NOBODY_UID, uid_pool.NOBODY_UID)
    assert uid_pool.resolve_identity(1234, 99) == (1234, 99)
    assert uid_pool.resolve_identity(0, None) == (None, None)  # root stays root
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert uid_pool.resolve_identity(None, None) == (None, None)
    assert uid_pool.resolve_identity(1000, None) == (None, None)
    with pytest.raises(ValueError, match="run_as_uid=1234 needs root"):
        uid_pool.resolve_identity(1234, None)


def test_over_quota_measures_the_tree(tmp_path) -> None:
    from composer_replication.sandbox.workdir import over_quota

    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "big").write_bytes(os.urandom(3 * 1024 * 1024))
    assert over_quota(tmp_path, None) is None
    assert over_quota(tmp_path, 8 * 1024 * 1024) is None
    assert over_quota(tmp_path, 1024 * 1024) == "the workdir reached its disk quota of 1 MB"


def test_quota_room_is_whole_blocks_below_the_quota(tmp_path) -> None:
    from composer_replication.sandbox.workdir import (
        disk_usage,
        filesystem_block,
        over_quota,
        quota_room,
    )

    (tmp_path / "data").write_bytes(b"\1" * 10_000)
    used, block = disk_usage(tmp_path), filesystem_block(tmp_path)
    assert block == os.statvfs(tmp_path).f_frsize and used % 512 == 0
    # 2.5 blocks free: a file may grow by 2 whole blocks (a third would pass the quota)
    assert quota_room(tmp_path, used + 2 * block + block // 2) == 2 * block
    assert over_quota(tmp_path, used + 2 * block + block // 2) is None
    # less than one block free: the quota is reached, nothing more may be written
    assert quota_room(tmp_path, used + block - 1) == 0
    assert over_quota(tmp_path, used + block - 1) is not None
    assert quota_room(tmp_path, used // 2) == 0  # already past it


def test_find_bwrap_says_why_not(tmp_path) -> None:
    from composer_replication.sandbox.bwrap import find_bwrap

    assert find_bwrap(None, None, None) == (None, "bwrap_path=None")
    missing = tmp_path / "no-bwrap"
    found, reason = find_bwrap(missing, None, None)
    assert found is None and reason == f"bubblewrap not found ({missing!r})"


def test_quota_fitting_is_the_tree_in_whole_mib_plus_headroom(tmp_path) -> None:
    from composer_replication.sandbox.workdir import quota_fitting

    (tmp_path / "data.bin").write_bytes(b"\1" * (3 * 1024 * 1024 + 1))
    assert quota_fitting(tmp_path) == 4 + 512  # 3 MiB and a block, rounded up to 4
    assert quota_fitting(tmp_path, headroom_mb=8) == 12


@pytest.mark.integration
def test_a_confined_child_applies_its_limits_itself_and_never_copies_the_parent(tmp_path) -> None:
    """rlimits (and uid, cgroups, namespace) are applied by the launcher the child execs, so
    the child starts with vfork: the parent's pages are not made copy-on-write (a fork from
    a process holding 256 MiB would make each of its 65,536 pages fault on the next write)."""
    import resource

    held = bytearray(256 << 20)
    held[::4096] = b"\1" * len(held[::4096])  # touched: every page is resident
    limits = ResourceLimits(mem_mb=512, cpu_s=7, open_files=99, processes=50)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    outcome = run_bounded(
        ["/bin/sh", "-c", "ulimit -n; ulimit -t; ulimit -v"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        timeout_s=30,
        max_output_bytes=1000,
        limits=limits,
    )
    held[::4096] = b"\2" * len(held[::4096])  # the parent writes every page again
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
    assert outcome.exit_code == 0, outcome.output
    assert outcome.output.split() == [b"99", b"7", str(512 * 1024).encode()]
    assert faults < 65536 // 4, faults


@pytest.mark.integration
def test_a_child_that_cannot_be_confined_or_started_says_so(tmp_path) -> None:
    confined = run_bounded(
        ["/bin/true"],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        timeout_s=30,
        max_output_bytes=1000,
        cgroup_procs=[str(tmp_path / "no-such-cgroup" / "cgroup.procs")],
    )
    assert confined.exit_code == 126
    assert b"sandbox error: could not confine the command" in confined.output
    started = run_bounded(
        [str(tmp_path / "no-such-program")],
        cwd=tmp_path,
        env={"PATH": "/usr/bin:/bin"},
        timeout_s=30,
        max_output_bytes=1000,
        limits=ResourceLimits(),
    )
    assert started.exit_code == 127
    assert b"sandbox error: could not start" in started.output
