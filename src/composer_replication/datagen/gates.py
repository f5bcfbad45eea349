"""The five-gate solvability validator for FeatureDeletion tasks.

A task is accepted only if:
1. the original suite passes (otherwise no failure can be blamed on the deletion);
2. the target tests fail after the deletion (otherwise nothing covers the body and any
   answer scores full reward);
3. collection still succeeds after the deletion (the failure is the missing feature, not an
   import error that hides every test);
4. putting the reference body back makes every originally passing test pass again (the task
   is solvable, and the stub and reference line up);
5. the scripted reference agent solves it through the editing tools within the agent's
   turn and token budgets (``envs.reference_agent``; run by ``datagen.feature_deletion``,
   which holds the task as the environment will).
Every gate runs the real test suite inside a sandbox from `sandbox_factory`.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

from composer_replication.envs.fd_tasks import TaskReference, apply_reference
from composer_replication.sandbox import Sandbox
from composer_replication.sandbox.base import TestRunResult
from composer_replication.sandbox.workdir import make_shared_tempdir

__all__ = [
    "DEFAULT_COLLECT_COMMAND",
    "DEFAULT_TEST_COMMAND",
    "GATES",
    "GATE_SOLVABLE",
    "GateOutcome",
    "SandboxFactory",
    "SolvabilityValidator",
]

GATE_ORIGINAL = "gate1_original_green"
GATE_TARGETS = "gate2_targets_red"
GATE_COLLECT = "gate3_collection_ok"
GATE_RESTORE = "gate4_reference_restores"
GATE_SOLVABLE = "gate5_solvable_within_budgets"
GATES: tuple[str, ...] = (GATE_ORIGINAL, GATE_TARGETS, GATE_COLLECT, GATE_RESTORE, GATE_SOLVABLE)
DEFAULT_TEST_COMMAND = "python -m pytest -q"
DEFAULT_COLLECT_COMMAND = "python -m pytest -q --collect-only"

# Builds a ready sandbox for a workdir (boot it inside the factory if the backend needs it).
SandboxFactory = Callable[[Path], Sandbox]


@dataclass(frozen=True)
class GateOutcome:
    """One gate's verdict; `tests` are the passing tests (gate 1) or the targets (gate 2)."""

    gate: str
    passed: bool
    reason: str = ""
    tests: tuple[str, ...] = ()


def _tail(result: TestRunResult, lines: int = 6) -> str:
    """The first error pytest printed (``E   ...``: the cause, e.g. a missing module) and
    the last lines of the output."""
    output = result.output.strip().splitlines()
    first_error = next((line.strip() for line in output if line.startswith("E  ")), None)
    tail = output[-lines:]
    if first_error is not None and first_error not in (t.strip() for t in tail):
        tail = [first_error, *tail]
    return " | ".join(tail)


class SolvabilityValidator:
    """Run gates 1-4 with sandboxes from `sandbox_factory` (gate 5, the reference agent,
    runs where the task is held as the environment holds it: ``datagen.feature_deletion``)."""

    def __init__(
        self,
        sandbox_factory: SandboxFactory,
        *,
        test_command: str = DEFAULT_TEST_COMMAND,
        collect_command: str | None = None,
    ) -> None:
        self.sandbox_factory = sandbox_factory
        self.test_command = test_command
        # collection is the test command asked only to collect
        self.collect_command = collect_command or f"{test_command} --collect-only"

    def _run(self, workdir: Path, command: str) -> TestRunResult:
        sandbox = self.sandbox_factory(workdir)
        try:
            return sandbox.run_tests(command, ())
        finally:
            close = getattr(sandbox, "close", None)
            if callable(close):
                close()

    def original_suite(self, repo_dir: Path) -> GateOutcome:
        """Gate 1: the untouched suite is green; `tests` = the passing test ids."""
        result = self._run(repo_dir, self.test_command)
        if result.timed_out:
            return GateOutcome(GATE_ORIGINAL, False, "original suite timed out")
        if not result.ok or result.passed == 0:
            return GateOutcome(
                GATE_ORIGINAL,
                False,
                f"original suite not green: {result.passed} passed, {result.failed} failed, "
                f"{result.errors} errors, exit {result.exit_code}: {_tail(result)}",
            )
        return GateOutcome(GATE_ORIGINAL, True, tests=tuple(result.ids_with("passed")))

    def targets_red(self, task_dir: Path, passing: Collection[str]) -> GateOutcome:
        """Gate 2: some originally passing tests no longer pass; `tests` = those targets."""
        result = self._run(task_dir, self.test_command)
        if result.timed_out:
            return GateOutcome(GATE_TARGETS, False, "suite timed out after the deletion")
        targets = tuple(sorted(t for t in passing if result.outcomes.get(t) != "passed"))
        if not targets:
            return GateOutcome(
                GATE_TARGETS, False, "no test fails after the deletion (the body is not covered)"
            )
        return GateOutcome(GATE_TARGETS, True, tests=targets)

    def collection_ok(self, task_dir: Path) -> GateOutcome:
        """Gate 3: `pytest --collect-only` still succeeds with the stub in place."""
        result = self._run(task_dir, self.collect_command)
        if result.timed_out or result.exit_code != 0 or result.errors:
            return GateOutcome(
                GATE_COLLECT,
                False,
                f"collection fails after the deletion (exit {result.exit_code}, "
                f"{result.errors} errors): {_tail(result)}",
            )
        return GateOutcome(GATE_COLLECT, True)

    def reference_restores(
        self, task_dir: Path, reference: TaskReference, passing: Collection[str]
    ) -> GateOutcome:
        """Gate 4: on a copy of the task, the reference body makes the whole suite green."""
        scratch = make_shared_tempdir("composer-replication-restore-")
        try:
            copy = scratch / "work"
            shutil.copytree(task_dir, copy, symlinks=True)
            try:
                apply_reference(copy, reference)
            except ValueError as exc:
                return GateOutcome(GATE_RESTORE, False, f"reference does not apply: {exc}")
            result = self._run(copy, self.test_command)
            still_red = sorted(t for t in passing if result.outcomes.get(t) != "passed")
            if result.timed_out or not result.ok or still_red:
                return GateOutcome(
                    GATE_RESTORE,
                    False,
                    f"restoring the reference leaves {len(still_red)} tests failing "
                    f"({', '.join(still_red[:3])}), exit {result.exit_code}: {_tail(result)}",
                )
            return GateOutcome(GATE_RESTORE, True)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)

    def validate(
        self, task_dir: Path, reference: TaskReference, passing: Collection[str]
    ) -> list[GateOutcome]:
        """Gates 2-4 in order, stopping at the first that fails (gate 1 is per repository)."""
        outcomes = [self.targets_red(task_dir, passing)]
        if outcomes[-1].passed:
            outcomes.append(self.collection_ok(task_dir))
        if outcomes[-1].passed:
            outcomes.append(self.reference_restores(task_dir, reference, passing))
        return outcomes
