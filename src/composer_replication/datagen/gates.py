"""The solvability gates of repository tasks (deleted bodies, injected bugs), graded by test.

A repository is taken as it is: gate 1 runs its untouched suite twice and records every
test's outcome (:class:`Baseline`). Tests that pass both times are the ones tasks are
graded by; tests that fail, error, are skipped or flip between the two runs (flaky) are
excluded, and counted with the reason, instead of rejecting the repository (as SWE-bench
grades instances by their FAIL_TO_PASS and PASS_TO_PASS lists, arXiv 2310.06770). A
candidate change is accepted only if:

1. the untouched suite has tests that pass, both times (per repository);
2. some of those fail with the change (its FAIL_TO_PASS tests; otherwise nothing covers it
   and any answer scores full reward);
3. no test module that collected before fails to collect with the change (the failure is
   the change's, not an import error that hides every test of a module);
4. applying the hidden reference (the inverse patch) makes every baseline-passing test
   pass again (the task is solvable, and the change and reference line up);
5. the scripted reference agent solves it through the editing tools within the agent's
   turn and token budgets (``envs.reference_agent``; run by ``datagen.generation``, which
   holds the task as the environment will).

Gates 2 and 3 read one run of the suite with the change; gate 4 runs only the FAIL_TO_PASS
tests when the reference gives the original files back byte for byte (gate 1 already saw
the rest pass on exactly those files; a target that fails when run alone is then judged by
a whole-suite run, as grading runs), and the whole suite otherwise. A run with a change
gets ``CHANGE_TIME_FACTOR`` times the slowest baseline run (at least
``MIN_CHANGE_TIMEOUT_S``): a bug that loops forever costs seconds, not the sandbox's whole
limit. Every gate runs the real test suite inside a sandbox from ``sandbox_factory``.
"""

from __future__ import annotations

import shutil
from collections import Counter
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from composer_replication.envs.fd_tasks import TaskReference, apply_reference
from composer_replication.sandbox import Sandbox
from composer_replication.sandbox.base import TestRunResult
from composer_replication.sandbox.workdir import make_shared_tempdir

__all__ = [
    "BASELINE_RUNS",
    "CHANGE_TIME_FACTOR",
    "DEFAULT_TEST_COMMAND",
    "GATES",
    "GATE_SOLVABLE",
    "MIN_CHANGE_TIMEOUT_S",
    "Baseline",
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
#: how often gate 1 runs the untouched suite (a test whose outcome differs is flaky)
BASELINE_RUNS = 2
#: a run with a change may take this many times the slowest baseline run ...
CHANGE_TIME_FACTOR = 4.0
#: ... and at least this long (seconds)
MIN_CHANGE_TIMEOUT_S = 30.0

# Builds a ready sandbox for a workdir (boot it inside the factory if the backend needs it).
SandboxFactory = Callable[[Path], Sandbox]


@dataclass(frozen=True)
class Baseline:
    """Every test's outcome on the untouched repository, over ``BASELINE_RUNS`` runs.

    Attributes:
        passing: Tests that passed every time: what tasks are graded by.
        excluded: Test id -> why it is not graded: "failed", "error", "skipped" (the same
            outcome every time) or "flaky" (outcomes that differ between runs).
        collection_errors: Test modules (file ids) that did not collect.
        duration_s: The slowest run's wall-clock seconds.
    """

    passing: tuple[str, ...]
    excluded: Mapping[str, str] = field(default_factory=dict)
    collection_errors: frozenset[str] = frozenset()
    duration_s: float = 0.0

    def change_timeout_s(self) -> float:
        """How long a run of the suite with a change may take."""
        return max(MIN_CHANGE_TIMEOUT_S, CHANGE_TIME_FACTOR * self.duration_s)

    def excluded_counts(self) -> dict[str, int]:
        """How many tests are excluded, by reason (sorted by reason)."""
        return dict(sorted(Counter(self.excluded.values()).items()))

    @classmethod
    def of_runs(cls, runs: Sequence[TestRunResult]) -> Baseline:
        """The baseline the runs of one untouched suite give."""
        ids = sorted({t for run in runs for t in run.outcomes})
        passing: list[str] = []
        excluded: dict[str, str] = {}
        for test in ids:
            seen = {run.outcomes.get(test, "missing") for run in runs}
            if seen == {"passed"}:
                passing.append(test)
            elif len(seen) > 1:
                excluded[test] = "flaky"
            else:
                excluded[test] = seen.pop()
        return cls(
            passing=tuple(passing),
            excluded=excluded,
            collection_errors=frozenset(
                t for t, why in excluded.items() if why == "error" and "::" not in t
            ),
            duration_s=max((run.duration_s for run in runs), default=0.0),
        )


@dataclass(frozen=True)
class GateOutcome:
    """One gate's verdict; ``tests`` are the baseline-passing tests (gate 1) or the
    FAIL_TO_PASS tests (gate 2); ``baseline`` (gate 1) and ``result`` (the run gate 2 read:
    its failures write a problem statement) where they exist."""

    gate: str
    passed: bool
    reason: str = ""
    tests: tuple[str, ...] = ()
    baseline: Baseline | None = None
    result: TestRunResult | None = None


def _tail(result: TestRunResult, lines: int = 6) -> str:
    """The first error pytest printed (``E   ...``: the cause, e.g. a missing module) and
    the last lines of the output."""
    output = result.output.strip().splitlines()
    first_error = next((line.strip() for line in output if line.startswith("E  ")), None)
    tail = output[-lines:]
    if first_error is not None and first_error not in (t.strip() for t in tail):
        tail = [first_error, *tail]
    return " | ".join(tail)


def _new_collection_errors(result: TestRunResult, baseline: Baseline) -> list[str]:
    """Test modules that fail to collect in ``result`` but collected in the baseline."""
    return sorted(
        t
        for t, outcome in result.outcomes.items()
        if outcome == "error" and "::" not in t and t not in baseline.collection_errors
    )


class SolvabilityValidator:
    """Run gates 1-4 with sandboxes from `sandbox_factory` (gate 5, the reference agent,
    runs where the task is held as the environment holds it: ``datagen.generation``)."""

    def __init__(
        self,
        sandbox_factory: SandboxFactory,
        *,
        test_command: str = DEFAULT_TEST_COMMAND,
        baseline_runs: int = BASELINE_RUNS,
    ) -> None:
        if baseline_runs < 1:
            raise ValueError(f"baseline_runs must be >= 1, got {baseline_runs!r}")
        self.sandbox_factory = sandbox_factory
        self.test_command = test_command
        self.baseline_runs = baseline_runs

    def _run(
        self, workdir: Path, tests: Sequence[str] = (), timeout_s: float | None = None
    ) -> TestRunResult:
        sandbox = self.sandbox_factory(workdir)
        limit = getattr(sandbox, "exec_timeout_s", None)
        if timeout_s is not None and isinstance(limit, float | int):
            sandbox.exec_timeout_s = min(float(limit), timeout_s)
        try:
            return sandbox.run_tests(self.test_command, tuple(tests))
        finally:
            close = getattr(sandbox, "close", None)
            if callable(close):
                close()

    def original_suite(self, repo_dir: Path) -> GateOutcome:
        """Gate 1: the untouched suite, run ``baseline_runs`` times; passes when some test
        passes every time (``tests``: those; ``baseline``: every test's outcome)."""
        runs = []
        for _ in range(self.baseline_runs):
            result = self._run(repo_dir)
            if result.timed_out:
                return GateOutcome(GATE_ORIGINAL, False, "original suite timed out")
            if result.infrastructure_error:
                return GateOutcome(
                    GATE_ORIGINAL,
                    False,
                    f"the sandbox did not start: {result.infrastructure_error}",
                )
            runs.append(result)
        baseline = Baseline.of_runs(runs)
        if not baseline.passing:
            last = runs[-1]
            return GateOutcome(
                GATE_ORIGINAL,
                False,
                f"no test of the original suite passes: {last.passed} passed, {last.failed} "
                f"failed, {last.errors} errors, exit {last.exit_code}: {_tail(last)}",
                baseline=baseline,
            )
        return GateOutcome(GATE_ORIGINAL, True, tests=baseline.passing, baseline=baseline)

    def covered_lines(self, repo_dir: Path) -> dict[str, frozenset[int]] | None:
        """The lines of ``repo_dir``'s files that its untouched suite runs (one run under
        ``sandbox.line_trace``), by repository-relative path; None when they could not be
        known (a command that is not pytest, a sandbox that cannot run the tracer)."""
        import json

        from composer_replication.sandbox.pytest_support import (
            line_trace_script,
            traced_command,
        )

        output = ".cr-line-trace.json"
        command = traced_command(self.test_command, str(line_trace_script()), output)
        if command is None:
            return None
        sandbox = self.sandbox_factory(repo_dir)
        try:
            sandbox.exec({"command": command})
        finally:
            close = getattr(sandbox, "close", None)
            if callable(close):
                close()
        found = repo_dir / output
        try:
            data = json.loads(found.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return None
        finally:
            found.unlink(missing_ok=True)
        if not isinstance(data, dict) or not any(_is_test_path(str(k)) for k in data):
            return None  # not even a test ran under the tracer: another one replaced it
        return {str(k): frozenset(int(n) for n in v) for k, v in data.items()}

    def targets_red(self, task_dir: Path, baseline: Baseline) -> tuple[GateOutcome, GateOutcome]:
        """Gates 2 and 3 from one run of the suite with the change: (the FAIL_TO_PASS tests,
        collection); the first carries the run."""
        result = self._run(task_dir, timeout_s=baseline.change_timeout_s())
        if result.timed_out:
            failed = GateOutcome(GATE_TARGETS, False, "suite timed out with the change")
            return failed, failed
        if result.infrastructure_error:
            failed = GateOutcome(
                GATE_TARGETS, False, f"the sandbox did not start: {result.infrastructure_error}"
            )
            return failed, failed
        targets = tuple(t for t in baseline.passing if result.outcomes.get(t) != "passed")
        if not targets:
            red = GateOutcome(
                GATE_TARGETS, False, "no test fails with the change (the code is not covered)"
            )
        else:
            red = GateOutcome(GATE_TARGETS, True, tests=targets, result=result)
        broken = _new_collection_errors(result, baseline)
        if broken or (not result.outcomes and result.errors):
            what = ", ".join(broken[:3]) or "no report"
            collect = GateOutcome(
                GATE_COLLECT,
                False,
                f"collection fails with the change ({what}; exit {result.exit_code}): "
                f"{_tail(result)}",
            )
        else:
            collect = GateOutcome(GATE_COLLECT, True)
        return red, collect

    def reference_restores(
        self,
        task_dir: Path,
        reference: TaskReference,
        passing: Collection[str],
        *,
        original: Mapping[str, str] | None = None,
        targets: Sequence[str] = (),
        timeout_s: float | None = None,
    ) -> GateOutcome:
        """Gate 4: on a copy of the task, the reference makes every ``passing`` test pass.

        ``original``: the untouched text of the files the change touched; when the
        reference gives exactly those back, only ``targets`` run (gate 1 saw the rest pass
        on these very files), else the whole suite.
        """
        scratch = make_shared_tempdir("composer-replication-restore-")
        try:
            copy = scratch / "work"
            shutil.copytree(task_dir, copy, symlinks=True)
            try:
                solved = reference.solved_files(copy)
                apply_reference(copy, reference)
            except ValueError as exc:
                return GateOutcome(GATE_RESTORE, False, f"reference does not apply: {exc}")
            exact = original is not None and bool(targets) and solved == dict(original)
            result = self._run(copy, targets if exact else (), timeout_s=timeout_s)
            expected = targets if exact else passing
            still_red = sorted(t for t in expected if result.outcomes.get(t) != "passed")
            if exact and still_red and not result.timed_out:
                # a test can need more of the suite than its own file (a doctest of a text
                # file whose names come from another folder's conftest): grading runs the
                # whole suite, so that decides
                result = self._run(copy, (), timeout_s=timeout_s)
                expected = passing
                still_red = sorted(t for t in expected if result.outcomes.get(t) != "passed")
            if result.timed_out or still_red or result.infrastructure_error:
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
        self,
        task_dir: Path,
        reference: TaskReference,
        baseline: Baseline,
        *,
        original: Mapping[str, str] | None = None,
    ) -> list[GateOutcome]:
        """Gates 2-4 in order, stopping at the first that fails (gate 1 is per repository);
        the first outcome, when it passed, holds the FAIL_TO_PASS tests and their run."""
        red, collect = self.targets_red(task_dir, baseline)
        if not red.passed:
            return [red]
        if not collect.passed:
            return [red, collect]
        restore = self.reference_restores(
            task_dir,
            reference,
            baseline.passing,
            original=original,
            targets=red.tests,
            timeout_s=baseline.change_timeout_s(),
        )
        return [red, collect, restore]


def _is_test_path(path: str) -> bool:
    """Whether ``path`` (repository-relative) is, by pytest's default names, a test module."""
    name = path.rsplit("/", 1)[-1]
    return name.endswith(".py") and (name.startswith("test") or name.endswith("_test.py"))
