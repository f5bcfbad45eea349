"""Records and policy shared by every sandbox backend.

`TestRunResult` is the frozen record a test run returns (local, Docker or fake backend),
`SANDBOX_DENYLIST` and `is_command_allowed` are the first-token command policy. The policy
is a guard rail for well-meaning agents and a signal for the hack monitor, not a security
boundary: `sh -c "sudo ..."` passes it. Isolation comes from the backend (bubblewrap,
Docker).
"""

from __future__ import annotations

import copy
import os
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from composer_replication.sandbox.process import exec_suffix

if TYPE_CHECKING:
    from composer_replication.sandbox.process import ProcessOutcome

__all__ = [
    "SANDBOX_DENYLIST",
    "CommandLog",
    "GuardSpec",
    "TestRunResult",
    "action_command",
    "denied_message",
    "first_command_token",
    "is_command_allowed",
]

# Commands an agent never needs to restore a feature and that only make sense for escaping,
# escalating or reaching the network. Matched on the basename of the first token.
SANDBOX_DENYLIST: frozenset[str] = frozenset(
    {
        "sudo",
        "su",
        "doas",
        "pkexec",
        "chroot",
        "nsenter",
        "unshare",
        "bwrap",
        "mount",
        "umount",
        "reboot",
        "shutdown",
        "halt",
        "poweroff",
        "init",
        "systemctl",
        "mkfs",
        "fdisk",
        "killall",
        "pkill",
        "docker",
        "podman",
        "kubectl",
        "ssh",
        "scp",
        "sftp",
        "rsync",
        "curl",
        "wget",
        "nc",
        "ncat",
        "netcat",
        "socat",
        "telnet",
        "ftp",
    }
)

# A shell variable assignment such as FOO=1 before the command word.
_ASSIGNMENT_CHARS = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_")


def _is_assignment(token: str) -> bool:
    name, eq, _ = token.partition("=")
    return bool(eq) and bool(name) and not name[0].isdigit() and set(name) <= _ASSIGNMENT_CHARS


def first_command_token(command: str) -> str | None:
    """Basename of the command word of a shell command line, skipping `VAR=value` prefixes.

    Returns None for an empty command or one that does not parse (unbalanced quotes).
    """
    try:
        tokens = shlex.split(command, comments=False, posix=True)
    except ValueError:
        return None
    for token in tokens:
        if not _is_assignment(token):
            return os.path.basename(token)
    return None


def is_command_allowed(command: str, denylist: frozenset[str] = SANDBOX_DENYLIST) -> bool:
    """True unless the command word is in `denylist` (or the command cannot be parsed)."""
    if not isinstance(command, str):
        raise TypeError(f"command must be a str, got {command!r} ({type(command).__name__})")
    token = first_command_token(command)
    return token is not None and token not in denylist


def action_command(action: Mapping[str, Any]) -> str:
    """The shell command of an ``exec`` action; ``ValueError`` for anything else."""
    if not isinstance(action, Mapping) or not isinstance(action.get("command"), str):
        raise ValueError(f"action must be a dict with a str 'command', got {action!r}")
    return action["command"]


def denied_message(command: str) -> str:
    """The text an agent sees instead of output when its command is refused."""
    token = first_command_token(command)
    if token is None:
        return f"command not allowed: could not parse {command!r} (empty or unbalanced quotes)"
    return f"command not allowed: {token!r} is in SANDBOX_DENYLIST"


@dataclass(frozen=True)
class GuardSpec:
    """What the behaviour guard of a test run protects and whom it watches.

    Attributes:
        protected: Workdir-relative paths of the test and runner-configuration files (the
            code under test may neither write nor read them).
        candidates: Workdir-relative paths of the files the agent wrote or changed: the
            code whose behaviour is judged (untouched repository code is trusted).
    """

    protected: tuple[str, ...]
    candidates: tuple[str, ...]


@dataclass(frozen=True)
class TestRunResult:
    """The outcome of one test run inside a sandbox.

    Attributes:
        passed, failed, errors, skipped: Counts from the test report (errors include
            collection errors; xfail counts as skipped).
        outcomes: Test id (pytest node id) -> "passed" | "failed" | "error" | "skipped".
        exit_code: The runner's exit code; None = never ran. A signal death is negative
            without an isolator and 128 + N through bubblewrap (shell convention).
        output: Combined stdout/stderr, truncated to the backend's output cap.
        timed_out: The wall-clock limit killed the run.
        isolated: The run was inside an OS-level isolator (bubblewrap, container), not just
            resource limits.
        duration_s: Wall-clock seconds of the run.
        infrastructure_error: Why the sandbox failed before the command ran (it could not
            start, fork or mount), or None: such a run says nothing about the code under test.
        behaviour_flags: What the behaviour guard saw the code under test do and refused
            (``sandbox.behaviour_guard``), for guarded runs; empty otherwise.
        failures: Test id -> what the runner reported of its failure or error (the
            assertion message and the traceback, capped; the first failing tests only),
            for a problem statement written from failing tests. Not in ``to_dict``.
    """

    __test__ = False  # not a pytest test class despite the name

    passed: int
    failed: int
    errors: int
    skipped: int = 0
    outcomes: Mapping[str, str] = field(default_factory=dict)
    exit_code: int | None = None
    output: str = ""
    timed_out: bool = False
    isolated: bool = False
    duration_s: float = 0.0
    infrastructure_error: str | None = None
    behaviour_flags: tuple[str, ...] = ()
    failures: Mapping[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """Every collected test passed (or skipped), the runner exited 0, nothing timed out."""
        return self.exit_code == 0 and not self.timed_out and self.failed == 0 and self.errors == 0

    def ids_with(self, outcome: str) -> list[str]:
        """Test ids with the given outcome, sorted."""
        return sorted(t for t, o in self.outcomes.items() if o == outcome)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable copy (for trajectories and logs)."""
        return {
            "passed": self.passed,
            "failed": self.failed,
            "errors": self.errors,
            "skipped": self.skipped,
            "outcomes": dict(self.outcomes),
            "exit_code": self.exit_code,
            "output": self.output,
            "timed_out": self.timed_out,
            "isolated": self.isolated,
            "duration_s": self.duration_s,
            "infrastructure_error": self.infrastructure_error,
            "behaviour_flags": list(self.behaviour_flags),
        }


class CommandLog:
    """What every sandbox backend keeps alike: the trajectory of its commands, the
    first-token policy check and how a refused command or a test run is recorded. A
    backend sets ``denylist`` and ``_trajectory`` (a list) in its constructor."""

    denylist: frozenset[str]
    _trajectory: list[dict[str, Any]]

    def trajectory(self) -> list[dict[str, Any]]:
        """Every boot/exec/run_tests so far, oldest first (a deep copy)."""
        return copy.deepcopy(self._trajectory)

    def is_command_allowed(self, command: str) -> bool:
        """First-token policy check (see `SANDBOX_DENYLIST`); not a security boundary."""
        return is_command_allowed(command, self.denylist)

    def _refusal(self, entry: dict[str, Any], command: str) -> str | None:
        """The text an agent sees when ``command`` is refused (``entry`` recorded as not
        allowed), or None when the command may run."""
        if is_command_allowed(command, self.denylist):
            return None
        text = denied_message(command)
        entry.update(allowed=False, output=text, exit_code=None, timed_out=False)
        self._trajectory.append(entry)
        return text

    def _record_exec(
        self, entry: dict[str, Any], outcome: ProcessOutcome, timeout_s: float, **extra: Any
    ) -> str:
        """Record a command that ran (``entry`` completed from its ``outcome`` and the
        backend's ``extra`` fields); return the text the agent sees."""
        text = outcome.text() + exec_suffix(outcome, timeout_s)
        entry.update(
            allowed=True,
            output=text,
            exit_code=outcome.exit_code,
            timed_out=outcome.timed_out,
            output_bytes=outcome.total_bytes,
            duration_s=outcome.duration_s,
            **extra,
        )
        self._trajectory.append(entry)
        return text

    def _record_tests(
        self, test_command: str, tests: Any, result: TestRunResult, **extra: Any
    ) -> TestRunResult:
        """Record a test run in the trajectory and return its result."""
        self._trajectory.append(
            {
                "type": "run_tests",
                "test_command": test_command,
                "tests": list(tests),
                "result": result.to_dict(),
                **extra,
            }
        )
        return result
