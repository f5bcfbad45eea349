"""Sandboxes for agent commands and task tests: the `Sandbox` protocol and its backends.

What the default local backend (`LocalSubprocessSandbox` with bubblewrap) protects against:
network access (own network namespace), writes outside the task workdir (read-only root,
private /tmp), reads of /tmp, /var/tmp, /run, /root, /home and other users' private files
(hidden, unprivileged uid), processes outliving a command (PID namespace), fork and memory
bombs, runaway CPU and huge files (rlimits), hangs (wall-clock kill of the process group)
and huge outputs (bounded capture). What it does NOT protect against: kernel exploits (the
kernel is shared; use `DockerSandbox(runtime="runsc")` or a VM for hostile code), reads of
world-readable host files outside the hidden directories, and, where we are not root, the
workdir's total size for a writer of many files at once (no single file can pass the room
its quota has left; several files together are measured every 0.1 s). As root the workdir
is a tmpfs of the quota's size for the command (`sandbox.quota_volume`), so the kernel
stops every write at the quota. Memory and process counts hold for a run's whole process tree where a
control group is writable (`sandbox.cgroups`), per process otherwise. A guarded test run
(`GuardSpec`, `sandbox.behaviour_guard`) refuses what the agent's code does to the report,
the tests, the runtime or pytest itself while it is tested.
Without bubblewrap only limits, uid drop and timeouts remain, and it says so loudly
(`isolated=False`). Details: `sandbox.local`.

A sandbox runs an agent's shell commands and the task's tests against one working
directory and records what happened (the trajectory) for scoring and the hack monitor.
Backends: `LocalSubprocessSandbox` (`sandbox.local`), `DockerSandbox` (`sandbox.docker`, a
locked-down container) and `FakeSandbox` (scripted, for testing the components that drive
a sandbox). Errors inside a command are data (output text plus trajectory entry), not
exceptions: a denied command, a timeout or a crash comes back as text the agent can read.

Modules: `protocol` (``Sandbox``, ``FakeSandbox``), `base` (records and command policy
shared by the backends), `local` + `bwrap` (the bubblewrap backend), `docker`, `process`
(one child process with limits), `pytest_support` (pytest inside a sandbox), `workdir`,
`cgroups`, `uid_pool`, `quota_volume` (the workdir quota as a tmpfs), `behaviour_guard` (the audit hook of guarded test runs), `files`.
Importing the package imports the backends but not the docker SDK (``sandbox.docker`` loads it
on first use).
"""

from __future__ import annotations

from composer_replication.sandbox.base import (
    SANDBOX_DENYLIST,
    GuardSpec,
    TestRunResult,
    is_command_allowed,
)
from composer_replication.sandbox.docker import DockerSandbox
from composer_replication.sandbox.local import LocalSubprocessSandbox
from composer_replication.sandbox.protocol import FakeSandbox, Sandbox

__all__ = [
    "SANDBOX_DENYLIST",
    "DockerSandbox",
    "FakeSandbox",
    "GuardSpec",
    "LocalSubprocessSandbox",
    "Sandbox",
    "TestRunResult",
    "is_command_allowed",
]
