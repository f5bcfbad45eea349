"""``python_functions``: write a small Python function, graded by hidden tests in a sandbox.

Each task shows the model a signature and a docstring; the completion's code (fenced or
bare) is extracted and graded by :func:`~composer_replication.envs.function_grader.
grade_function`: the candidate runs in a
:class:`~composer_replication.sandbox.local.LocalSubprocessSandbox` that cannot see the
task bank, the hidden tests run in the grader's own process and call it through a
plain-data channel. Reward = fraction of the task's tests that pass (partial credit); a
timeout, crash or missing report is 0 with an error; a sandbox that never started is an
infrastructure error (``metadata["infrastructure_error"]``, excluded from training). A
completion without a function of the right name fails the format check (reward 0,
recorded). Failing tests are kept as the rollout's ``feedback``: the error site SDPO turns
into a hint. What the candidate did beside its answer is in ``metadata["hack_flags"]``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication.envs.function_grader import grade_function
from composer_replication.envs.task_bank import PythonTask, extract_code, load_tasks
from composer_replication.rollout.demonstrations import ReferenceSolutions, demonstration_rollout
from composer_replication.samples.generation import SamplingSettings
from composer_replication.samples.rollouts import REFERENCE_KEY, Rollout

if TYPE_CHECKING:
    from composer_replication.roles import Sampler

SYSTEM_PROMPT = (
    "You are a careful Python programmer. Complete the function the user gives you. "
    "Reply with the complete function in one ```python code block and nothing else."
)
FEEDBACK_CHARS = 1500
# The closing fence of the code block on its own line: nothing after it is graded, so
# sampling stops there (the opening "```python" never matches: it has no newline after ```).
STOP_STRINGS = ("\n```\n",)
#: A grade slower than this (seconds) is logged with its cause.
GRADING_STALL_S = 5.0

log = logging.getLogger(__name__)


def reference_demonstration(task: PythonTask) -> str:
    """The task's reference solution as an answer in the requested format."""
    return f"```python\n{task.reference.rstrip()}\n```"


def user_message(task: PythonTask) -> str:
    return f"Complete this function:\n```python\n{task.prompt.rstrip()}\n```"


def default_sandbox_factory(workdir: Path) -> Any:
    from composer_replication.envs.function_grader import MAX_REPORT_BYTES, hidden_from_candidates
    from composer_replication.sandbox.bwrap import DEFAULT_HIDE_PATHS
    from composer_replication.sandbox.local import LocalSubprocessSandbox

    return LocalSubprocessSandbox(
        workdir,
        exec_timeout_s=20,
        mem_limit_mb=1024,
        max_processes=64,
        tmp_size_mb=64,
        shm_size_mb=16,
        workdir_writable=False,  # the candidate writes nothing to disk
        max_output_bytes=MAX_REPORT_BYTES,
        pytest_from="python",  # the harness needs no pytest
        hide_paths=(*DEFAULT_HIDE_PATHS, *hidden_from_candidates()),
    )


def docker_sandbox_factory(settings: dict[str, Any]) -> Callable[[Path], Any]:
    """The factory of ``sandbox = "docker"``: each graded completion gets its own container.

    ``settings`` are the ``[envs.docker]`` table (``image`` plus ``DockerSandbox`` settings);
    unset, the command limit is this environment's 20 s and the output cap the grader's.
    """
    from composer_replication.envs.function_grader import MAX_REPORT_BYTES
    from composer_replication.sandbox.docker import DockerSandboxFactory

    options = {"exec_timeout_s": 20, "max_output_bytes": MAX_REPORT_BYTES, **settings}
    return DockerSandboxFactory(options.pop("image"), **options)


def _usable_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


class _Graders:
    """Completions graded in a pool as they arrive; a code graded once per task."""

    def __init__(self, env: PythonFunctionsEnv, pool: ThreadPoolExecutor) -> None:
        self.env = env
        self.pool = pool
        self.futures: dict[tuple[str, str], Future] = {}

    def submit(self, task_id: str, text: str) -> None:
        key = self.env.grading_key(task_id, text)
        if key not in self.futures:  # samples of a group often agree
            task = self.env.tasks[task_id]
            self.futures[key] = self.pool.submit(self.env.timed_grade, task, text)

    def graded(self, groups: Sequence[Sequence[Rollout]]) -> list[list[Rollout]]:
        """``groups`` graded (completions not submitted yet are submitted now)."""

        def verdict(rollout: Rollout) -> tuple:
            text = rollout.metadata["completion_text"]
            self.submit(rollout.task_id, text)
            return self.futures[self.env.grading_key(rollout.task_id, text)].result()

        flat = [r for group in groups for r in group]
        for r in flat:
            self.submit(r.task_id, r.metadata["completion_text"])
        return self.env._with_verdicts(groups, verdict)


class PythonFunctionsEnv:
    """The built-in function-writing environment (the embedded default)."""

    name = "python_functions"

    def __init__(
        self,
        tasks: Sequence[PythonTask] | None = None,
        *,
        sandbox_factory: Callable[[Path], Any] = default_sandbox_factory,
        difficulties: Sequence[str] | None = None,
        grading_workers: int = 2,
        generation_batch: int = 64,
        grading_stall_s: float = GRADING_STALL_S,
    ) -> None:
        tasks = list(tasks if tasks is not None else load_tasks())
        if difficulties:
            tasks = [t for t in tasks if t.difficulty in set(difficulties)]
        if not tasks:
            raise ValueError(
                "python_functions has no tasks (check the task file / difficulty filter)"
            )
        self.tasks = {t.task_id: t for t in tasks}
        self.sandbox_factory = sandbox_factory
        # 0: one grader per CPU core this process may use
        self.grading_workers = grading_workers if grading_workers > 0 else _usable_cores()
        self.grading_stall_s = grading_stall_s
        self.generation_batch = max(1, generation_batch)

    def task_ids(self) -> list[str]:
        return list(self.tasks)

    def evaluation_digest(self, task_ids: Sequence[str]) -> str | None:
        """Digest of what evaluating ``task_ids`` reads: their records and the sandbox
        factory's name (None for an unnamed factory;
        :mod:`~composer_replication.evals.start_reuse`)."""
        from composer_replication.common.digests import digest_of_records, grader_name

        grader = grader_name(self.sandbox_factory)
        if grader is None:
            return None
        return digest_of_records([grader, *(self.tasks[t] for t in task_ids)])

    def messages(self, task: PythonTask) -> list[dict[str, str]]:
        return [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": user_message(task)},
        ]

    def prompt_ids(self, tokenizer: Any, task: PythonTask) -> list[int]:
        ids = tokenizer.apply_chat_template(
            self.messages(task), tokenize=True, add_generation_prompt=True
        )
        if hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)

    def rollouts(
        self,
        sampler: Sampler | ReferenceSolutions,
        tokenizer: Any,
        task_ids: Sequence[str],
        *,
        group_size: int,
        sampling: SamplingSettings,
    ) -> list[list[Rollout]]:
        """Sampled and graded groups. Each completion is handed to the graders as soon as
        sampling knows it (the static decode loop finishes rows while others decode)."""
        if isinstance(sampler, ReferenceSolutions):  # reference answers pass by construction
            return self.sample(
                sampler, tokenizer, task_ids, group_size=group_size, sampling=sampling
            )
        with ThreadPoolExecutor(self.grading_workers) as pool:
            graders = _Graders(self, pool)
            groups = self.sample(
                sampler,
                tokenizer,
                task_ids,
                group_size=group_size,
                sampling=sampling,
                on_completion=graders.submit,
            )
            return graders.graded(groups)

    def sample(
        self,
        sampler: Sampler | ReferenceSolutions,
        tokenizer: Any,
        task_ids: Sequence[str],
        *,
        group_size: int,
        sampling: SamplingSettings,
        on_completion: Callable[[str, str], None] | None = None,
    ) -> list[list[Rollout]]:
        """The sampling half of :meth:`rollouts`: ungraded groups (reward 0, the completion's
        text in ``metadata["completion_text"]``), one per task id, in order. Single-turn, so
        sampling and grading can run in different processes (:meth:`grade_groups`). With
        :class:`ReferenceSolutions` as ``sampler``, the :meth:`demonstrations`.
        ``on_completion(task_id, text)`` is called for each completion as soon as it is
        sampled."""
        if isinstance(sampler, ReferenceSolutions):
            return self.demonstrations(tokenizer, task_ids, group_size=group_size)
        self._check_known(task_ids)
        jobs = [(tid, k) for tid in task_ids for k in range(group_size)]
        stops = tuple(dict.fromkeys((*sampling.stop_strings, *STOP_STRINGS)))
        sampling = replace(sampling, stop_strings=stops)
        prompts = {tid: self.prompt_ids(tokenizer, self.tasks[tid]) for tid in task_ids}
        # one call: at most generation_batch rows decode at once, the others join as rows end
        t0 = time.perf_counter()
        generations = sampler.sample_batch(
            tokenizer,
            [prompts[tid] for tid, _ in jobs],
            sampling,
            max_rows=self.generation_batch,
            on_row_done=None
            if on_completion is None
            else lambda index, gen: on_completion(jobs[index][0], gen.text),
        )
        seconds = [(time.perf_counter() - t0) / len(jobs)] * len(jobs)
        groups: dict[str, list[Rollout]] = {tid: [] for tid in task_ids}
        for (tid, _), gen, gen_s in zip(jobs, generations, seconds):
            groups[tid].append(
                Rollout(
                    task_id=tid,
                    prompt_ids=gen.prompt_ids,
                    completion_ids=gen.completion_ids,
                    inference_logprobs=gen.logprobs,
                    reward=0.0,
                    prompt_messages=self.messages(self.tasks[tid]),
                    metadata={
                        "finish_reason": gen.finish_reason,
                        "completion_text": gen.text,
                        "generation_s": gen_s,  # this rollout's share of the call's time
                        # a demonstration for self-distillation; never shown to the policy
                        REFERENCE_KEY: reference_demonstration(self.tasks[tid]),
                    },
                )
            )
        return [groups[tid] for tid in task_ids]

    def demonstrations(
        self, tokenizer: Any, task_ids: Sequence[str], *, group_size: int = 1
    ) -> list[list[Rollout]]:
        """Each task's prompt answered with its reference solution (``group_size`` copies,
        one group per task id, in order): the samples of ``sampling.source = "reference"``."""
        self._check_known(task_ids)
        groups = []
        for tid in task_ids:
            task = self.tasks[tid]
            prompt = self.prompt_ids(tokenizer, task)
            answer = reference_demonstration(task)
            groups.append(
                [
                    demonstration_rollout(
                        tid, prompt, answer, tokenizer, prompt_messages=self.messages(task)
                    )
                    for _ in range(group_size)
                ]
            )
        return groups

    def _check_known(self, task_ids: Sequence[str]) -> None:
        unknown = [t for t in task_ids if t not in self.tasks]
        if unknown:
            raise ValueError(f"unknown python_functions task ids {unknown[:5]}")

    def grade_groups(self, groups: Sequence[Sequence[Rollout]]) -> list[list[Rollout]]:
        """The grading half of :meth:`rollouts`: each sampled rollout with its reward,
        feedback, error and grading info filled in (graded in ``grading_workers`` threads).
        Demonstrations (reference solutions, which pass by construction) are kept as they
        are."""
        if all(r.is_demonstration for group in groups for r in group):
            return [list(group) for group in groups]
        with ThreadPoolExecutor(self.grading_workers) as pool:
            return _Graders(self, pool).graded(groups)

    def _with_verdicts(
        self, groups: Sequence[Sequence[Rollout]], verdict: Callable[[Rollout], tuple]
    ) -> list[list[Rollout]]:
        """``groups`` with each rollout's reward, feedback, error and info from ``verdict``."""
        flat = [r for group in groups for r in group]
        graded = [verdict(r) for r in flat]
        results = iter(
            replace(
                r,
                reward=reward,
                feedback=feedback,
                error=error,
                metadata={**r.metadata, **info},
            )
            for r, (reward, feedback, error, info) in zip(flat, graded)
        )
        return [[next(results) for _ in group] for group in groups]

    def grading_key(self, task_id: str, text: str) -> tuple[str, str]:
        """What a completion's grade depends on: its task and the code graded (its text
        when no function can be extracted)."""
        code = extract_code(text, self.tasks[task_id].entry_point)
        return task_id, text if code is None else code

    def timed_grade(
        self, task: PythonTask, completion_text: str
    ) -> tuple[float, str | None, str | None, dict]:
        """:meth:`grade`, with its seconds in ``info["grading_s"]``; a grade slower than
        ``grading_stall_s`` is logged with what it ended in."""
        start = time.perf_counter()
        reward, feedback, error, info = self.grade(task, completion_text)
        seconds = time.perf_counter() - start
        if seconds > self.grading_stall_s:
            cause = error or f"{info.get('passed', 0)}/{info.get('total', 0)} tests passed"
            log.warning(
                "grading %s took %.3g s (over %.3g s): %s",
                task.task_id,
                seconds,
                self.grading_stall_s,
                cause,
            )
        return reward, feedback, error, {**info, "grading_s": seconds}

    def grade(
        self, task: PythonTask, completion_text: str
    ) -> tuple[float, str | None, str | None, dict]:
        """(reward, feedback, error, info) for one completion. Never raises."""
        code = extract_code(completion_text, task.entry_point)
        if code is None:
            return (
                0.0,
                (
                    f"No function named `{task.entry_point}` was found in the reply. "
                    "Reply with the whole function in a ```python block."
                ),
                "format: no function",
                {"passed": 0, "total": task.n_tests},
            )
        opened: list[Any] = []

        def sandbox_factory(workdir: Path) -> Any:
            opened.append(self.sandbox_factory(workdir))
            return opened[-1]

        try:
            result = grade_function(task, code, sandbox_factory, feedback_chars=FEEDBACK_CHARS)
        finally:  # a container-backed sandbox holds a container until closed
            for sandbox in opened:
                close = getattr(sandbox, "close", None)
                if callable(close):
                    with contextlib.suppress(Exception):  # grading never raises
                        close()
        info: dict[str, Any] = {"passed": result.passed, "total": result.total}
        if result.flags:
            info["hack_flags"] = list(result.flags)
        if result.infrastructure:
            info["infrastructure_error"] = True
        return result.reward, result.feedback, result.error, info
