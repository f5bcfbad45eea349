"""``feature_deletion``: restore a deleted function body with tools; the repo's tests grade it.

Tasks are the files ``composer-replication datagen`` writes (``datagen.feature_deletion``):
the task file (``tasks.jsonl``), its ``.heldout.jsonl`` sibling when a split was used (both
are loaded: ``task_ids()`` lists every task and the training loop's ``HeldoutSplit``
decides which ones it may train on), the stubbed task workdirs (``<stem>.workdirs/``) and
the hidden references (``<stem>.reference.jsonl``). Each attempt:

1. materialise: copy the task's stubbed workdir into a fresh directory the sandbox uid can
   reach, ``scrub_tree`` it, and snapshot it with ``HackMonitor``;
2. act: ``run_agent_rollouts`` with the tools ``read_file(path)``,
   ``write_file(path, content)``, ``run_tests(tests?)`` and ``finish()``;
3. score: run the whole suite once more in the sandbox. reward = the fraction of the
   task's target tests that pass, or 0.0 when any other originally passing test no longer
   passes; then ``HackMonitor.check`` (workdir diff + the tool log): a flagged attempt
   scores 0.0 and its verdict is kept in ``metadata["hack"]``. Failing test output becomes
   ``feedback`` (the SDPO error site).

What the tools (``envs.fd_tools``, re-exported here) guarantee: every path is resolved (symlinks followed) and must stay inside
the attempt's workdir, so ``..``, absolute paths and links pointing outside come back as an
``Error:`` observation; only regular files with a single hard link are read (at most
``MAX_READ_BYTES``) or replaced; ``run_tests`` accepts test ids, never pytest options. Reads and writes run on the
host (as our uid); everything the agent's code does runs inside the sandbox
(``LocalSubprocessSandbox`` by default). Writing tests is not blocked: the monitor sees it.

The references are read only by ``solve_with_reference`` (the task's gold answer through
the same tools and scorer); they never enter a workdir or a prompt.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication.envs.fd_tasks import (
    FDTask,
    TaskReference,
    output_paths,
    read_jsonl_records,
    read_split_record,
)
from composer_replication.envs.fd_tools import (
    FD_TOOLS,
    TOOLS,
    FDAttempt,
    finish,
    read_file,
    resolve_in_workdir,
    run_tests,
    write_file,
)
from composer_replication.envs.repository_grading import guard_spec, restore_protected
from composer_replication.rollout.agent import (
    Episode,
    SampleFn,
    ScriptedSampler,
    run_agent_rollouts,
    sampler_step,
)
from composer_replication.rollout.generate import SamplingSettings
from composer_replication.rollout.tool_calls import (
    STOP_STRINGS,
    format_tool_call,
    tool_instructions,
)
from composer_replication.rollout.types import Rollout
from composer_replication.safety.hack_monitor import (
    HackLog,
    HackMonitor,
    HackVerdict,
    score_with_monitor,
)
from composer_replication.sandbox.scrub import scrub_tree
from composer_replication.sandbox.workdir import make_shared_tempdir

if TYPE_CHECKING:
    from composer_replication.roles import Sampler

__all__ = [
    "FD_TOOLS",
    "TOOLS",
    "FDAttempt",
    "FeatureDeletionEnv",
    "default_sandbox_factory",
    "finish",
    "read_file",
    "resolve_in_workdir",
    "run_tests",
    "write_file",
]

FEEDBACK_CHARS = 1500
MAX_LISTED_FILES = 60
PREAMBLE = (
    "You are a careful software engineer working in a Python repository. Paths are relative "
    "to the repository root. Read the code, restore what is missing, run the tests, and call "
    "finish when they pass."
)


def default_sandbox_factory(workdir: Path) -> Any:
    from composer_replication.sandbox.local import LocalSubprocessSandbox
    from composer_replication.sandbox.workdir import quota_fitting

    # the quota fits the repository however large, with 512 MB for what the agent writes
    return LocalSubprocessSandbox(
        workdir, exec_timeout_s=60, mem_limit_mb=1024, workdir_quota_mb=quota_fitting(workdir)
    )


def docker_sandbox_factory(settings: dict[str, Any]) -> Callable[[Path], Any]:
    """The factory of ``sandbox = "docker"``: one container per attempt (closed after scoring).

    ``settings`` are the ``[envs.docker]`` table; unset, the command limit is 60 s as locally.
    """
    from composer_replication.sandbox.docker import DockerSandboxFactory

    options = {"exec_timeout_s": 60, **settings}
    return DockerSandboxFactory(options.pop("image"), **options)


class FeatureDeletionEnv:
    """FD tasks from a datagen task file, attempted with tools in a sandbox.

    Args:
        task_file: The training task file ``composer-replication datagen`` wrote; its
            ``.heldout.jsonl`` sibling is loaded too when it exists.
        repo_root: Directory holding the task workdirs (default: each task's recorded
            ``workdir``, else the ``<stem>.workdirs`` sibling of the task file).
        references_file: The hidden references (default ``<stem>.reference.jsonl``), read
            only by ``solve_with_reference``.
        sandbox_factory: ``workdir -> sandbox`` (``run_tests``, ``trajectory``).
        max_turns, max_total_tokens, max_observation_chars: Agent-loop limits
            (``run_agent_rollouts``).
        grading_workers: Attempts scored in parallel.
        hack_log: Optional JSONL file recording every monitor verdict.
    """

    name = "feature_deletion"

    def __init__(
        self,
        task_file: str | os.PathLike[str],
        *,
        repo_root: str | os.PathLike[str] | None = None,
        references_file: str | os.PathLike[str] | None = None,
        sandbox_factory: Callable[[Path], Any] = default_sandbox_factory,
        max_turns: int = 6,
        max_total_tokens: int = 4096,
        max_observation_chars: int = 4000,
        grading_workers: int = 2,
        hack_log: str | os.PathLike[str] | None = None,
    ) -> None:
        task_file = Path(task_file)
        if not task_file.is_file():
            raise FileNotFoundError(f"FD task file {str(task_file)!r} does not exist")
        heldout_file, default_refs, workdirs = output_paths(task_file)
        records = read_jsonl_records(task_file)
        if heldout_file.is_file():
            records += read_jsonl_records(heldout_file)
        #: the split datagen made these tasks with (None: not recorded); a run checks
        #: that it splits the same way (``trainer.runtime.build_runtime``)
        self.recorded_split = read_split_record(task_file)
        self.tasks: dict[str, FDTask] = {}
        for record in records:
            task = FDTask.from_json(record)
            if task.task_id in self.tasks:
                raise ValueError(f"task {task.task_id!r} appears twice in {task_file}")
            self.tasks[task.task_id] = task
        if not self.tasks:
            raise ValueError(f"{task_file} holds no tasks; run composer-replication datagen")
        self.workdirs = {
            tid: self._find_workdir(t, repo_root, workdirs) for tid, t in self.tasks.items()
        }
        self.references_file = Path(references_file or default_refs)
        self.sandbox_factory = sandbox_factory
        self.max_turns = max_turns
        self.max_total_tokens = max_total_tokens
        self.max_observation_chars = max_observation_chars
        self.grading_workers = max(1, grading_workers)
        self.hack_log = HackLog(hack_log) if hack_log else None
        self.monitor = HackMonitor(
            forbidden_globs=(
                str(self.references_file.resolve()),
                str(heldout_file.resolve()),
                "*.reference.jsonl",
                "*.heldout.jsonl",
            )
        )

    @staticmethod
    def _find_workdir(task: FDTask, repo_root: Any, workdirs: Path) -> Path:
        name = Path(task.workdir).name
        if repo_root is not None:
            candidates = [Path(repo_root) / name]
        else:
            candidates = [Path(task.workdir), workdirs / name]
        for candidate in candidates:
            if candidate.is_dir():
                return candidate
        raise FileNotFoundError(
            f"task {task.task_id!r}: no workdir at {[str(c) for c in candidates]}; pass "
            "repo_root= the directory holding the task workdirs (datagen writes them to "
            "<stem>.workdirs next to the task file)"
        )

    def task_ids(self) -> list[str]:
        return list(self.tasks)

    def messages(self, task: FDTask) -> list[dict[str, str]]:
        files = "\n".join(task.files[:MAX_LISTED_FILES])
        if len(task.files) > MAX_LISTED_FILES:
            files += f"\n... and {len(task.files) - MAX_LISTED_FILES} more"
        return [
            {"role": "system", "content": tool_instructions(FD_TOOLS, PREAMBLE)},
            {"role": "user", "content": f"{task.prompt.rstrip()}\n\nRepository files:\n{files}"},
        ]

    def rollouts(
        self,
        sampler: Sampler | None,
        tokenizer: Any,
        task_ids: Sequence[str],
        *,
        group_size: int,
        sampling: SamplingSettings,
        sample_fn: SampleFn | None = None,
    ) -> list[list[Rollout]]:
        """``group_size`` scored attempts per task, each turn sampled by ``sampler``;
        ``sample_fn`` replaces that sampling step (``rollout.agent``; ``sampler`` may then
        be None)."""
        unknown = [t for t in task_ids if t not in self.tasks]
        if unknown:
            raise ValueError(f"unknown feature_deletion task ids {unknown[:5]}")
        if sample_fn is None:
            if sampler is None:
                raise ValueError("feature_deletion rollouts need a sampler or a sample_fn")
            sample_fn = sampler_step(sampler, tokenizer)
        return self._run(tokenizer, task_ids, group_size, sampling, sample_fn)

    def _run(
        self,
        tokenizer: Any,
        task_ids: Sequence[str],
        group_size: int,
        sampling: SamplingSettings,
        sample_fn: SampleFn,
        min_turns: int = 1,
        max_total_tokens: int | None = None,
    ) -> list[list[Rollout]]:
        scratch = make_shared_tempdir("composer-replication-fd-env-")
        attempts: list[FDAttempt] = []
        try:
            for tid in task_ids:
                for _ in range(group_size):
                    attempts.append(self._materialise(tid, scratch / f"{len(attempts):04d}"))
            rollouts = run_agent_rollouts(
                None,
                tokenizer,
                [Episode(a.task.task_id, self.messages(a.task), a) for a in attempts],
                sampling=sampling,
                max_turns=max(self.max_turns, min_turns),
                tools=TOOLS,
                max_total_tokens=max_total_tokens or self.max_total_tokens,
                max_observation_chars=self.max_observation_chars,
                sample_fn=sample_fn,
            )
            with ThreadPoolExecutor(self.grading_workers) as pool:
                list(pool.map(self.score, attempts, rollouts))
        finally:
            for attempt in attempts:
                close = getattr(attempt.sandbox, "close", None)
                if callable(close):
                    close()
            shutil.rmtree(scratch, ignore_errors=True)
        groups: dict[str, list[Rollout]] = {tid: [] for tid in task_ids}
        for rollout in rollouts:
            groups[rollout.task_id].append(rollout)
        return [groups[tid] for tid in task_ids]

    def _materialise(self, task_id: str, dest: Path) -> FDAttempt:
        shutil.copytree(self.workdirs[task_id], dest, symlinks=True)
        scrub_tree(dest)
        return FDAttempt(
            task=self.tasks[task_id],
            workdir=dest,
            sandbox=self.sandbox_factory(dest),
            manifest=self.monitor.snapshot(dest),
        )

    def score(self, attempt: FDAttempt, rollout: Rollout) -> None:
        """Grade the attempt's workdir and fill in the rollout's reward, feedback, metadata.

        Trust nothing the agent could touch: the monitor judges the workdir as the agent
        left it, then every test and runner-configuration file is restored from the
        pristine task copy (what the agent added there is removed) and the suite runs in a
        fresh sandbox process under the behaviour guard (backends that support it): what
        the agent's changed files do to the report, the tests or the runtime while tested is
        refused and flags the attempt. Every expected test id must be in the report and the runner's
        exit code must agree with it; a timeout, a missing report or a disagreement is 0
        with an error. A sandbox that never started is an infrastructure error. Never raises.
        """
        task = attempt.task
        trajectory = [*attempt.sandbox.trajectory(), *attempt.actions]
        verdict = self.monitor.check(attempt.manifest, attempt.workdir, trajectory)
        reward = 0.0
        if rollout.error is None:
            try:
                pristine = self.workdirs[task.task_id]
                restore_protected(pristine, attempt.workdir, self.monitor)
                guard = {}
                if getattr(attempt.sandbox, "supports_behaviour_guard", False):
                    guard["guard"] = guard_spec(pristine, attempt.workdir, self.monitor)
                result = attempt.sandbox.run_tests(task.test_command, (), **guard)
            except Exception as err:  # a failing sandbox is data, not a crash
                rollout.error = f"sandbox_error: final test run: {type(err).__name__}: {err}"
            else:
                if getattr(result, "infrastructure_error", None):
                    rollout.error = f"sandbox did not start: {result.infrastructure_error}"
                    rollout.metadata["infrastructure_error"] = True
                else:
                    reward = self._test_reward(task, result, rollout)
                    observed = list(getattr(result, "behaviour_flags", ()))
                    if observed:  # what the guard saw the agent's code do while tested
                        verdict = HackVerdict(
                            True, tuple(dict.fromkeys([*verdict.reasons, *observed]))
                        )
        rollout.metadata["reward_before_monitor"] = reward
        rollout.metadata["hack"] = {"flagged": verdict.flagged, "reasons": list(verdict.reasons)}
        if verdict.flagged:
            rollout.metadata["hack_flags"] = list(verdict.reasons)
        rollout.reward = score_with_monitor(reward, verdict)
        if verdict.flagged:
            rollout.feedback = (
                f"HackMonitor flagged this attempt ({'; '.join(verdict.reasons)}). Restore the "
                "feature in the code under test; never change tests or test configuration."
            )
        if self.hack_log is not None:
            self.hack_log.record(task.task_id, verdict, reward_before_monitor=reward)

    @staticmethod
    def _test_reward(task: FDTask, result: Any, rollout: Rollout) -> float:
        targets = set(task.target_tests)
        expected = [
            *task.passing_tests,
            *(t for t in task.target_tests if t not in task.passing_tests),
        ]
        missing = [t for t in expected if t not in result.outcomes]
        passed = sum(result.outcomes.get(t) == "passed" for t in task.target_tests)
        broken = [
            t for t in task.passing_tests if t not in targets and result.outcomes.get(t) != "passed"
        ]
        reward = 0.0 if broken else passed / len(task.target_tests)
        all_green = result.failed == 0 and result.errors == 0
        if result.timed_out:
            rollout.error, reward = "timeout: the final test run timed out", 0.0
        elif missing:
            rollout.error = f"missing report for {len(missing)} of {len(expected)} tests"
            reward = 0.0
        elif all_green != (result.exit_code == 0):
            rollout.error = (
                f"the runner's exit code {result.exit_code} disagrees with its report "
                f"({result.passed} passed, {result.failed} failed, {result.errors} errors)"
            )
            reward = 0.0
        rollout.metadata.update(
            passed_targets=passed,
            n_targets=len(task.target_tests),
            broken_tests=broken,
            missing_tests=missing,
            tests={"passed": result.passed, "failed": result.failed, "errors": result.errors},
            isolated=result.isolated,
        )
        if reward < 1.0:
            rollout.feedback = result.output[-FEEDBACK_CHARS:]
        return reward

    def solve_with_reference(self, tokenizer: Any, task_id: str) -> Rollout:
        """The task's gold answer (read the file, write the reference body in, run the tests,
        finish) through the same tools, sandbox and scorer; reward 1.0 for a sound task."""
        refs = [TaskReference.from_json(r) for r in read_jsonl_records(self.references_file)]
        ref = next((r for r in refs if r.task_id == task_id), None)
        if ref is None:
            raise ValueError(f"no reference for {task_id!r} in {self.references_file}")
        lines = (self.workdirs[task_id] / ref.file).read_text(encoding="utf-8").splitlines(True)
        if "".join(lines[ref.start_line - 1 : ref.end_line]) != ref.stub:
            raise ValueError(f"the stub of {task_id!r} is not where its reference says")
        lines[ref.start_line - 1 : ref.end_line] = [ref.body]
        script = [
            format_tool_call("read_file", {"path": ref.file}),
            format_tool_call("write_file", {"path": ref.file, "content": "".join(lines)}),
            format_tool_call("run_tests"),
            format_tool_call("finish"),
        ]
        longest = max(len(tokenizer(s, add_special_tokens=False)["input_ids"]) for s in script)
        sampling = SamplingSettings(
            max_new_tokens=longest + 1, temperature=0, stop_strings=STOP_STRINGS
        )
        sampler = ScriptedSampler(tokenizer, [script])
        # scripted: no model context to protect, so the token cap is lifted
        groups = self._run(
            tokenizer, [task_id], 1, sampling, sampler, len(script), max_total_tokens=1 << 30
        )
        return groups[0][0]
