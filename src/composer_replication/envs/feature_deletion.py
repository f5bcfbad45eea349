"""``feature_deletion``: repository tasks attempted with editing tools; the repo's tests grade.

Tasks are the files ``composer-replication datagen`` writes (``datagen.feature_deletion``;
SWE-style instances imported by ``datagen.swe``): the task file (``tasks.jsonl``), its
``.heldout.jsonl`` sibling when a split was used (both are loaded: ``task_ids()`` lists
every task and the training loop's ``HeldoutSplit`` decides which ones it may train on),
the task workdirs (``<stem>.workdirs/``) and the hidden references
(``<stem>.reference.jsonl``). Each attempt:

1. materialise: copy the task's workdir into a fresh directory the sandbox uid can reach,
   ``scrub_tree`` it, and snapshot it with ``HackMonitor``;
2. act: ``run_agent_rollouts`` with the editing tools (``envs.fd_tools``: ``read_file``,
   ``search``, ``replace``, ``create_file``, ``run_tests`` and ``finish`` by default;
   ``write_file`` and ``shell`` on request), calls written in the model's own tool syntax
   where its chat template has one (``tool_format``);
3. score, as soon as the episode ends (while the others still run): ``HackMonitor.check``
   judges the workdir as the agent left it (workdir diff + the tool log), the test and
   configuration files are put back, and the task's tests (``graded_tests``; the whole
   suite when it names none) run once more in the sandbox. reward = the fraction of the
   task's target tests that pass, or 0.0 when any other originally passing test no longer
   passes; a flagged attempt scores 0.0 and its verdict is kept in ``metadata["hack"]``.
   Failing test output becomes ``feedback``.

A task may carry its own environment: the interpreter of a virtualenv holding the
repository's declared dependencies (``FDTask.python``), or a container image
(``FDTask.image``); the sandbox factory is called with them (``FDTask.sandbox_options``).

The references are read only by the scripted reference agent (``envs.reference_agent``):
``solve_with_reference`` runs a task's gold answer through the same tools, loop, budgets
and scorer, and ``demonstrations`` gives those episodes as the warm start of
``sampling.source = "reference"``; they never enter a workdir or a prompt. A task records
what its reference needed when it was accepted (``FDTask.reference_cost``); sampling with
budgets smaller than that is refused, naming the setting.
"""

from __future__ import annotations

import os
import shutil
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication.envs.fd_reference import DEFAULT_REPLY_TOKENS as DEFAULT_REPLY_TOKENS
from composer_replication.envs.fd_reference import ReferenceEpisodes
from composer_replication.envs.fd_tasks import (
    FDTask,
    output_paths,
    read_jsonl_records,
    read_split_record,
)
from composer_replication.envs.fd_tools import (
    DEFAULT_TOOLS,
    FD_TOOLS,
    TOOLS,
    FDAttempt,
    finish,
    read_file,
    resolve_in_workdir,
    run_tests,
    search,
    tool_specs,
    write_file,
)
from composer_replication.envs.reference_agent import (
    REFERENCE_EDITS,
    ReferenceCost,
    reference_edits_for,
)
from composer_replication.envs.repository_grading import guard_spec, restore_protected
from composer_replication.inference.decoding.generate import SamplingSettings, reuse_prompt_states
from composer_replication.rollout.agent import (
    SCHEDULING,
    Episode,
    SampleFn,
    run_agent_rollouts,
    sampler_step,
)
from composer_replication.rollout.tool_formats import TextToolFormat, ToolFormat, tool_format_for
from composer_replication.safety.hack_monitor import (
    PROTECTED_PATTERNS,
    HackLog,
    HackMonitor,
    HackVerdict,
    score_with_monitor,
)
from composer_replication.samples.rollouts import Rollout
from composer_replication.sandbox.scrub import scrub_tree
from composer_replication.sandbox.workdir import make_shared_tempdir

if TYPE_CHECKING:
    from composer_replication.roles import Sampler

__all__ = [
    "FD_TOOLS",
    "TOOLS",
    "FDAttempt",
    "FeatureDeletionEnv",
    "check_options",
    "default_sandbox_factory",
    "finish",
    "read_file",
    "resolve_in_workdir",
    "run_tests",
    "search",
    "write_file",
]

FEEDBACK_CHARS = 1500
MAX_LISTED_FILES = 60
PREAMBLE = (
    "You are a careful software engineer working in a Python repository. Paths are relative "
    "to the repository root. Read the code, make the change the task asks for, run the "
    "tests, and call finish when they pass."
)
#: the turn budget a reference run gets when none is given (sampling.max_new_tokens' default)


def default_sandbox_factory(
    workdir: Path,
    *,
    python: str | None = None,
    ro_binds: Sequence[str] = (),
    image: str | None = None,
) -> Any:
    """A ``LocalSubprocessSandbox`` for an attempt: 60 s per command, 1 GB, a quota that fits
    the repository; ``python`` / ``ro_binds``: a task's own interpreter and its folder.

    Raises:
        ValueError: the task names a container ``image`` (its tests need it: run the
            environment with ``sandbox = "docker"``).
    """
    from composer_replication.sandbox.local import LocalSubprocessSandbox
    from composer_replication.sandbox.workdir import quota_fitting

    if image:
        raise ValueError(
            f"this task's tests run in the container image {image!r}; set sandbox = 'docker' "
            "(with [envs.docker]) for its environment"
        )

    # the quota fits the repository however large, with 512 MB for what the agent writes
    return LocalSubprocessSandbox(
        workdir,
        exec_timeout_s=60,
        mem_limit_mb=1024,
        workdir_quota_mb=quota_fitting(workdir),
        python=python,
        ro_binds=ro_binds,
    )


def docker_sandbox_factory(settings: dict[str, Any]) -> Any:
    """The factory of ``sandbox = "docker"``: one container per attempt (closed after scoring),
    from the task's own image when it names one (a task prepared with a host virtualenv is
    refused: its interpreter is not in any image).

    ``settings`` are the ``[envs.docker]`` table; unset, the command limit is 60 s as locally.
    """
    from composer_replication.sandbox.docker import DockerSandboxFactory

    options = {"exec_timeout_s": 60, **settings}
    return DockerSandboxFactory(options.pop("image"), **options)


_COUNTS = (
    "max_turns",
    "max_total_tokens",
    "max_observation_chars",
    "page_lines",
    "tool_workers",
    "generation_batch",
    "grading_workers",
)


def check_options(**options: Any) -> None:
    """Refuse options ``FeatureDeletionEnv`` cannot run with (the run checks them before it
    loads anything, the constructor again): each in one line naming the option and the fix.

    Raises:
        ValueError: an unknown tool or no ``finish``, a count below 1, an unknown tool
            format, scheduling or reference-edit mode, a share outside [0, 1].
    """
    if "tools" in options:
        tools = options["tools"]
        if isinstance(tools, str) or not isinstance(tools, Sequence):
            raise ValueError(
                f"feature_deletion option tools = {tools!r}: give a list of tool names"
            )
        try:
            tool_specs(list(tools))
        except ValueError as exc:
            raise ValueError(f"feature_deletion option tools: {exc}") from None
    for name in _COUNTS:
        value = options.get(name, 1)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"feature_deletion option {name} = {value!r}: give an integer >= 1")
    choices = {
        "tool_format": ("auto", "native", "text"),
        "scheduling": SCHEDULING,
        "reference_edits": ("auto", *REFERENCE_EDITS),
    }
    for name, allowed in choices.items():
        if name in options and options[name] not in allowed:
            raise ValueError(
                f"feature_deletion option {name} = {options[name]!r}: use {' or '.join(allowed)}"
            )
    share = options.get("reference_recovery", 0.0)
    if isinstance(share, bool) or not isinstance(share, int | float) or not 0.0 <= share <= 1.0:
        raise ValueError(
            f"feature_deletion option reference_recovery = {share!r}: give a share between 0 and 1"
        )


class FeatureDeletionEnv(ReferenceEpisodes):
    """Repository tasks from a datagen task file, attempted with tools in a sandbox.

    Args:
        task_file: The training task file ``composer-replication datagen`` wrote; its
            ``.heldout.jsonl`` sibling is loaded too when it exists.
        repo_root: Directory holding the task workdirs (default: each task's recorded
            ``workdir``, else the ``<stem>.workdirs`` sibling of the task file).
        references_file: The hidden references (default ``<stem>.reference.jsonl``), read
            only by the reference agent.
        sandbox_factory: ``workdir -> sandbox`` (``run_tests``, ``exec``, ``trajectory``);
            called with a task's ``sandbox_options()`` as keywords when it has any.
        tools: The tools an attempt may call (``envs.fd_tools``; ``finish`` required).
        tool_format: "auto" (the model's own tool-call syntax where its chat template has
            one, else the project's text format), "native" or "text".
        max_turns, max_total_tokens, max_observation_chars: Agent-loop limits
            (``run_agent_rollouts``); a turn's tokens are ``sampling.max_new_tokens``.
        page_lines: The most lines ``read_file`` and ``search`` show at once.
        scheduling: "async" (each episode samples again as soon as its own call returns)
            or "barrier" (turn by turn).
        reference_reads: The reference agent reads the lines around a change before editing
            (False: it edits at once, as a task whose prompt shows the code can; shorter
            demonstrations to imitate). Default: when ``tools`` has ``read_file``.
        reference_edits: "lines" (the reference replaces only the changed lines),
            "functions" (a change inside a function rewrites the whole definition: the
            demonstration writes a body after its signature and docstring, as code is
            written), "definitions" (the same with ``replace_function``: the new definition
            written once) or "auto" (the default: "definitions" when ``tools`` has
            ``replace_function`` and no ``replace``, else "lines").
        reference_recovery: The share of demonstrations (a fixed subset of the tasks) that
            first make a near miss, see the target tests fail and fix it (of the near-miss
            reply only the call and its old text are trained on, its code is not;
            ``reference_agent.with_recovery``): a warm start that has seen what to do after
            a failing test run. 0 by default.
        tool_workers: Tool calls running at once.
        generation_batch: Episodes sampled in one call at most (each turn of those ready).
        grading_workers: Attempts scored in parallel (each as soon as its episode ends).
        hack_log: Optional JSONL file recording every monitor verdict.
    """

    name = "feature_deletion"

    def __init__(
        self,
        task_file: str | os.PathLike[str],
        *,
        repo_root: str | os.PathLike[str] | None = None,
        references_file: str | os.PathLike[str] | None = None,
        sandbox_factory: Callable[..., Any] = default_sandbox_factory,
        tools: Sequence[str] = DEFAULT_TOOLS,
        tool_format: str = "auto",
        max_turns: int = 8,
        max_total_tokens: int = 4096,
        max_observation_chars: int = 4000,
        page_lines: int = 100,
        scheduling: str = "async",
        reference_reads: bool | None = None,
        reference_edits: str = "auto",
        reference_recovery: float = 0.0,
        tool_workers: int = 4,
        generation_batch: int = 16,
        grading_workers: int = 2,
        hack_log: str | os.PathLike[str] | None = None,
    ) -> None:
        task_file = Path(task_file)
        if not task_file.is_file():
            raise FileNotFoundError(f"FD task file {str(task_file)!r} does not exist")
        check_options(
            tools=tools,
            tool_format=tool_format,
            max_turns=max_turns,
            max_total_tokens=max_total_tokens,
            max_observation_chars=max_observation_chars,
            page_lines=page_lines,
            scheduling=scheduling,
            reference_edits=reference_edits,
            reference_recovery=reference_recovery,
            tool_workers=tool_workers,
            generation_batch=generation_batch,
            grading_workers=grading_workers,
        )
        self.specs = tool_specs(list(tools))
        self.tools = {spec.name: TOOLS[spec.name] for spec in self.specs}
        self.tool_format = tool_format
        heldout_file, default_refs, workdirs = output_paths(task_file)
        records = read_jsonl_records(task_file)
        if heldout_file.is_file():
            records += read_jsonl_records(heldout_file)
        #: the split datagen made these tasks with (None: not recorded); a run checks
        #: that it splits the same way (``training.runtime.build_runtime``)
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
        self.page_lines = page_lines
        self.scheduling = scheduling
        # by default the reference edits with the tools the policy has
        self.reference_reads = (
            "read_file" in tools if reference_reads is None else bool(reference_reads)
        )
        self.reference_edits = (
            reference_edits_for(tools) if reference_edits == "auto" else reference_edits
        )
        self.reference_recovery = float(reference_recovery)
        self.tool_workers = tool_workers
        self.generation_batch = generation_batch
        self.grading_workers = grading_workers
        self.hack_log = HackLog(hack_log) if hack_log else None
        self._forbidden = (
            str(self.references_file.resolve()),
            str(heldout_file.resolve()),
            "*.reference.jsonl",
            "*.heldout.jsonl",
        )
        self.monitor = HackMonitor(forbidden_globs=self._forbidden)
        self._formats: dict[int, ToolFormat] = {}
        self._demonstrations: dict[tuple[str, int], Rollout] = {}
        self._lock = threading.Lock()

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

    def evaluation_digest(self, task_ids: Sequence[str]) -> str | None:
        """Digest of what evaluating ``task_ids`` reads: their records, the bytes of their
        workdirs' files and the sandbox factory's name (None for an unnamed factory;
        :mod:`~composer_replication.evals.start_reuse`)."""
        from composer_replication.common.digests import digest_of_records, grader_name

        grader = grader_name(self.sandbox_factory)
        if grader is None:
            return None
        tasks = [self.tasks[tid] for tid in task_ids]
        files = [self.workdirs[t.task_id] / name for t in tasks for name in t.files]
        return digest_of_records([grader, *tasks], files)

    def monitor_for(self, task: FDTask) -> HackMonitor:
        """The hack monitor of ``task``: its discovered test modules are protected too."""
        if not task.test_files:
            return self.monitor
        # a root-level file's name alone would match it anywhere: anchor those with ./
        paths = tuple(dict.fromkeys(f if "/" in f else f"./{f}" for f in task.test_files))
        return HackMonitor(
            forbidden_globs=self._forbidden, protected_patterns=(*PROTECTED_PATTERNS, *paths)
        )

    def format_for(self, tokenizer: Any) -> ToolFormat:
        """The tool format of ``tokenizer``'s model (``tool_format``), made once."""
        key = id(tokenizer)
        if key not in self._formats:
            self._formats[key] = tool_format_for(tokenizer, self.specs, self.tool_format)
        return self._formats[key]

    def messages(self, task: FDTask, tool_format: ToolFormat | None = None) -> list[dict[str, str]]:
        """The prompt of an attempt: the system message (the preamble; the tools too in the
        text format) and the task with the repository's files."""
        tool_format = tool_format or TextToolFormat(self.specs)
        files = "\n".join(task.files[:MAX_LISTED_FILES])
        if len(task.files) > MAX_LISTED_FILES:
            files += f"\n... and {len(task.files) - MAX_LISTED_FILES} more"
        return [
            {"role": "system", "content": tool_format.system_prompt(PREAMBLE)},
            {"role": "user", "content": f"{task.prompt.rstrip()}\n\nRepository files:\n{files}"},
        ]

    # ------------------------------------------------------------------ attempts

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
        be None).

        Raises:
            ValueError: an unknown task id; budgets smaller than a task's reference needed.
        """
        unknown = [t for t in task_ids if t not in self.tasks]
        if unknown:
            raise ValueError(f"unknown feature_deletion task ids {unknown[:5]}")
        if sample_fn is None:
            if sampler is None:
                raise ValueError("feature_deletion rollouts need a sampler or a sample_fn")
            sample_fn = sampler_step(sampler, tokenizer)
        tool_format = self.format_for(tokenizer)
        self.check_budgets(task_ids, sampling.max_new_tokens, tool_format, tokenizer)
        return self._run(tokenizer, task_ids, group_size, sampling, sample_fn, tool_format)

    def check_budgets(
        self, task_ids: Sequence[str], max_new_tokens: int, tool_format: ToolFormat, tokenizer: Any
    ) -> None:
        """Refuse budgets smaller than what a task's reference needed when it was accepted
        (with the same tool format and tokenizer; other ones were not measured).

        Raises:
            ValueError: one line naming the task, what it needs and the setting.
        """
        name = getattr(tokenizer, "name_or_path", None)
        for tid in task_ids:
            cost = self.tasks[tid].reference_cost
            if not cost or cost.get("tool_format") != tool_format.name:
                continue
            if cost.get("tokenizer") not in (None, name):
                continue
            problem = ReferenceCost(
                int(cost["turns"]), int(cost["max_reply_tokens"]), int(cost["total_tokens"])
            ).problem(
                max_turns=self.max_turns,
                max_new_tokens=max_new_tokens,
                max_total_tokens=self.max_total_tokens,
            )
            if problem:
                raise ValueError(
                    f"feature_deletion task {tid!r} cannot be solved within this run's budgets: "
                    f"{problem}; raise it, or regenerate the tasks with these budgets"
                )

    def _run(
        self,
        tokenizer: Any,
        task_ids: Sequence[str],
        group_size: int,
        sampling: SamplingSettings,
        sample_fn: SampleFn,
        tool_format: ToolFormat,
        *,
        scored: bool = True,
    ) -> list[list[Rollout]]:
        scratch = make_shared_tempdir("composer-replication-fd-env-")
        attempts: list[FDAttempt] = []
        graded: dict[int, Future[None]] = {}
        try:
            for tid in task_ids:
                for _ in range(group_size):
                    attempts.append(self._materialise(tid, scratch / f"{len(attempts):04d}"))
            with ThreadPoolExecutor(self.grading_workers) as graders:
                # the weights hold still through the collection: each turn prefills only
                # what its episode's last prompt did not have (a sampler in this process)
                with reuse_prompt_states(outer=True, keep_finished=True) as states:

                    def grade(index: int, rollout: Rollout) -> None:
                        # no later turn extends an ended episode's states
                        states.drop_prefixes([*rollout.prompt_ids, *rollout.completion_ids])
                        if scored:  # as soon as the episode ends, while the others run
                            graded[index] = graders.submit(self.score, attempts[index], rollout)

                    rollouts = run_agent_rollouts(
                        None,
                        tokenizer,
                        [
                            Episode(a.task.task_id, self.messages(a.task, tool_format), a)
                            for a in attempts
                        ],
                        sampling=sampling,
                        max_turns=self.max_turns,
                        tools=self.tools,
                        max_total_tokens=self.max_total_tokens,
                        max_observation_chars=self.max_observation_chars,
                        sample_fn=sample_fn,
                        tool_workers=self.tool_workers,
                        generation_batch=self.generation_batch,
                        tool_format=tool_format,
                        scheduling=self.scheduling,
                        on_done=grade,
                    )
                for future in graded.values():
                    future.result()
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

    def _sandbox(self, task: FDTask, workdir: Path) -> Any:
        options = task.sandbox_options()
        return (
            self.sandbox_factory(workdir, **options) if options else self.sandbox_factory(workdir)
        )

    def _materialise(self, task_id: str, dest: Path) -> FDAttempt:
        shutil.copytree(self.workdirs[task_id], dest, symlinks=True)
        scrub_tree(dest)
        task = self.tasks[task_id]
        return FDAttempt(
            task=task,
            workdir=dest,
            sandbox=self._sandbox(task, dest),
            manifest=self.monitor_for(task).snapshot(dest),
            page_lines=self.page_lines,
            page_chars=self.max_observation_chars,
        )

    def score(self, attempt: FDAttempt, rollout: Rollout) -> None:
        """Grade the attempt's workdir and fill in the rollout's reward, feedback, metadata.

        Trust nothing the agent could touch: the monitor judges the workdir as the agent
        left it, then every test and runner-configuration file is restored from the
        pristine task copy (what the agent added there is removed) and the suite runs in a
        fresh sandbox process under the behaviour guard (backends that support it): what
        the agent's changed files do to the report, the tests or the runtime while tested is
        refused and flags the attempt. Every expected test id must be in the report and the
        runner's exit code must agree with it; a timeout, a missing report or a
        disagreement is 0 with an error. A sandbox that never started is an infrastructure
        error. Never raises.
        """
        task = attempt.task
        monitor = self.monitor_for(task)
        trajectory = [*attempt.sandbox.trajectory(), *attempt.actions]
        verdict = monitor.check(attempt.manifest, attempt.workdir, trajectory)
        reward = 0.0
        if rollout.error is None:
            try:
                pristine = self.workdirs[task.task_id]
                restore_protected(pristine, attempt.workdir, monitor)
                guard = {}
                if getattr(attempt.sandbox, "supports_behaviour_guard", False):
                    guard["guard"] = guard_spec(pristine, attempt.workdir, monitor)
                result = attempt.sandbox.run_tests(task.test_command, task.graded_tests, **guard)
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
