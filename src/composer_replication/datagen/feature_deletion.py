"""FeatureDeletion (FD): turn a Python repository with a green pytest suite into tasks.

For each candidate function or method (found with `ast`, see `fd_tasks`), the body is cut
out of a scrubbed copy of the repository and replaced by a raising stub; the tests it
covers are found by running the suite (the tests that pass before and fail after), and the
task is accepted only through the 4-gate solvability validator (`gates`). Accepted tasks are
written as JSONL: the training file (never a held-out id: the writer calls
`HeldoutSplit.check_trainable`), a held-out file for evaluation, and the hidden references
(owner-only file mode, never inside a workdir). Each task's workdir sits next to the output.

Cheap preselection: a candidate whose name never occurs in a test file is skipped without a
run (`static_preselect=False` sends every candidate to the gates).
"""

from __future__ import annotations

import os
import re
import shutil
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field, replace
from pathlib import Path

from composer_replication.datagen.gates import (
    DEFAULT_TEST_COMMAND,
    GATE_ORIGINAL,
    GATES,
    GateOutcome,
    SandboxFactory,
    SolvabilityValidator,
)
from composer_replication.envs.fd_tasks import (
    STUB_EXCEPTION,
    Candidate,
    FDTask,
    TaskReference,
    apply_reference,
    find_candidates,
    make_stub,
    make_task_id,
    output_paths,
    slug,
    split_record_path,
    write_heldout_tasks,
    write_references,
    write_split_record,
    write_tasks,
)
from composer_replication.safety.hack_monitor import is_protected
from composer_replication.safety.holdout import DEFAULT_SPLIT, HeldoutSplit
from composer_replication.sandbox.scrub import scrub_tree
from composer_replication.sandbox.workdir import hand_over, make_shared_tempdir

__all__ = [
    "NOT_REFERENCED",
    "Candidate",
    "FDTask",
    "GateOutcome",
    "GenerationReport",
    "SolvabilityValidator",
    "TaskReference",
    "apply_reference",
    "find_candidates",
    "generate_tasks",
    "output_paths",
]

NOT_REFERENCED = "not_referenced"
ProgressCallback = Callable[[int, int, str], None]


@dataclass(frozen=True)
class GenerationReport:
    """What `generate_tasks` did.

    Attributes:
        repo: Repository name.
        candidates: Candidates considered (after `only`).
        accepted: Tasks that passed every gate (train + held-out).
        train, heldout: How the accepted tasks split.
        rejected: Rejection counts per reason key: `not_referenced` and each of `GATES`.
        rejections: (qualname, gate, reason) per rejected candidate, in order.
        output, heldout_output, reference_output, workdirs: Where things were written
            (`heldout_output` is None without a split); with no accepted task nothing is
            written and earlier files there are left as they were.
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
    duration_s: float = 0.0


def _referenced_names(root: Path) -> set[str]:
    words: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".")]
        for name in filenames:
            rel = (Path(dirpath) / name).relative_to(root).as_posix()
            if name.endswith(".py") and is_protected(rel):
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


def _prompt(candidate: Candidate, workdir: Path, targets: tuple[str, ...]) -> str:
    lines = (workdir / candidate.file).read_text(encoding="utf-8").splitlines()
    shown = "\n".join(lines[candidate.header_start - 1 : candidate.body_start])
    examples = ", ".join(targets[:5]) + (
        f" and {len(targets) - 5} more" if len(targets) > 5 else ""
    )
    return (
        f"The body of `{candidate.qualname}` in `{candidate.file}` was deleted; it now raises "
        f"{STUB_EXCEPTION}. Restore the implementation so that the test suite passes again. "
        f"Tests that exercise it: {examples}. Do not modify tests or test configuration: "
        "changes to them are detected and score zero.\n\n"
        f"```python\n{shown}\n```\n"
    )


# Not worth copying at all (scrub_tree would delete what is left of the leak list anyway).
_COPY_IGNORE = shutil.ignore_patterns(".git", ".hg", ".svn", ".venv", ".tox", ".nox", "__pycache__")
# Hidden answers of any earlier generation (ours or another's) never reach a workdir.
_REFERENCE_FILES = re.compile(r".*\.reference\..*")


def _copy_repo(src: Path, dst: Path, *, skip: Collection[Path] = ()) -> None:
    """Copy ``src`` to ``dst`` and scrub it; ``skip``: resolved paths never copied (this
    generation's own outputs, when they lie inside the repository)."""
    skipped = {str(p) for p in skip}

    def ignore(folder: str, names: list[str]) -> set[str]:
        here = Path(folder).resolve()
        return (
            set(_COPY_IGNORE(folder, names))
            | {n for n in names if _REFERENCE_FILES.fullmatch(n)}
            | {n for n in names if str(here / n) in skipped}
        )

    shutil.copytree(src, dst, symlinks=True, ignore=ignore)
    root = src.resolve()
    for path in skip:  # a folder that held only outputs would still hint at them
        try:
            folder = dst / path.parent.relative_to(root)
        except ValueError:
            continue
        while folder != dst and folder.is_dir() and not any(folder.iterdir()):
            folder.rmdir()
            folder = folder.parent
    scrub_tree(dst)


def _output_tree(out: Path) -> list[Path]:
    """Every path a generation writes for the training file ``out`` (its own output tree)."""
    heldout, reference, workdirs = output_paths(out)
    return [out, heldout, reference, workdirs, split_record_path(out)]


def check_outputs(output: str | os.PathLike[str]) -> Path:
    """Refuse, before any work, outputs the generation could not write (the project's output
    policy: a directory, device, FIFO or link where a file goes, an unwritable folder, a file
    where the workdirs folder goes); returns the resolved training file path."""
    from composer_replication.outputs import check_output, check_output_dir

    given = Path(output)
    out = check_output(given).resolve()
    for path in _output_tree(out)[1:]:
        if path.name.endswith(".workdirs"):
            check_output_dir(path, option="workdirs folder")
        else:
            check_output(path, option="-o")
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
    test_command: str = DEFAULT_TEST_COMMAND,
) -> GenerationReport:
    """Propose, validate and write up to `max_tasks` FD tasks from `repo`.

    Args:
        repo: Repository root (its pytest suite must pass).
        output: Training task file (JSONL); siblings hold held-out tasks, hidden references
            and the task workdirs (see `output_paths`).
        max_tasks: Stop after this many accepted tasks (train and held-out together).
        sandbox_factory: Builds a ready sandbox for a workdir; every gate runs in one.
        split: Held-out tasks go to the held-out file only, and the split is recorded
            beside the tasks (``<stem>.split.json``) so a run can check it splits the same
            way. Default: the project's split; None: every task is a training task.
        progress: Called as `progress(done, total, message)` after each candidate.
        only: Restrict candidates to these qualified names (or `file::qualname`).
        static_preselect: Skip candidates never named in a test file without running them.
        test_command: The suite command inside the sandbox.
    """
    started = time.monotonic()
    repo_path = Path(repo).resolve()
    if not repo_path.is_dir():
        raise ValueError(f"repo {str(repo)!r} is not a directory")
    if isinstance(max_tasks, bool) or not isinstance(max_tasks, int) or max_tasks < 1:
        raise ValueError(f"max_tasks must be an int >= 1, got {max_tasks!r}")
    out = check_outputs(output)
    heldout_path, reference_path, workdirs = output_paths(out)
    own_outputs = _output_tree(out)  # never read back, even when -o is inside the repo
    validator = SolvabilityValidator(sandbox_factory, test_command=test_command)
    rejected = dict.fromkeys((NOT_REFERENCED, *GATES), 0)
    rejections: list[tuple[str, str, str]] = []
    train: list[FDTask] = []
    held: list[FDTask] = []
    refs: list[TaskReference] = []

    def reject(cand: Candidate, gate: str, reason: str) -> None:
        rejected[gate] += 1
        rejections.append((cand.qualname, gate, reason))

    scratch = make_shared_tempdir("composer-replication-fd-")
    try:
        base = scratch / "base"
        _copy_repo(repo_path, base, skip=own_outputs)
        candidates = find_candidates(base)
        if only is not None:
            wanted = set(only)
            candidates = [
                c for c in candidates if c.qualname in wanted or f"{c.file}::{c.qualname}" in wanted
            ]
        total = len(candidates)
        gate1 = validator.original_suite(base)
        if not gate1.passed:
            for cand in candidates:
                reject(cand, GATE_ORIGINAL, gate1.reason)
            candidates = []
        passing = frozenset(gate1.tests)
        names = _referenced_names(base) if static_preselect else set()
        for done, cand in enumerate(candidates, start=1):
            if len(train) + len(held) >= max_tasks:
                break
            if static_preselect and cand.name not in names:
                reject(cand, NOT_REFERENCED, "no test file mentions this name")
            else:
                task = _try_candidate(repo_path.name, cand, base, scratch, validator, passing)
                if isinstance(task, GateOutcome):
                    reject(cand, task.gate, task.reason)
                else:
                    fd_task, ref, task_dir = task
                    is_held = split is not None and split.is_heldout(fd_task.task_id)
                    workdirs.mkdir(parents=True, exist_ok=True)
                    final = workdirs / slug(fd_task.task_id)
                    shutil.rmtree(final, ignore_errors=True)
                    shutil.move(str(task_dir), final)
                    hand_over(final, os.geteuid(), os.getegid())  # back from the sandbox uid
                    fd_task = replace(
                        fd_task, workdir=str(final), split="heldout" if is_held else "train"
                    )
                    (held if is_held else train).append(fd_task)
                    refs.append(ref)
            if progress is not None:
                progress(done, total, f"{cand.file}::{cand.qualname}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
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
        duration_s=time.monotonic() - started,
    )


def _try_candidate(
    repo_name: str,
    cand: Candidate,
    base: Path,
    scratch: Path,
    validator: SolvabilityValidator,
    passing: frozenset[str],
) -> tuple[FDTask, TaskReference, Path] | GateOutcome:
    task_id = make_task_id(repo_name, cand.file, cand.qualname)
    task_dir = scratch / "tasks" / slug(task_id)
    shutil.rmtree(task_dir, ignore_errors=True)
    _copy_repo(base, task_dir)
    ref = replace(make_stub(task_dir, cand), task_id=task_id)
    outcomes = validator.validate(task_dir, ref, passing)
    if not outcomes[-1].passed:
        shutil.rmtree(task_dir, ignore_errors=True)
        return outcomes[-1]
    scrub_tree(task_dir)  # anything the gate runs left behind
    targets = outcomes[0].tests
    task = FDTask(
        task_id=task_id,
        repo=repo_name,
        file=cand.file,
        qualname=cand.qualname,
        target_tests=targets,
        passing_tests=tuple(sorted(passing)),
        prompt=_prompt(cand, task_dir, targets),
        files=_files(task_dir),
        workdir=str(task_dir),
        test_command=validator.test_command,
    )
    return task, ref, task_dir
