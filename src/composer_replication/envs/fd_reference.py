"""The feature_deletion environment's reference agent: each task's gold answer played as tool
calls through the environment's own loop, tools, sandbox, budgets and grader.

:class:`ReferenceEpisodes` is the part of ``FeatureDeletionEnv`` that reads the hidden
references (the only part that does): the scripted episode of a task
(:meth:`~ReferenceEpisodes.reference_episode`, ``envs.reference_agent``), its run within the
budgets with the reason when it does not fit (:meth:`~ReferenceEpisodes.solve_with_reference`,
datagen's gate 5), and the warm start's demonstrations
(:meth:`~ReferenceEpisodes.demonstrations`, some of them recovering from a near miss with
``reference_recovery``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from composer_replication.envs.fd_tasks import TaskReference, read_jsonl_records
from composer_replication.envs.reference_agent import (
    edits_between,
    reference_calls,
    reference_cost,
    reply_budget_problem,
    stable_share,
    with_recovery,
    without_text,
)
from composer_replication.rollout.agent import ChatRenderer, ScriptedSampler
from composer_replication.samples.generation import SamplingSettings
from composer_replication.samples.rollouts import DEMONSTRATION_KEY, Rollout

__all__ = ["DEFAULT_REPLY_TOKENS", "ReferenceEpisodes"]

#: the turn budget (tokens) a reference episode is played with unless told otherwise
DEFAULT_REPLY_TOKENS = 256


class ReferenceEpisodes:
    """The reference agent of ``FeatureDeletionEnv`` (a mixin: it uses the environment's
    ``tasks``, ``workdirs``, ``references_file``, ``tools``, ``max_turns``,
    ``reference_reads``, ``reference_edits``, ``reference_recovery``, ``format_for``,
    ``messages`` and ``_run``, and keeps its demonstrations in ``_demonstrations`` under
    ``_lock``)."""

    tasks: dict[str, Any]
    workdirs: dict[str, Any]

    def reference(self, task_id: str) -> TaskReference:
        """The hidden reference of ``task_id`` (read from the owner-only references file)."""
        refs = [TaskReference.from_json(r) for r in read_jsonl_records(self.references_file)]
        ref = next((r for r in refs if r.task_id == task_id), None)
        if ref is None:
            raise ValueError(f"no reference for {task_id!r} in {self.references_file}")
        return ref

    def reference_replies(self, tokenizer: Any, task_id: str) -> list[str]:
        """The reference agent's replies for ``task_id``, written in this model's tool format:
        read around each change, ``replace`` each one, run the target tests, finish."""
        tool_format = self.format_for(tokenizer)
        return [tool_format.format_call(n, a) for n, a in self.reference_episode(task_id)]

    def reference_episode(self, task_id: str) -> list[tuple[str, dict[str, Any]]]:
        """The reference agent's calls for ``task_id`` as ``(tool, arguments)``.

        Raises:
            ValueError: the reference needs a tool this environment does not offer.
        """
        task, workdir = self.tasks[task_id], self.workdirs[task_id]
        reference = self.reference(task_id)
        edits = []
        for rel, solved in reference.solved_files(workdir).items():
            path = workdir / rel
            before = path.read_text(encoding="utf-8") if path.is_file() else ""
            if solved is None:
                raise ValueError(
                    f"task {task_id!r}: its reference deletes {rel}, which the editing tools "
                    "cannot do"
                )
            edits += edits_between(
                rel, before, solved, whole_functions=self.reference_edits != "lines"
            )

        def line_count(rel: str) -> int:
            path = workdir / rel
            return len(path.read_text(encoding="utf-8").splitlines()) if path.is_file() else 0

        # Bug tasks too: the reference reads the lines around the change (the failing frame,
        # where the report names one in the repository) and fixes them with one replace.
        rewrite = self.reference_edits == "definitions"
        needed = reference_calls(edits, (), read=self.reference_reads, rewrite_functions=rewrite)
        missing = {name for name, _ in needed} - set(self.tools)
        if missing:
            raise ValueError(
                f"the reference agent needs the tools {sorted(missing)}, which this "
                f"environment does not offer (tools = {sorted(self.tools)})"
            )
        return reference_calls(
            edits,
            task.target_tests,
            line_counts=line_count,
            read=self.reference_reads,
            rewrite_functions=rewrite,
        )

    def solve_with_reference(
        self, tokenizer: Any, task_id: str, *, max_new_tokens: int = DEFAULT_REPLY_TOKENS
    ) -> Rollout:
        """The task's gold answer through the same tools, loop and scorer, within this
        environment's budgets and a turn budget of ``max_new_tokens``: reward 1.0 for a
        task an agent restricted to them can solve. When it cannot, the rollout's
        ``metadata["reference_problem"]`` says why (the budget it exceeds, or how the
        episode ended) and its cost is in ``metadata["reference_cost"]``."""
        return self.solve_many_with_reference(tokenizer, [task_id], max_new_tokens=max_new_tokens)[
            0
        ]

    def solve_many_with_reference(
        self,
        tokenizer: Any,
        task_ids: Sequence[str],
        *,
        max_new_tokens: int = DEFAULT_REPLY_TOKENS,
        scripts: Sequence[Sequence[str]] | None = None,
    ) -> list[Rollout]:
        """:meth:`solve_with_reference` of each task, all episodes run at once (their tool
        calls and grading in parallel); ``scripts``: other replies to run, one list per
        task (default: :meth:`reference_replies`)."""
        tool_format = self.format_for(tokenizer)
        replies = (
            [list(script) for script in scripts]
            if scripts is not None
            else [self.reference_replies(tokenizer, tid) for tid in task_ids]
        )
        prompts = [
            ChatRenderer(tokenizer, tool_format.chat_tools).prompt_ids(
                self.messages(self.tasks[tid], tool_format)
            )
            for tid in task_ids
        ]
        sampling = SamplingSettings(max_new_tokens=max_new_tokens, temperature=0)
        groups = self._run(
            tokenizer,
            task_ids,
            1,
            sampling,
            ScriptedSampler(tokenizer, replies, prompts=prompts),
            tool_format,
        )
        rollouts = []
        for (rollout,), script in zip(groups, replies):
            cost = reference_cost(rollout)
            rollout.metadata["reference_cost"] = {
                "turns": cost.turns,
                "max_reply_tokens": cost.max_reply_tokens,
                "total_tokens": cost.total_tokens,
                "tool_format": tool_format.name,
                "tokenizer": getattr(tokenizer, "name_or_path", None),
            }
            problem = reply_budget_problem(
                script, tokenizer, max_turns=self.max_turns, max_new_tokens=max_new_tokens
            )
            end = rollout.metadata.get("end_reason")
            if problem is None and end != "finish":
                problem = (
                    f"the reference episode ended with {end!r} ({rollout.error or 'no error'})"
                )
            if problem is None and rollout.reward < 1.0:
                problem = (
                    f"the reference scored {rollout.reward:.2f}: "
                    f"{(rollout.error or rollout.feedback or '').strip()[-300:]}"
                )
            if problem is not None:
                rollout.metadata["reference_problem"] = problem
            rollouts.append(rollout)
        return rollouts

    def demonstrations(
        self, tokenizer: Any, task_ids: Sequence[str], *, group_size: int = 1
    ) -> list[list[Rollout]]:
        """Each task answered by the reference agent (its episode through the real tools and
        grader, made once per task and kept): the demonstrations of ``sampling.source =
        "reference"``. A task whose reference fails (a budget, a changed repository) gives
        no demonstration (its group is empty)."""
        with self._lock:
            missing = list(
                dict.fromkeys(t for t in task_ids if (t, id(tokenizer)) not in self._demonstrations)
            )
            if missing:  # made together: their tools and grading run in parallel
                made = dict(zip(missing, self.solve_many_with_reference(tokenizer, missing)))
                made.update(self._recovery_demonstrations(tokenizer, missing))
                for tid, rollout in made.items():
                    rollout.metadata[DEMONSTRATION_KEY] = True
                    self._demonstrations[(tid, id(tokenizer))] = rollout
        groups = []
        for tid in task_ids:
            demo = self._demonstrations[(tid, id(tokenizer))]
            ok = "reference_problem" not in demo.metadata and demo.reward >= 1.0
            groups.append(
                [replace(demo, metadata=dict(demo.metadata)) for _ in range(group_size)]
                if ok
                else []
            )
        return groups

    def _recovery_demonstrations(
        self, tokenizer: Any, task_ids: Sequence[str]
    ) -> dict[str, Rollout]:
        """The demonstrations that recover from a near miss (``reference_recovery``), by
        task: those whose near miss failed a target test and whose fix passed (the others
        keep the plain demonstration)."""
        chosen = [t for t in task_ids if stable_share(t) < self.reference_recovery]
        tool_format, plans = self.format_for(tokenizer), {}
        for tid in chosen:
            workdir = self.workdirs[tid]
            plan = with_recovery(
                self.reference_episode(tid),
                lambda rel, root=workdir: (root / rel).read_text(encoding="utf-8"),
                max_turns=self.max_turns,
            )
            if plan is not None:
                plans[tid] = plan
        if not plans:
            return {}
        rollouts = self.solve_many_with_reference(
            tokenizer,
            list(plans),
            scripts=[
                [tool_format.format_call(n, a) for n, a in calls] for calls, _ in plans.values()
            ],
        )
        made = {}
        for (tid, (calls, near_miss_turn)), rollout in zip(plans.items(), rollouts):
            runs = [
                e.get("info", {})
                for e in rollout.metadata.get("events", ())
                if e.get("type") == "tool_call" and e.get("name") == "run_tests"
            ]
            missed = bool(runs) and runs[0].get("target_passed", 0) < runs[0].get("n_targets", 0)
            if "reference_problem" in rollout.metadata or not missed:
                continue
            # the near miss's call and old text are imitated, its code is not
            rollout.completion_mask = without_text(
                rollout.completion_mask,
                rollout.completion_ids,
                near_miss_turn,
                calls[near_miss_turn][1]["new"],
                tokenizer.decode,
            )
            rollout.metadata["recovery"] = True
            made[tid] = rollout
        return made
