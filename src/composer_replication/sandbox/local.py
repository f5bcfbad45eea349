"""`LocalSubprocessSandbox`: agent commands and test runs on this host, inside bubblewrap.

What it protects against when bubblewrap works (the default when `bwrap` is installed):
- Network: own network namespace with only a loopback; neither the internet nor servers on
  the host's 127.0.0.1 are reachable.
- Writes outside the workdir: the root filesystem is a read-only bind, /tmp is a private
  size-limited tmpfs; the workdir is the only writable host path.
- Reads of scratch and home areas: /tmp, /var/tmp, /run (and with it the Docker socket),
  /root, /home, /mnt, /media, /srv are replaced by empty read-only tmpfs (`hide_paths`);
  commands run as an unprivileged uid (nobody when we are root), so root-only files stay
  unreadable.
- Escape and leftovers: own PID/IPC/UTS/cgroup/user namespaces, no capabilities, no nested
  user namespaces, a new session (no terminal injection), `--die-with-parent`; everything
  still running when the command ends (daemons, orphans) dies with the PID namespace.
- Runaway resources: RLIMIT_AS (memory), RLIMIT_CPU, RLIMIT_FSIZE, RLIMIT_NOFILE and
  RLIMIT_NPROC (fork bombs; enforced because root is dropped), a wall-clock timeout that
  SIGKILLs the process group, and output capture capped in memory. Where a cgroup
  hierarchy is writable (``sandbox.cgroups``), memory and process count are also bounded for
  the run's whole process tree (``whole_tree_limits``), so N processes cannot each take
  ``mem_limit_mb``.
- Each other: as root, every run gets its own uid (``sandbox.uid_pool``), so one rollout's
  fork bomb exhausts only its own RLIMIT_NPROC budget; /tmp and /dev/shm are private,
  size-limited tmpfs per run. A run the sandbox could not start (``bwrap: Can't fork``, a
  failed mount) is reported as an infrastructure error (``infrastructure_error``), never as
  a failure of the code under test.

What it does NOT protect against:
- Kernel exploits: the kernel is shared. Hostile code needs a VM or gVisor
  (`DockerSandbox(runtime="runsc")`).
- Reading world-readable host files outside the hidden areas: the root bind is read-only,
  not invisible. Keep secrets (e.g. FeatureDeletion reference files) unreadable for the
  sandbox uid or list them in `hide_paths`.
- Total memory without a writable cgroup hierarchy: rlimits are then per process (N
  processes may each use `mem_limit_mb`; `whole_tree_limits` says which held).
- Where we are not root: disk in a writable workdir beyond its quota for a writer of many
  files at once. Each command's RLIMIT_FSIZE is the room the quota has left, so no single
  file passes it, but several files can, each up to that room, until the measurement every
  0.1 s kills the command (bind the workdir read-only with ``workdir_writable=False`` where
  that matters). As root the command works on a tmpfs of exactly the quota
  (``sandbox.quota_volume``) and the kernel refuses every byte past it. /tmp holds up to
  `tmp_size_mb` and /dev/shm up to `shm_size_mb`.
- A fixed `run_as_uid` shares one RLIMIT_NPROC budget between concurrent sandboxes; CPU
  fairness; side channels; code under test forging a report it writes itself (graders
  that must not trust it form the verdict outside: ``envs.function_grader``).
Without bubblewrap (missing, or unusable because user namespaces are off) only the limits,
the uid drop and the timeout remain: the sandbox warns loudly, results say `isolated=False`,
and it is not a security boundary (pass `require_isolation=True` to refuse that mode).

Identity: as root we drop to nobody (65534) so RLIMIT_NPROC is enforced; otherwise commands
run as the current user, whose every process then counts toward `max_processes`.

Interpreter: tests run with `python` (default `/usr/bin/python3`, which the sandbox uid can
read; pyenv or venv interpreters under /root cannot be). If that interpreter lacks pytest,
the pytest bundle (see `pytest_support`) is put on PYTHONPATH read-only.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from composer_replication.sandbox.base import (
    SANDBOX_DENYLIST,
    CommandLog,
    GuardSpec,
    TestRunResult,
    action_command,
)
from composer_replication.sandbox.bwrap import (
    BASE_PATH,
    DEFAULT_HIDE_PATHS,
    bwrap_argv,
    find_bwrap,
)
from composer_replication.sandbox.cgroups import RunCgroup, cgroup_support
from composer_replication.sandbox.process import (
    ProcessOutcome,
    ResourceLimits,
    exec_suffix,
    run_bounded,
    strip_start_marker,
    with_start_marker,
)
from composer_replication.sandbox.pytest_support import (
    SANDBOX_ENV,
    WORKTREE_ENV,
    entry_for_tests,
    interpreter_bin_dir,
    pytest_bundle_dir,
    result_of_tests,
    sandbox_python,
    support_root,
)
from composer_replication.sandbox.quota_volume import (
    QuotaVolume,
    VolumeError,
    VolumeFull,
    volume_support,
)
from composer_replication.sandbox.uid_pool import NOBODY_UID, lease_uid, resolve_identity
from composer_replication.sandbox.workdir import (
    check_reachable,
    disk_usage,
    hand_over,
    over_quota,
    quota_reached,
    quota_room,
)

__all__ = ["DEFAULT_HIDE_PATHS", "NOBODY_UID", "LocalSubprocessSandbox", "exec_suffix"]

log = logging.getLogger(__name__)

# (python, uid, isolated) -> whether that interpreter imports pytest on its own.
_OWN_PYTEST: dict[tuple[str, int | None, bool], bool] = {}


class LocalSubprocessSandbox(CommandLog):
    """Run commands and tests in `workdir` on this host (see the module docstring for limits).

    Args:
        workdir: The task directory; the only writable host path. It is handed to the sandbox
            uid (chown) when that differs from ours. Every ancestor must be traversable by
            that uid (e.g. a `tempfile.mkdtemp()` directory chmod-ed 0o755).
        exec_timeout_s: Wall-clock limit per `exec`/`run_tests` call.
        mem_limit_mb: RLIMIT_AS per process.
        cpu_time_s: RLIMIT_CPU per process; default `exec_timeout_s + 1` (backs up the timer).
        max_file_mb, max_open_files, max_processes: RLIMIT_FSIZE, _NOFILE, _NPROC.
        max_output_bytes: Output kept per call (head and tail); the rest is dropped unread.
        tmp_size_mb: Size of the private /tmp tmpfs (bubblewrap only).
        shm_size_mb: Size of the private /dev/shm tmpfs (bubblewrap only).
        workdir_writable: False binds the workdir read-only (nothing can be written there).
        workdir_quota_mb: Disk the writable workdir may occupy in all (None: no quota).
            Where we are root, commands see the workdir on a tmpfs of exactly that size
            (``sandbox.quota_volume``, copied from and back to the host directory around
            each command), so the kernel stops every write at the quota (ENOSPC),
            however many files or processes write at once; ``quota_enforcement`` is then
            "volume". Elsewhere ("measured") the room left becomes each command's
            RLIMIT_FSIZE (one file stops exactly there) and the tree is measured every
            0.1 s and once after. A command that reaches the quota (not one block left) is
            killed, and every later command and test run is refused (``over_quota`` says
            why). While the quota is nearly used, the per-file cap holds in /tmp too.
        quota_volume: False measures the quota instead of mounting a volume for it.
        whole_tree_limits: Bound memory and process count of each run's whole process tree
            with a control group when one is writable (see ``sandbox.cgroups``).
        python: Interpreter for tests and `python`/`python3` inside; default /usr/bin/python3.
        pytest_from: "auto" (the interpreter's own pytest if it has one, else the bundle),
            "bundle" or "python".
        bwrap_path: "auto" finds `bwrap` on PATH; None runs without it (limits only).
        require_isolation: Raise instead of degrading when bubblewrap is unusable.
        run_as_uid, run_as_gid: Sandbox identity; default when we are root: a uid of its
            own for every run (``uid_pool``), else our own uid (we cannot switch then).
        hide_paths: Host directories replaced by empty tmpfs inside the sandbox.
        ro_binds: Extra host paths made visible read-only at the same place.
        env: Extra environment variables inside the sandbox.
        denylist: First-token command denylist for `exec`.
    """

    def __init__(
        self,
        workdir: str | os.PathLike[str],
        *,
        exec_timeout_s: float = 60.0,
        mem_limit_mb: int = 1024,
        cpu_time_s: int | None = None,
        max_file_mb: int = 256,
        max_open_files: int = 1024,
        max_processes: int = 128,
        max_output_bytes: int = 200_000,
        tmp_size_mb: int = 256,
        shm_size_mb: int = 64,
        workdir_writable: bool = True,
        workdir_quota_mb: int | None = 512,
        quota_volume: bool = True,
        whole_tree_limits: bool = True,
        python: str | None = None,
        pytest_from: str = "auto",
        bwrap_path: str | os.PathLike[str] | None = "auto",
        require_isolation: bool = False,
        run_as_uid: int | None = None,
        run_as_gid: int | None = None,
        hide_paths: Sequence[str] = DEFAULT_HIDE_PATHS,
        ro_binds: Sequence[str | os.PathLike[str]] = (),
        env: Mapping[str, str] | None = None,
        denylist: frozenset[str] = SANDBOX_DENYLIST,
    ) -> None:
        self.workdir = Path(workdir).resolve()
        if not self.workdir.is_dir():
            raise ValueError(f"workdir {str(workdir)!r} is not an existing directory")
        if not exec_timeout_s > 0:
            raise ValueError(f"exec_timeout_s must be > 0, got {exec_timeout_s!r}")
        if pytest_from not in ("auto", "bundle", "python"):
            raise ValueError(
                f"pytest_from must be 'auto', 'bundle' or 'python', got {pytest_from!r}"
            )
        if tmp_size_mb <= 0:
            raise ValueError(f"tmp_size_mb must be > 0, got {tmp_size_mb!r}")
        self.exec_timeout_s = float(exec_timeout_s)
        self.limits = ResourceLimits(
            mem_mb=mem_limit_mb,
            cpu_s=cpu_time_s if cpu_time_s is not None else int(exec_timeout_s) + 1,
            file_mb=max_file_mb,
            open_files=max_open_files,
            processes=max_processes,
        )
        self.max_output_bytes = max_output_bytes
        self.tmp_size_mb = tmp_size_mb
        if shm_size_mb <= 0:
            raise ValueError(f"shm_size_mb must be > 0, got {shm_size_mb!r}")
        self.shm_size_mb = shm_size_mb
        self.workdir_writable = workdir_writable
        self.workdir_quota_bytes: int | None = None
        if workdir_quota_mb is not None and workdir_writable:
            if workdir_quota_mb <= 0:
                raise ValueError(f"workdir_quota_mb must be > 0 or None, got {workdir_quota_mb!r}")
            self.workdir_quota_bytes = workdir_quota_mb * 1024 * 1024
            used = disk_usage(self.workdir, self.workdir_quota_bytes)
            if used > self.workdir_quota_bytes:
                raise ValueError(
                    f"workdir {str(self.workdir)!r} already occupies more than its quota of "
                    f"{workdir_quota_mb} MB; pass a larger workdir_quota_mb (or None)"
                )
        self.over_quota: str | None = None
        # "volume" (a tmpfs of the quota's size), "measured", or None (no quota)
        self.quota_enforcement: str | None = None
        self.quota_volume_unavailable = ""
        if self.workdir_quota_bytes is not None:
            reason = volume_support() if quota_volume else "quota_volume=False"
            self.quota_enforcement = "measured" if reason else "volume"
            self.quota_volume_unavailable = reason
        self._volume: QuotaVolume | None = None
        self.python = python or sandbox_python()
        self.pytest_from = pytest_from
        self.denylist = denylist
        self.extra_env = dict(env or {})
        self.uid, self.gid = resolve_identity(run_as_uid, run_as_gid)
        # As root without a fixed identity, each run leases a uid of its own.
        self.lease_uids = run_as_uid is None and os.geteuid() == 0
        self.cgroups = None
        if whole_tree_limits:
            support = cgroup_support()
            self.cgroups = support if support.version else None
        self.whole_tree_limits = self.cgroups is not None
        check_reachable(self.workdir, self._effective_uid(), self._effective_gid())
        hidden = [str(Path(p)) for p in hide_paths if os.path.isdir(p) and not os.path.islink(p)]
        # a directory inside another hidden one is hidden already (and could not be mounted)
        self.hide_paths = tuple(
            p for p in dict.fromkeys(hidden) if not any(p.startswith(q + "/") for q in hidden)
        )
        self.ro_binds = tuple(str(Path(p).resolve()) for p in ro_binds)
        self.bwrap, reason = find_bwrap(bwrap_path, self.uid, self.gid)
        self.isolated = self.bwrap is not None
        if not self.isolated:
            if require_isolation:
                raise RuntimeError(
                    f"bubblewrap isolation required but unavailable: {reason}. Install it "
                    "(apt-get install bubblewrap) or use DockerSandbox"
                )
            message = (
                f"LocalSubprocessSandbox({str(self.workdir)!r}) runs WITHOUT namespace "
                f"isolation ({reason}): only resource limits, uid drop and timeouts apply; "
                "commands can read what the sandbox uid can read and reach the network. "
                "This is not a security boundary; install bubblewrap or use DockerSandbox."
            )
            warnings.warn(message, RuntimeWarning, stacklevel=2)
            log.warning(message)
        self._booted = False
        self._use_bundle = False
        self.last_infrastructure_error: str | None = None
        self._trajectory: list[dict[str, Any]] = []

    # identity and isolation -------------------------------------------------------------
    def _effective_uid(self) -> int:
        return self.uid if self.uid is not None else os.geteuid()

    def _effective_gid(self) -> int:
        return self.gid if self.gid is not None else os.getegid()

    def _env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = {
            "PATH": f"{interpreter_bin_dir(self.python)}:{BASE_PATH}",
            **SANDBOX_ENV,
            WORKTREE_ENV: str(self.workdir),
            "TMPDIR": "/tmp",
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
        }
        if self._use_bundle:
            env["PYTHONPATH"] = str(pytest_bundle_dir())
        env.update(self.extra_env)
        env.update(extra or {})
        return env

    def _run(
        self,
        inner: list[str],
        timeout_s: float | None = None,
        extra_env: Mapping[str, str] | None = None,
    ) -> ProcessOutcome:
        """Run ``inner`` in the sandbox; a run the sandbox could not start comes back with
        ``self.last_infrastructure_error`` set (and says so in its output)."""
        if not self.lease_uids:
            return self._run_as(inner, timeout_s, self.uid, self.gid, extra_env)
        with lease_uid() as uid:
            if self.quota_enforcement != "volume":  # (a volume is handed over as it loads)
                hand_over(self.workdir, uid, uid)
            return self._run_as(inner, timeout_s, uid, uid, extra_env)

    def _run_as(
        self,
        inner: list[str],
        timeout_s: float | None,
        uid: int | None,
        gid: int | None,
        extra_env: Mapping[str, str] | None = None,
    ) -> ProcessOutcome:
        limits = self.limits
        self.last_infrastructure_error = None
        volume = None
        measured: Path = self.workdir
        if self.workdir_quota_bytes is not None:
            if self.quota_enforcement == "volume":
                try:
                    volume = self._loaded_volume(uid, gid)
                except VolumeFull:  # files the host put there since: they alone fill it
                    self.over_quota = self.over_quota or quota_reached(self.workdir_quota_bytes)
                    return self._refused()
                except VolumeError as exc:
                    return self._not_started(inner, exc)
                measured = volume.path
            room = quota_room(measured, self.workdir_quota_bytes)
            if room == 0:  # e.g. files the host put there since: nothing can be written
                self.over_quota = self.over_quota or quota_reached(self.workdir_quota_bytes)
                return self._refused()
            # one file can take at most the room left: the kernel stops it there
            limits = dataclasses.replace(limits, file_bytes=room)
        env = self._env(extra_env)
        started = with_start_marker(inner)
        if self.bwrap is not None:
            argv = bwrap_argv(
                self.bwrap,
                started,
                workdir=self.workdir,
                env=env,
                tmp_size_mb=self.tmp_size_mb,
                shm_size_mb=self.shm_size_mb,
                workdir_writable=self.workdir_writable,
                hide_paths=self.hide_paths,
                ro_binds=[*self.ro_binds, str(support_root())],
                python=self.python,
            )
            outer_env = {"PATH": BASE_PATH}
        else:
            argv, outer_env = started, env
        group = None
        quota = self.workdir_quota_bytes
        try:
            if self.cgroups is not None:
                group = RunCgroup(
                    self.cgroups, mem_mb=self.limits.mem_mb, max_pids=self.limits.processes
                )
            outcome = run_bounded(
                argv,
                cwd=self.workdir,
                env=outer_env,
                timeout_s=timeout_s or self.exec_timeout_s,
                max_output_bytes=self.max_output_bytes,
                limits=limits,
                uid=uid,
                gid=gid,
                cgroup_procs=group.procs_files if group is not None else (),
                watch=(lambda: over_quota(measured, quota)) if quota is not None else None,
                namespace=volume.mount_namespace() if volume is not None else None,
            )
        except OSError as exc:  # e.g. the interpreter does not exist: data, not a crash
            return self._not_started(inner, exc)
        finally:
            if group is not None:
                group.close()
        if quota is not None and self.over_quota is None:
            if outcome.stopped is None:
                outcome = dataclasses.replace(outcome, stopped=over_quota(measured, quota))
            self.over_quota = outcome.stopped
        if volume is not None:
            try:
                volume.store()
            except VolumeError as exc:  # the host keeps what it had before the command
                note = f"\n[sandbox error: {exc}; the command's changes are lost]".encode()
                self.last_infrastructure_error = note.decode().strip()
                outcome = dataclasses.replace(
                    outcome,
                    output=outcome.output + note,
                    total_bytes=outcome.total_bytes + len(note),
                )
        started_outcome = strip_start_marker(outcome)
        if started_outcome is not None:
            return started_outcome
        self.last_infrastructure_error = (
            f"the sandbox did not start the command: {outcome.text().strip()[-300:]!r}"
        )
        return outcome

    def _loaded_volume(self, uid: int | None, gid: int | None) -> QuotaVolume:
        """The quota volume (made on first use, again if its holder died), holding a copy
        of the host workdir owned by the identity the command runs as."""
        assert self.workdir_quota_bytes is not None
        if self._volume is None or not self._volume.alive:
            self._volume = QuotaVolume(self.workdir, self.workdir_quota_bytes)
        owner_uid = uid if uid is not None else os.geteuid()
        self._volume.load(owner=(owner_uid, gid if gid is not None else owner_uid))
        return self._volume

    def _not_started(self, inner: Sequence[str], exc: OSError) -> ProcessOutcome:
        text = f"sandbox error: could not start {inner[0]!r}: {exc}".encode()
        self.last_infrastructure_error = text.decode()
        return ProcessOutcome(None, text, len(text), False, False, 0.0)

    def close(self) -> None:
        """Release the quota volume (its holder process and tmpfs); the host workdir stays.
        A later command makes a new one."""
        if self._volume is not None:
            self._volume.close()
            self._volume = None

    def _refused(self) -> ProcessOutcome:
        text = f"Error: {self.over_quota}; no further commands run in this workdir".encode()
        return ProcessOutcome(None, text, len(text), False, False, 0.0, stopped=self.over_quota)

    # the Sandbox protocol ---------------------------------------------------------------
    def boot(self, image: str | None = None) -> None:
        """Prepare the workdir and pick the pytest source. `image` is recorded, not used:
        this backend's "image" is the host filesystem."""
        if not self.lease_uids and self.quota_enforcement != "volume":
            hand_over(self.workdir, self.uid, self.gid)
        if not self._booted:
            self._use_bundle = self._needs_bundle()
            self._booted = True
        self._trajectory.append({"type": "boot", "image": image, "isolated": self.isolated})

    def _needs_bundle(self) -> bool:
        if self.pytest_from == "python":
            return False
        if self.pytest_from == "auto":
            key = (self.python, self.uid, self.isolated)
            if key not in _OWN_PYTEST:
                probe = self._run([self.python, "-c", "import pytest"], timeout_s=30)
                _OWN_PYTEST[key] = probe.exit_code == 0
            if _OWN_PYTEST[key]:
                return False
        self._use_bundle = True
        check = self._run([self.python, "-c", "import pytest, pluggy"], timeout_s=30)
        if check.exit_code != 0:
            raise RuntimeError(
                f"the sandbox interpreter {self.python!r} cannot import the pytest bundle "
                f"(uid {self._effective_uid()}): {check.text().strip()[-500:]!r}. Pass python= "
                f"an interpreter of Python {sys.version_info.major}.{sys.version_info.minor} "
                "that the sandbox uid can execute (e.g. /usr/bin/python3)"
            )
        return True

    def _ensure_booted(self) -> None:
        if not self._booted:
            self.boot(None)
        elif not self.lease_uids and self.quota_enforcement != "volume":
            # files the host added since (a leased uid, or a volume, gets them at every run)
            hand_over(self.workdir, self.uid, self.gid)

    def exec(self, action: Mapping[str, Any]) -> str:
        """Run `action["command"]` with /bin/sh in the workdir; combined stdout/stderr."""
        command = action_command(action)
        entry: dict[str, Any] = {"type": "exec", "command": command, "isolated": self.isolated}
        refusal = self._refusal(entry, command)
        if refusal is not None:
            return refusal
        self._ensure_booted()
        outcome = self._refused() if self.over_quota else self._run(["/bin/sh", "-c", command])
        return self._record_exec(
            entry,
            outcome,
            self.exec_timeout_s,
            infrastructure_error=self.last_infrastructure_error,
            truncated=outcome.truncated,
            stopped=outcome.stopped,
        )

    #: ``run_tests`` takes ``guard=`` (the behaviour guard runs in this backend).
    supports_behaviour_guard = True

    def run_tests(
        self,
        test_command: str = "python -m pytest -q",
        tests: Sequence[str] = (),
        *,
        guard: GuardSpec | None = None,
    ) -> TestRunResult:
        """Run the test command (pytest gets a junit report) and return the parsed result.

        With ``guard``, every Python process of the run is under the behaviour guard
        (``sandbox.behaviour_guard``): what the agent's code did to the report, the tests or
        the runtime is refused and comes back as ``behaviour_flags``.
        """
        self._ensure_booted()
        entry = entry_for_tests(
            test_command,
            tests,
            python=self.python,
            workdir=self.workdir,
            guard=guard,
            with_bundle=self._use_bundle,
        )
        outcome = self._refused() if self.over_quota else self._run(entry.argv, extra_env=entry.env)
        result = result_of_tests(
            entry,
            outcome,
            timeout_s=self.exec_timeout_s,
            isolated=self.isolated,
            infrastructure_error=self.last_infrastructure_error,
        )
        return self._record_tests(test_command, tests, result, stopped=outcome.stopped)

    def __repr__(self) -> str:
        return (
            f"LocalSubprocessSandbox({str(self.workdir)!r}, isolated={self.isolated}, "
            f"uid={self._effective_uid()}, python={self.python!r})"
        )
