"""Repository tasks: a repository with tests in, validated tasks of one kind out.

The repository is taken as it is: its tests run the way it configures them
(``test_discovery.discover_tests``: pytest configuration, or unittest modules, or a src
layout), in the environment its maintainers use (``repository_environment``: the
repository installed from its work tree with its test dependencies, or a container image
named per task). Gate 1 records every test's outcome on the untouched repository, twice
(``gates.Baseline``): tests that fail, error, skip or flip are excluded from grading and
counted, not reasons to reject the repository. Candidates of one kind
(``Modification``):

- ``"deletion"`` (FeatureDeletion, ``datagen.deletions``): a covered function's body
  deleted, the agent writes it again;
- ``"bugs"`` (``datagen.bug_tasks``): a small bug injected into a covered function
  (SWE-smith's procedural modifications, arXiv 2504.21798), the agent finds and fixes it
  from a problem statement written from the failing tests.

Each candidate becomes a task only through the solvability gates (``gates``; the last runs
the scripted reference agent through the editing tools within the agent's budgets,
``AgentBudgets``) and records its FAIL_TO_PASS tests (``target_tests``) and every
baseline-passing test (``passing_tests``), which grade it. Accepted tasks are written as
JSONL: the training file (never a held-out id: the writer calls
`HeldoutSplit.check_trainable`), a held-out file for evaluation, and the hidden references
(owner-only file mode, never inside a workdir). Each task's workdir sits next to the output.
Every candidate, accepted or not, is a row of ``<stem>.candidates.jsonl`` with the gate
that decided it and why.

Cheap preselection: a candidate whose function name never occurs in a test file is skipped
without a run (`static_preselect=False` sends every candidate to the gates).
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import re
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from composer_replication.datagen.bug_kinds import BUG_KINDS
from composer_replication.datagen.bug_tasks import KIND as BUG_KIND
from composer_replication.datagen.bug_tasks import bug_candidates, bug_prompt
from composer_replication.datagen.deletions import deletion_candidates, deletion_prompt
from composer_replication.datagen.gates import (
    GATE_ORIGINAL,
    GATE_SOLVABLE,
    GATES,
    Baseline,
    GateOutcome,
    SandboxFactory,
    SolvabilityValidator,
)
from composer_replication.datagen.modification import Modification
from composer_replication.datagen.repository_copy import copy_repository, mark_output_folder
from composer_replication.datagen.repository_environment import (
    ENVIRONMENTS,
    environments_path,
    prepare_environment,
)
from composer_replication.datagen.test_discovery import DiscoveredTests, discover_tests
from composer_replication.envs.fd_tasks import (
    FDTask,
    TaskReference,
    output_paths,
    slug,
    split_record_path,
    unparsable_files,
    write_heldout_tasks,
    write_references,
    write_split_record,
    write_tasks,
)
from composer_replication.envs.fd_tools import DEFAULT_TOOLS, READING_TOOLS
from composer_replication.safety.hack_monitor import is_protected
from composer_replication.safety.holdout import DEFAULT_SPLIT, HeldoutSplit
from composer_replication.sandbox.scrub import scrub_tree
from composer_replication.sandbox.workdir import hand_over, make_shared_tempdir

__all__ = [
    "KINDS",
    "NOT_REFERENCED",
    "AgentBudgets",
    "GenerationReport",
    "ReferenceSolver",
    "candidates_path",
    "check_outputs",
    "generate_tasks",
]

NOT_REFERENCED = "not_referenced"
#: why a change where no test runs the code is never tried (not a rejection: never a candidate)
UNCOVERED = "no test runs the code it changes"
#: the kinds of task a repository gives: a deleted body to write again, a bug to fix
KINDS = ("deletion", "bugs")
ProgressCallback = Callable[[int, int, str], None]


@dataclass(frozen=True)
class AgentBudgets:
    """What every accepted task must be solvable within, by the scripted reference agent:
    the environment's ``max_turns`` and ``max_total_tokens``, the turn budget
    (``sampling.max_new_tokens``), its ``tools`` and ``tool_format``."""

    max_turns: int = 8
    max_new_tokens: int = 256
    max_total_tokens: int = 4096
    tools: tuple[str, ...] = DEFAULT_TOOLS
    tool_format: str = "auto"

    def environment_options(self) -> dict[str, Any]:
        """The ``feature_deletion`` options these budgets are (all but the turn budget)."""
        return {
            "tools": list(self.tools),
            "tool_format": self.tool_format,
            "max_turns": self.max_turns,
            "max_total_tokens": self.max_total_tokens,
        }


@dataclass(frozen=True)
class GenerationReport:
    """What `generate_tasks` did.

    Attributes:
        repo: Repository name.
        kind: The kind of task made ("deletion" or "bugs").
        candidates: Candidates considered (after `only`).
        accepted: Tasks that passed every gate (train + held-out).
        train, heldout: How the accepted tasks split.
        rejected: Rejection counts per reason key: `not_referenced` and each of `GATES`.
        rejections: (qualname, gate, reason) per rejected candidate, in order.
        output, heldout_output, reference_output, workdirs: Where things were written
            (`heldout_output` is None without a split); with no accepted task no task file
            is written and earlier ones there are left as they were.
        candidates_output: The JSONL of every candidate and its outcome (written whenever
            the repository has tests and a candidate, accepted or not).
        test_command, test_source: How the repository's tests ran, and how that was found.
        python: The interpreter of the repository's virtualenv (None: the sandbox's own).
        baseline_passing: Tests that passed both runs of the untouched suite (they grade).
        excluded: Tests excluded from grading by the baseline, counted by reason ("failed",
            "error", "skipped", "flaky").
        unparsable: Source files that do not parse (no candidate comes from them): path ->
            the syntax error.
        uncovered: Changes proposed where no test runs the code (skipped without a run;
            None: the suite's coverage could not be measured, and the function names the
            tests mention preselect instead).
        duration_s: Wall-clock seconds.
    """

    repo: str
    candidates: int
    accepted: int
    train: int
    heldout: int
    rejected: dict[str, int] = field(default_factory=dict)
    rejections: tuple[tuple[str, str, str], ...] = ()
    output: str = ""
    heldout_output: str | None = None
    reference_output: str = ""
    workdirs: str = ""
    candidates_output: str = ""
    test_command: str = ""
    test_source: str = ""
    python: str | None = None
    kind: str = "deletion"
    baseline_passing: int = 0
    excluded: dict[str, int] = field(default_factory=dict)
    unparsable: dict[str, str] = field(default_factory=dict)
    uncovered: int | None = None
    duration_s: float = 0.0


def _referenced_names(root: Path, test_files: Collection[str] = ()) -> set[str]:
    """Every identifier of the repository's test files (the usual test-file names, and the
    test modules its configuration collects)."""
    words: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if name.endswith(".py") and (is_protected(rel) or rel in test_files):
                text = (Path(dirpath) / name).read_text(encoding="utf-8", errors="replace")
                words.update(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))
    return words


def _files(root: Path) -> tuple[str, ...]:
    return tuple(
        sorted(
            (Path(d) / f).relative_to(root).as_posix()
            for d, _, names in os.walk(root)
            for f in names
        )
    )


def candidates_path(out: Path) -> Path:
    """Where a generation lists its candidates: ``<stem>.candidates.jsonl``."""
    stem = out.name[: -len(".jsonl")] if out.name.endswith(".jsonl") else out.name
    return out.with_name(f"{stem}.candidates.jsonl")


def _output_tree(out: Path) -> list[Path]:
    """Every path a generation writes for the training file ``out`` (its own output tree)."""
    heldout, reference, workdirs = output_paths(out)
    return [
        out,
        heldout,
        reference,
        workdirs,
        split_record_path(out),
        candidates_path(out),
        environments_path(out),
    ]


def check_outputs(
    output: str | os.PathLike[str],
    *,
    inputs: Collection[str | os.PathLike[str]] = (),
    input_dirs: Collection[str | os.PathLike[str]] = (),
) -> Path:
    """Refuse, before any work, outputs the generation could not write (the project's output
    policy: a directory, device, FIFO or link where a file goes, an unwritable folder, a file
    where the workdirs folder goes, an input file, anything inside an input folder: the
    repository); returns the resolved training file path."""
    from composer_replication.common.outputs import check_output, check_output_dir

    given = Path(output)
    # a generation rewrites its own outputs; those in the project's cache are the tasks of
    # a named repository (datagen.repository_tasks)
    owns = ("task_generation", "project_cache")
    sources = {"inputs": inputs, "input_dirs": input_dirs}
    out = check_output(given, owns=owns, **sources).resolve()
    for path in _output_tree(out)[1:]:
        if path.name.endswith((".workdirs", ".envs")):
            check_output_dir(path, option=f"{path.suffix[1:]} folder")
            check_output(path / "x", option="-o", owns=owns, **sources)  # not in an input
        else:
            check_output(path, option="-o", owns=owns, **sources)
    return out


def generate_tasks(
    repo: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    max_tasks: int,
    sandbox_factory: SandboxFactory,
    split: HeldoutSplit | None = DEFAULT_SPLIT,
    progress: ProgressCallback | None = None,
    only: Collection[str] | None = None,
    static_preselect: bool = True,
    test_command: str | None = None,
    budgets: AgentBudgets | None = None,
    tokenizer: Any = None,
    environment: str = "auto",
    wheelhouse: str | os.PathLike[str] | None = None,
    image: str | None = None,
    say: Callable[[str], None] | None = None,
    workers: int = 2,
    kind: str = "deletion",
    bug_kinds: Collection[str] | None = None,
    bugs_per_function: int = 2,
    combined_bugs: int = 0,
    seed: int = 0,
) -> GenerationReport:
    """Propose, validate and write up to `max_tasks` tasks of ``kind`` from `repo`.

    Args:
        repo: Repository root (some of its tests must pass).
        output: Training task file (JSONL); siblings hold held-out tasks, hidden references,
            the candidates' outcomes and the task workdirs (see `output_paths`).
        max_tasks: Stop after this many accepted tasks (train and held-out together).
        sandbox_factory: Builds a ready sandbox for a workdir; every gate runs in one. It
            is called with ``python=`` / ``ro_binds=`` (a virtualenv) or ``image=`` (a
            container image) as keywords when the repository's tests need them.
        split: Held-out tasks go to the held-out file only, and the split is recorded
            beside the tasks (``<stem>.split.json``) so a run can check it splits the same
            way. Default: the project's split; None: every task is a training task.
        progress: Called as `progress(done, total, message)` after each candidate.
        only: Restrict candidates to these qualified names (or `file::qualname`).
        static_preselect: Skip candidates never named in a test file without running them.
        test_command: The suite command inside the sandbox (default: as the repository
            configures its tests, ``discover_tests``).
        budgets: What the reference agent must solve each task within (gate 5).
        tokenizer: The agent model's tokenizer, which counts the budgets' tokens and picks
            the tool format (default: the embedded model's).
        environment: "auto" (a virtualenv of the repository's declared dependencies when
            it declares any; the sandbox's own interpreter when building it fails, said
            through ``say``), "venv" (always; a failure is an error) or "system".
        wheelhouse: Build the virtualenv offline from this directory of wheels.
        image: A container image the tasks' tests run in (``sandbox_factory`` takes
            ``image=``); recorded on every task.
        say: Called with one line per set-up step (test discovery, the virtualenv).
        workers: Candidates validated at once (their gates mostly wait on sandboxed test
            runs); the outcome is the same for any number.
        kind: "deletion" (a deleted body) or "bugs" (an injected bug).
        bug_kinds: The bug kinds to inject (default: all of ``bug_kinds.BUG_KINDS``).
        bugs_per_function: Single bugs tried per function at most.
        combined_bugs: Candidates of two bugs in one file (beside the single ones).
        seed: Picks the bugs and their order.
    """
    started = time.monotonic()
    repo_path = Path(repo).resolve()
    if not repo_path.is_dir():
        raise ValueError(f"repo {str(repo)!r} is not a directory")
    if isinstance(max_tasks, bool) or not isinstance(max_tasks, int) or max_tasks < 1:
        raise ValueError(f"max_tasks must be an int >= 1, got {max_tasks!r}")
    if environment not in ENVIRONMENTS:
        raise ValueError(f"environment = {environment!r}; use one of {', '.join(ENVIRONMENTS)}")
    if kind not in KINDS:
        raise ValueError(f"kind = {kind!r}; use one of {', '.join(KINDS)}")
    say = say or (lambda _line: None)
    budgets = budgets or AgentBudgets()
    out = check_outputs(output, input_dirs=[repo_path])
    heldout_path, reference_path, workdirs = output_paths(out)
    own_outputs = _output_tree(out)  # never read back, even when -o is inside the repo
    rejected = dict.fromkeys((NOT_REFERENCED, *GATES), 0)
    rejections: list[tuple[str, str, str]] = []
    rows: list[dict[str, Any]] = []
    train: list[FDTask] = []
    held: list[FDTask] = []
    refs: list[TaskReference] = []

    def reject(cand: Modification, gate: str, reason: str) -> None:
        rejected[gate] += 1
        rejections.append((cand.qualname, gate, reason))
        rows.append(_row(cand, "rejected", gate, reason))

    baseline = Baseline(passing=())
    unparsable: dict[str, str] = {}
    uncovered: int | None = None
    scratch = make_shared_tempdir("composer-replication-fd-")
    try:
        base = scratch / "base"
        copy_repository(repo_path, base, skip=own_outputs)
        discovered, no_tests = _discover(base, test_command, repo_path)
        say(f"tests: {discovered.command}  ({discovered.source})" if no_tests is None else no_tests)
        test_env = prepare_environment(repo_path, out, environment, wheelhouse, image, say)
        test_env.add_generated(base)
        discovered = replace(discovered, command=test_env.test_command(discovered.command))
        options = test_env.options

        def factory(workdir: Path) -> Any:
            return sandbox_factory(workdir, **options) if options else sandbox_factory(workdir)

        validator = SolvabilityValidator(factory, test_command=discovered.command)
        protected = (*discovered.test_files, *discovered.conftest_files)
        if kind == "bugs":
            candidates = bug_candidates(
                base,
                repo_path.name,
                exclude=protected,
                kinds=bug_kinds if bug_kinds is not None else BUG_KINDS,
                per_function=bugs_per_function,
                combined=combined_bugs,
                seed=seed,
                split=split,
            )
        else:
            candidates = deletion_candidates(base, repo_path.name, exclude=protected)
        unparsable = unparsable_files(base, exclude=protected)
        for rel, error in unparsable.items():
            say(f"not parsed, no candidate from it: {rel} ({error})")
        if only is not None:
            wanted = set(only)
            candidates = [
                c for c in candidates if c.qualname in wanted or f"{c.file}::{c.qualname}" in wanted
            ]
        total = len(candidates)
        gate1 = (
            validator.original_suite(base)
            if no_tests is None
            else GateOutcome(GATE_ORIGINAL, False, no_tests)
        )
        if gate1.baseline is not None:
            baseline = gate1.baseline
            counts = baseline.excluded_counts()
            said = ", ".join(f"{n} {why}" for why, n in counts.items()) or "none"
            say(f"baseline: {len(baseline.passing)} tests pass both runs; excluded: {said}")
        if not gate1.passed:
            for cand in candidates:
                reject(cand, GATE_ORIGINAL, gate1.reason)
            candidates = []
        coverage = validator.covered_lines(base) if candidates and static_preselect else None
        if coverage is not None:  # only where a test can notice the change
            kept = [c for c in candidates if c.covered(coverage)]
            for cand in candidates:
                if not cand.covered(coverage):
                    rows.append(_row(cand, "not_covered", None, UNCOVERED))
            uncovered = len(candidates) - len(kept)
            say(f"coverage: {len(kept)} of {len(candidates)} candidates change code a test runs")
            candidates, total = kept, len(kept)
        names = (
            _referenced_names(base, protected) if static_preselect and coverage is None else set()
        )
        solvers = _Solvers(sandbox_factory, budgets, tokenizer, scratch)

        def validate(cand: Modification) -> tuple[FDTask, TaskReference, Path] | GateOutcome:
            if static_preselect and coverage is None and cand.name not in names:
                return GateOutcome(NOT_REFERENCED, False, "no test file mentions this name")
            task = _try_candidate(
                repo_path.name, cand, base, scratch, validator, baseline, discovered, options
            )
            return task if isinstance(task, GateOutcome) else solvers.mine().check(*task)

        def enough() -> bool:
            return len(train) + len(held) >= max_tasks

        for done, (cand, task) in enumerate(
            _in_order(validate, candidates, workers, enough), start=1
        ):
            if enough():
                if task is not None and not isinstance(task, GateOutcome):
                    shutil.rmtree(task[2], ignore_errors=True)  # validated in flight
                rows.append(_row(cand, "not_tried", None, "max_tasks reached"))
                continue
            if isinstance(task, GateOutcome):
                reject(cand, task.gate, task.reason)
            else:
                fd_task, ref, task_dir = task
                is_held = split is not None and split.is_heldout(fd_task.task_id)
                mark_output_folder(workdirs)
                final = workdirs / slug(fd_task.task_id)
                shutil.rmtree(final, ignore_errors=True)
                shutil.move(str(task_dir), final)
                hand_over(final, os.geteuid(), os.getegid())  # back from the sandbox uid
                fd_task = replace(
                    fd_task, workdir=str(final), split="heldout" if is_held else "train"
                )
                (held if is_held else train).append(fd_task)
                refs.append(ref)
                rows.append(_row(cand, "accepted", None, "", fd_task))
            if progress is not None:
                progress(done, total, f"{cand.file}::{cand.qualname}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    if rows and no_tests is None:  # (without tests, the one reason says it all)
        _write_candidates(candidates_path(out), rows)
    if train or held:  # no task: the files of an earlier generation stay as they were
        write_tasks(out, train, split=split)
        if split is not None:
            write_heldout_tasks(heldout_path, held)
            write_split_record(out, split)
        else:
            split_record_path(out).unlink(missing_ok=True)  # an old record would lie
        write_references(reference_path, refs)
    return GenerationReport(
        repo=repo_path.name,
        candidates=total,
        accepted=len(train) + len(held),
        train=len(train),
        heldout=len(held),
        rejected=rejected,
        rejections=tuple(rejections),
        output=str(out),
        heldout_output=str(heldout_path) if split is not None else None,
        reference_output=str(reference_path),
        workdirs=str(workdirs),
        candidates_output=str(candidates_path(out)),
        test_command=discovered.command,
        test_source=discovered.source,
        python=options.get("python"),
        kind=kind,
        baseline_passing=len(baseline.passing),
        excluded=baseline.excluded_counts(),
        unparsable=unparsable,
        uncovered=uncovered,
        duration_s=time.monotonic() - started,
    )


def _discover(
    base: Path, test_command: str | None, repo: Path
) -> tuple[DiscoveredTests, str | None]:
    """How the repository's tests run (as given, else as it configures them), and why there
    are none to run (None: there are)."""
    given = DiscoveredTests(test_command or "", "pytest", (), "the given test command")
    try:
        discovered = discover_tests(base)
    except ValueError:
        if test_command is None:
            return given, f"no test modules found in {repo}: nothing can cover a deletion"
        return given, None
    if test_command is not None:
        discovered = replace(discovered, command=test_command, source=given.source)
    return discovered, None


def _row(
    cand: Modification, outcome: str, gate: str | None, reason: str, task: FDTask | None = None
) -> dict[str, Any]:
    row: dict[str, Any] = {
        "file": cand.file,
        "qualname": cand.qualname,
        "kind": cand.kind,
        "change": cand.detail,
        "outcome": outcome,
        "gate": gate,
        "reason": reason,
    }
    if task is not None:
        row.update(task_id=task.task_id, split=task.split, n_targets=len(task.target_tests))
    return row


def _write_candidates(path: Path, rows: Sequence[dict[str, Any]]) -> None:
    from composer_replication.common.atomic_io import write_lines_atomic

    write_lines_atomic(path, (json.dumps(row, sort_keys=True) + "\n" for row in rows))


def _try_candidate(
    repo_name: str,
    cand: Modification,
    base: Path,
    scratch: Path,
    validator: SolvabilityValidator,
    baseline: Baseline,
    discovered: DiscoveredTests,
    options: dict[str, Any],
) -> tuple[FDTask, TaskReference, Path] | GateOutcome:
    task_dir = scratch / "tasks" / slug(cand.task_id)
    shutil.rmtree(task_dir, ignore_errors=True)
    copy_repository(base, task_dir)
    cand.apply(task_dir)
    outcomes = validator.validate(task_dir, cand.reference, baseline, original=cand.original)
    if not outcomes[-1].passed:
        shutil.rmtree(task_dir, ignore_errors=True)
        return outcomes[-1]
    scrub_tree(task_dir)  # anything the gate runs left behind
    targets = outcomes[0].tests
    failures = outcomes[0].result.failures if outcomes[0].result is not None else {}
    if cand.kind == BUG_KIND:
        prompt = bug_prompt(task_dir, cand, targets, failures)
    else:
        prompt = deletion_prompt(task_dir, cand, targets)
    task = FDTask(
        task_id=cand.task_id,
        repo=repo_name,
        file=cand.file,
        qualname=cand.qualname,
        target_tests=targets,
        passing_tests=baseline.passing,
        prompt=prompt,
        files=_files(task_dir),
        workdir=str(task_dir),
        test_command=validator.test_command,
        test_files=tuple(
            f
            for f in (*discovered.test_files, *discovered.conftest_files)
            if not is_protected(f)  # the usual names are protected anyway
        ),
        python=options.get("python"),
        python_root=(options.get("ro_binds") or [None])[0],
        image=options.get("image"),
        kind=cand.kind,
        bug_kind=cand.bug_kind,
    )
    return task, cand.reference, task_dir


def _in_order(
    validate: Callable[[Modification], Any],
    candidates: Sequence[Modification],
    workers: int,
    enough: Callable[[], bool],
) -> Iterator[tuple[Modification, Any]]:
    """``(candidate, validate(candidate))`` in candidate order, ``workers`` validating at
    once (the gates wait on sandboxed test runs, not on this process); once ``enough()``,
    the candidates not started yet come back unvalidated (``None``)."""
    if workers <= 1:
        for cand in candidates:
            yield cand, None if enough() else validate(cand)
        return
    with ThreadPoolExecutor(workers) as pool:
        pending: deque[tuple[Modification, Future[Any] | None]] = deque()
        todo = iter(candidates)
        for cand in itertools.islice(todo, 2 * workers):
            pending.append((cand, pool.submit(validate, cand)))
        while pending:
            cand, future = pending.popleft()
            yield cand, None if future is None else future.result()
            for more in itertools.islice(todo, 1):
                pending.append((more, None if enough() else pool.submit(validate, more)))


class _Solvers:
    """One reference solver per validating thread, each with a tokenizer of its own (a
    tokenizer is not safe to share between threads)."""

    def __init__(
        self, sandbox_factory: SandboxFactory, budgets: AgentBudgets, tokenizer: Any, scratch: Path
    ) -> None:
        if tokenizer is None:
            from composer_replication.model.loading import load_tokenizer

            tokenizer = load_tokenizer()
        self._args = (sandbox_factory, budgets, scratch)
        self._tokenizer = tokenizer
        self._local = threading.local()
        self._lock = threading.Lock()

    def mine(self) -> ReferenceSolver:
        solver = getattr(self._local, "solver", None)
        if solver is None:
            with self._lock:
                tokenizer = copy.deepcopy(self._tokenizer)
            factory, budgets, scratch = self._args
            solver = self._local.solver = ReferenceSolver(factory, budgets, tokenizer, scratch)
        return solver


def _unseen_edit(env: Any, task_id: str, prompt: str) -> str | None:
    """What the reference episode of ``task_id`` changes that ``prompt`` does not show
    (``replace``'s old text, ``replace_function``'s definition as the workdir has it),
    named; None when the prompt shows all of it."""
    from composer_replication.envs.definitions import find_definition, source_of

    for tool, arguments in env.reference_episode(task_id):
        if tool == "replace" and arguments["old"] not in prompt:
            return f"the lines of {arguments['path']} its fix replaces"
        if tool == "replace_function":
            text = (env.workdirs[task_id] / arguments["path"]).read_text(encoding="utf-8")
            try:
                shown = source_of(text, find_definition(text, arguments["name"])) in prompt
            except LookupError:  # (the reference names only definitions it can find)
                shown = False
            if not shown:
                return f"`{arguments['name']}` ({arguments['path']})"
    return None


class ReferenceSolver:
    """Gate 5: the reference agent on a candidate task, held exactly as the environment
    will hold it (a one-task file, its reference, its workdir), within the budgets.
    ``check(task, reference, task_dir)`` gives the task with its ``reference_cost``, or the
    failed gate (the task dir is then removed)."""

    def __init__(
        self, sandbox_factory: SandboxFactory, budgets: AgentBudgets, tokenizer: Any, scratch: Path
    ) -> None:
        self.sandbox_factory = sandbox_factory
        self.budgets = budgets
        self.tokenizer = tokenizer
        self.scratch = scratch

    def check(
        self, task: FDTask, ref: TaskReference, task_dir: Path
    ) -> tuple[FDTask, TaskReference, Path] | GateOutcome:
        from composer_replication.envs.feature_deletion import FeatureDeletionEnv

        held = self.scratch / "gate5" / slug(task.task_id)
        shutil.rmtree(held, ignore_errors=True)
        held.mkdir(parents=True)
        write_tasks(held / "tasks.jsonl", [task], split=None)
        write_references(held / "tasks.reference.jsonl", [ref])
        env = FeatureDeletionEnv(
            held / "tasks.jsonl",
            sandbox_factory=self.sandbox_factory,
            # the reference reads and edits with the budgets' tools (the env's defaults)
            **self.budgets.environment_options(),
        )
        try:
            if not READING_TOOLS.intersection(self.budgets.tools):
                # the reference knows the code; an agent that can neither see nor read it
                # cannot change it
                unseen = _unseen_edit(env, task.task_id, task.prompt)
                if unseen is not None:
                    shutil.rmtree(task_dir, ignore_errors=True)
                    return GateOutcome(
                        GATE_SOLVABLE,
                        False,
                        f"the task does not show {unseen}, which its fix changes, and the "
                        "tools read none; offer read_file",
                    )
            rollout = env.solve_with_reference(
                self.tokenizer, task.task_id, max_new_tokens=self.budgets.max_new_tokens
            )
        except ValueError as exc:  # the editing tools cannot express this reference
            shutil.rmtree(task_dir, ignore_errors=True)
            return GateOutcome(GATE_SOLVABLE, False, str(exc))
        finally:
            shutil.rmtree(held, ignore_errors=True)
        problem = rollout.metadata.get("reference_problem")
        if problem:
            shutil.rmtree(task_dir, ignore_errors=True)
            return GateOutcome(GATE_SOLVABLE, False, problem)
        cost = dict(rollout.metadata["reference_cost"], tools=list(self.budgets.tools))
        return replace(task, reference_cost=cost), ref, task_dir
