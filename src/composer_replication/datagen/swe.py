"""Import SWE-style task instances (SWE-bench, SWE-Gym JSONL) as repository tasks.

An instance names a repository at a commit (``repo``, ``base_commit``), an issue
(``problem_statement``), the gold patch (``patch``) and the patch that adds its tests
(``test_patch``), and the tests that decide it: ``FAIL_TO_PASS`` (fail before the gold
patch, pass after) and ``PASS_TO_PASS`` (pass before and after). Nothing is downloaded: the
repository is on disk, named by the instance's ``repo_path`` (a git repository whose history
has ``base_commit``, an archive of the tree at that commit, or a folder already at it;
relative to the JSONL file) or found in a ``repos`` folder as ``<owner>__<name>`` or
``<name>`` (a git repository).

Each instance becomes an `FDTask` of kind "swe" that `envs.feature_deletion` loads, attempts
and grades like a FeatureDeletion task (the final grading runs the FAIL_TO_PASS and
PASS_TO_PASS tests only, as SWE-bench grades), written through the same files as
`datagen.feature_deletion.generate_tasks`. It is accepted only through these gates, each
run in the sandbox on the real tests:

0. ``gate0_instance``: the line is a JSON object with every required field, well typed
   (the test lists as lists or as JSON-encoded lists of strings), its id not seen before;
1. ``gate1_repository``: the repository is found, materialises at ``base_commit`` (a
   checkout of that commit, never the working tree; no history in the task workdir: it would
   hold the answer), the ``test_patch`` applies, and its test environment can be set up;
2. ``gate2_fail_to_pass_fail``: no FAIL_TO_PASS test passes on that tree (the task has
   something to do);
3. ``gate3_pass_to_pass_pass``: every PASS_TO_PASS test passes on it (a broken test is the
   repository's fault, not the agent's);
4. ``gate4_gold_patch_passes``: with the gold patch applied (on a copy), every FAIL_TO_PASS
   and PASS_TO_PASS test passes, run together as the grading runs them (an id missing from
   the report does not pass);
5. ``gate5_solvable_within_budgets``: the scripted reference agent applies the gold patch
   through the editing tools and scores 1.0 within the agent's budgets (``ReferenceSolver``).

Bad input is data: a line that fails a gate is a row of ``<stem>.candidates.jsonl`` with the
gate and the reason, and the import goes on. Only unusable arguments raise.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from composer_replication.datagen.gates import (
    DEFAULT_TEST_COMMAND,
    GATE_SOLVABLE,
    GateOutcome,
    SandboxFactory,
    _tail,
)
from composer_replication.datagen.generation import (
    AgentBudgets,
    ProgressCallback,
    ReferenceSolver,
    _files,
    _output_tree,
    _write_candidates,
    candidates_path,
    check_outputs,
)
from composer_replication.datagen.repository_checkout import (
    GATE_REPOSITORY,
    Rejected,
    apply_patch,
    locate_repository,
    materialise,
)
from composer_replication.datagen.repository_copy import mark_output_folder
from composer_replication.datagen.repository_environment import (
    ENVIRONMENTS,
    prepare_environment,
)
from composer_replication.datagen.test_discovery import DiscoveredTests, discover_tests
from composer_replication.envs.fd_tasks import (
    FDTask,
    TaskReference,
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
from composer_replication.sandbox.base import TestRunResult
from composer_replication.sandbox.scrub import scrub_tree
from composer_replication.sandbox.workdir import hand_over, make_shared_tempdir

__all__ = [
    "GATE_FAIL_TO_PASS",
    "GATE_GOLD",
    "GATE_INSTANCE",
    "GATE_PASS_TO_PASS",
    "GATE_REPOSITORY",
    "GATE_SOLVABLE",
    "REQUIRED_FIELDS",
    "SWE_GATES",
    "ImportReport",
    "SWEInstance",
    "import_instances",
]

GATE_INSTANCE = "gate0_instance"
GATE_FAIL_TO_PASS = "gate2_fail_to_pass_fail"
GATE_PASS_TO_PASS = "gate3_pass_to_pass_pass"
GATE_GOLD = "gate4_gold_patch_passes"
SWE_GATES: tuple[str, ...] = (
    GATE_INSTANCE,
    GATE_REPOSITORY,
    GATE_FAIL_TO_PASS,
    GATE_PASS_TO_PASS,
    GATE_GOLD,
    GATE_SOLVABLE,
)
# the required fields that are strings as given
_TEXT_FIELDS = ("instance_id", "repo", "base_commit", "problem_statement", "patch", "test_patch")
REQUIRED_FIELDS: tuple[str, ...] = (*_TEXT_FIELDS, "FAIL_TO_PASS", "PASS_TO_PASS")
TASK_PREFIX = "swe:"


@dataclass(frozen=True)
class SWEInstance:
    """One instance as read from a JSONL line (the dataset's own field names there).

    Attributes:
        instance_id, repo, base_commit, problem_statement, patch, test_patch: As given
            (``repo`` is "owner/name").
        fail_to_pass, pass_to_pass: ``FAIL_TO_PASS`` and ``PASS_TO_PASS`` as tuples of test
            ids (duplicates dropped).
        hints_text, version, environment_setup_commit: Optional fields, kept but not used
            (the hints are never shown to the agent).
        repo_path: The instance's own ``repo_path`` (None: found in the ``repos`` folder).
    """

    instance_id: str
    repo: str
    base_commit: str
    problem_statement: str
    patch: str
    test_patch: str
    fail_to_pass: tuple[str, ...]
    pass_to_pass: tuple[str, ...]
    hints_text: str = ""
    version: str | None = None
    environment_setup_commit: str | None = None
    repo_path: str | None = None

    @property
    def task_id(self) -> str:
        return f"{TASK_PREFIX}{self.instance_id}"

    @classmethod
    def from_json(cls, data: Any) -> SWEInstance:
        """The instance of one decoded JSONL line; `ValueError` saying what is wrong."""
        if not isinstance(data, dict):
            raise ValueError(f"not a JSON object but {type(data).__name__}")
        missing = [name for name in REQUIRED_FIELDS if name not in data]
        if missing:
            raise ValueError(f"missing required field(s) {', '.join(missing)}")
        text = {name: _text(data, name, empty=name == "test_patch") for name in _TEXT_FIELDS}
        commit = text["base_commit"]
        if commit.startswith("-") or any(c.isspace() for c in commit):
            raise ValueError(f"base_commit {commit!r} is not a commit name")
        fail_to_pass = _test_ids(data, "FAIL_TO_PASS")
        if not fail_to_pass:
            raise ValueError("FAIL_TO_PASS is empty: no test would grade an attempt")
        optional: dict[str, str | None] = {}
        for name in ("hints_text", "version", "environment_setup_commit", "repo_path"):
            value = data.get(name)
            if name == "version" and isinstance(value, int | float) and not isinstance(value, bool):
                value = str(value)  # versions read like "3.0"; a number says the same
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name} must be a string, got {value!r:.80}")
            optional[name] = value
        return cls(
            **text,
            fail_to_pass=fail_to_pass,
            pass_to_pass=_test_ids(data, "PASS_TO_PASS"),
            hints_text=optional["hints_text"] or "",
            version=optional["version"],
            environment_setup_commit=optional["environment_setup_commit"],
            repo_path=optional["repo_path"] or None,
        )


def _text(data: dict[str, Any], name: str, *, empty: bool) -> str:
    value = data[name]
    if not isinstance(value, str) or (not empty and not value.strip()):
        kind = "a string" if empty else "a non-empty string"
        raise ValueError(f"{name} must be {kind}, got {value!r:.80}")
    return value


def _test_ids(data: dict[str, Any], name: str) -> tuple[str, ...]:
    """A list of test ids, or a JSON-encoded one (SWE-bench stores them so)."""
    value = data[name]
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{name} is a string but not a JSON list ({exc})") from None
    if not isinstance(value, list) or not all(isinstance(t, str) for t in value):
        raise ValueError(f"{name} must be a list of test ids, got {value!r:.80}")
    bad = [t for t in value if not t.strip() or t.startswith("-")]
    if bad:
        raise ValueError(f"{name} holds ids that are not test ids: {bad[:3]!r}")
    return tuple(dict.fromkeys(value))


@dataclass(frozen=True)
class ImportReport:
    """What `import_instances` did.

    Attributes:
        instances_file: The JSONL read.
        instances: Its instances (non-blank lines).
        accepted: Tasks that passed every gate (train + held-out).
        train, heldout: How the accepted tasks split.
        not_tried: Instances left once ``max_tasks`` tasks were accepted.
        rejected: Rejection counts per gate (each of `SWE_GATES`).
        rejections: (instance id, or "line N" where none was read; gate; reason) per
            rejected instance, in order.
        output, heldout_output, reference_output, workdirs: Where things were written
            (`heldout_output` is None without a split); with no accepted task no task file
            is written and earlier ones there are left as they were.
        candidates_output: The JSONL of every instance and its outcome (always written).
        duration_s: Wall-clock seconds.
    """

    instances_file: str
    instances: int
    accepted: int
    train: int
    heldout: int
    not_tried: int = 0
    rejected: dict[str, int] = field(default_factory=dict)
    rejections: tuple[tuple[str, str, str], ...] = ()
    output: str = ""
    heldout_output: str | None = None
    reference_output: str = ""
    workdirs: str = ""
    candidates_output: str = ""
    duration_s: float = 0.0


def import_instances(
    instances: str | os.PathLike[str],
    output: str | os.PathLike[str],
    *,
    sandbox_factory: SandboxFactory,
    split: HeldoutSplit | None = DEFAULT_SPLIT,
    repos: str | os.PathLike[str] | None = None,
    budgets: AgentBudgets | None = None,
    tokenizer: Any = None,
    environment: str = "auto",
    wheelhouse: str | os.PathLike[str] | None = None,
    image: str | None = None,
    test_command: str | None = None,
    say: Callable[[str], None] | None = None,
    progress: ProgressCallback | None = None,
    max_tasks: int | None = None,
) -> ImportReport:
    """Validate the SWE-style instances of a JSONL file and write the accepted ones as tasks.

    Args:
        instances: The JSONL file, one instance per line (SWE-bench / SWE-Gym fields).
        output: Training task file (JSONL); siblings hold held-out tasks, hidden references,
            the instances' outcomes and the task workdirs, as `generate_tasks` writes them.
        sandbox_factory: Builds a ready sandbox for a workdir; every gate runs in one. It
            is called with ``python=`` / ``ro_binds=`` (a virtualenv) or ``image=`` as
            keywords when a repository's tests need them.
        split: Held-out tasks go to the held-out file only, and the split is recorded beside
            the tasks. Default: the project's split; None: every task is a training task.
        repos: A folder holding the repositories of instances without ``repo_path``, as
            ``<owner>__<name>`` or ``<name>`` (git repositories).
        budgets: What the reference agent must solve each task within (gate 5).
        tokenizer: The agent model's tokenizer (default: the embedded model's, loaded when
            the first instance reaches gate 5).
        environment, wheelhouse, image: Each repository's test environment, as for
            `generate_tasks` (a virtualenv built per set of declared dependencies, reused
            by instances that declare the same).
        test_command: The test command inside the sandbox (default: as each repository
            configures its tests, else ``python -m pytest -q``).
        say: Called with one line per set-up step.
        progress: Called as ``progress(done, total, instance_id)`` after each instance.
        max_tasks: Stop accepting after this many tasks (the rest are "not_tried").

    Raises:
        ValueError: no instances file, one with no instance, a ``repos`` or ``wheelhouse``
            that is not a folder, an unknown ``environment``, a bad ``max_tasks``, no git,
            or an output the output policy refuses (`OutputError`).
    """
    started = time.monotonic()
    source = Path(instances).expanduser().resolve()
    if not source.is_file():
        raise ValueError(f"instances file {str(instances)!r} does not exist; pass a JSONL file")
    if repos is not None and not Path(repos).is_dir():
        raise ValueError(f"repos {str(repos)!r} is not a directory of repositories")
    if wheelhouse is not None and not Path(wheelhouse).is_dir():
        raise ValueError(f"wheelhouse {str(wheelhouse)!r} is not a directory of wheels")
    if environment not in ENVIRONMENTS:
        raise ValueError(f"environment = {environment!r}; use one of {', '.join(ENVIRONMENTS)}")
    if max_tasks is not None and (
        isinstance(max_tasks, bool) or not isinstance(max_tasks, int) or max_tasks < 1
    ):
        raise ValueError(f"max_tasks must be an int >= 1 or None, got {max_tasks!r}")
    if shutil.which("git") is None:
        raise ValueError("git is not on PATH; importing instances needs it (git apply)")
    lines = _read_lines(source)
    if not lines:
        raise ValueError(f"instances file {str(source)!r} holds no instances")
    out = check_outputs(
        output, inputs=[source], input_dirs=[Path(repos)] if repos is not None else []
    )
    heldout_path, reference_path, workdirs = output_paths(out)
    importer = _Importer(
        out=out,
        base_dir=source.parent,
        repos=Path(repos).resolve() if repos is not None else None,
        sandbox_factory=sandbox_factory,
        budgets=budgets or AgentBudgets(),
        tokenizer=tokenizer,
        environment=environment,
        wheelhouse=wheelhouse,
        image=image,
        test_command=test_command,
        say=say or (lambda _line: None),
    )
    rejected = dict.fromkeys(SWE_GATES, 0)
    rejections: list[tuple[str, str, str]] = []
    rows: list[dict[str, Any]] = []
    train: list[FDTask] = []
    held: list[FDTask] = []
    refs: list[TaskReference] = []
    seen: dict[str, int] = {}
    not_tried = 0
    try:
        for done, (number, text) in enumerate(lines, start=1):
            row: dict[str, Any] = dict.fromkeys(("instance_id", "repo", "gate", "task_id"))
            row.update(line=number, outcome="rejected", reason="", split=None)
            try:
                instance = _parse(text, number, seen)
                row.update(
                    instance_id=instance.instance_id, repo=instance.repo, task_id=instance.task_id
                )
                if max_tasks is not None and len(train) + len(held) >= max_tasks:
                    not_tried += 1
                    row.update(outcome="not_tried", reason="max_tasks reached")
                else:
                    task, ref, task_dir = importer.run(instance)
                    task = _settle(task, task_dir, workdirs, split)
                    (held if task.split == "heldout" else train).append(task)
                    refs.append(ref)
                    row.update(outcome="accepted", split=task.split)
            except Rejected as rejection:
                row["instance_id"] = row["instance_id"] or rejection.instance_id
                name = row["instance_id"] or f"line {number}"
                rejected[rejection.gate] += 1
                rejections.append((name, rejection.gate, rejection.reason))
                row.update(gate=rejection.gate, reason=rejection.reason)
            rows.append(row)
            if progress is not None:
                progress(done, len(lines), row["instance_id"] or f"line {number}")
    finally:
        importer.close()
    _write_candidates(candidates_path(out), rows)
    if train or held:  # no task: the files of an earlier import stay as they were
        write_tasks(out, train, split=split)
        if split is not None:
            write_heldout_tasks(heldout_path, held)
            write_split_record(out, split)
        else:
            split_record_path(out).unlink(missing_ok=True)  # an old record would lie
        write_references(reference_path, refs)
    return ImportReport(
        instances_file=str(source),
        instances=len(lines),
        accepted=len(train) + len(held),
        train=len(train),
        heldout=len(held),
        not_tried=not_tried,
        rejected=rejected,
        rejections=tuple(rejections),
        output=str(out),
        heldout_output=str(heldout_path) if split is not None else None,
        reference_output=str(reference_path),
        workdirs=str(workdirs),
        candidates_output=str(candidates_path(out)),
        duration_s=time.monotonic() - started,
    )


def _settle(task: FDTask, task_dir: Path, workdirs: Path, split: HeldoutSplit | None) -> FDTask:
    """Move an accepted task's workdir into ``workdirs``; the task as it is written."""
    mark_output_folder(workdirs)
    final = workdirs / slug(task.task_id)
    shutil.rmtree(final, ignore_errors=True)
    shutil.move(str(task_dir), final)
    hand_over(final, os.geteuid(), os.getegid())  # back from the sandbox uid
    held = split is not None and split.is_heldout(task.task_id)
    return replace(task, workdir=str(final), split="heldout" if held else "train")


def _read_lines(source: Path) -> list[tuple[int, str]]:
    """(1-based line number, text) of every non-blank line."""
    with open(source, encoding="utf-8", errors="replace") as fh:
        return [(n, line) for n, line in enumerate(fh, start=1) if line.strip()]


def _parse(text: str, number: int, seen: dict[str, int]) -> SWEInstance:
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise Rejected(GATE_INSTANCE, f"line {number} is not JSON: {exc}") from None
    named = data.get("instance_id") if isinstance(data, dict) else None
    named = named if isinstance(named, str) and named.strip() else None
    try:
        instance = SWEInstance.from_json(data)
    except ValueError as exc:
        raise Rejected(GATE_INSTANCE, f"line {number}: {exc}", named) from None
    first = seen.setdefault(instance.instance_id, number)
    if first != number:
        raise Rejected(
            GATE_INSTANCE,
            f"instance_id {named!r} appears twice (lines {first} and {number})",
            named,
        )
    return instance


class _Importer:
    """Turns one instance into a validated task (its workdir in a scratch folder) or raises
    `Rejected`; holds what the instances share (the scratch folder, the reference solver)."""

    def __init__(
        self,
        *,
        out: Path,
        base_dir: Path,
        repos: Path | None,
        sandbox_factory: SandboxFactory,
        budgets: AgentBudgets,
        tokenizer: Any,
        environment: str,
        wheelhouse: str | os.PathLike[str] | None,
        image: str | None,
        test_command: str | None,
        say: Callable[[str], None],
    ) -> None:
        self.out = out
        self.base_dir = base_dir
        self.repos = repos
        self.sandbox_factory = sandbox_factory
        self.budgets = budgets
        self.tokenizer = tokenizer
        self.environment = environment
        self.wheelhouse = wheelhouse
        self.image = image
        self.test_command = test_command
        self.say = say
        self.scratch = make_shared_tempdir("composer-replication-swe-")
        self._solver: ReferenceSolver | None = None

    def close(self) -> None:
        shutil.rmtree(self.scratch, ignore_errors=True)

    def run(self, instance: SWEInstance) -> tuple[FDTask, TaskReference, Path]:
        """Gates 1-5 on ``instance``: (task, reference, its workdir)."""
        task_dir = self.scratch / "tasks" / slug(instance.task_id)
        shutil.rmtree(task_dir, ignore_errors=True)
        try:
            return self._run(instance, task_dir)
        except Rejected:
            shutil.rmtree(task_dir, ignore_errors=True)
            raise

    def _run(self, instance: SWEInstance, task_dir: Path) -> tuple[FDTask, TaskReference, Path]:
        def said(line: str) -> None:
            self.say(f"{instance.instance_id}: {line}")

        repo = locate_repository(instance.repo, instance.repo_path, self.base_dir, self.repos)
        # (a folder holding this import's own outputs never gives them to a workdir)
        materialise(repo, instance.base_commit, task_dir, self.scratch, _output_tree(self.out))
        test_files = apply_patch(task_dir, instance.test_patch, GATE_REPOSITORY, "the test_patch")
        scrub_tree(task_dir)
        discovered = _tests_of(task_dir, self.test_command)
        try:
            test_env = prepare_environment(
                task_dir, self.out, self.environment, self.wheelhouse, self.image, said
            )
        except RuntimeError as err:  # environment="venv" and pip failed
            raise Rejected(GATE_REPOSITORY, f"no test environment: {err}") from None
        test_env.add_generated(task_dir)
        discovered = replace(discovered, command=test_env.test_command(discovered.command))
        options = test_env.options

        def run(workdir: Path, tests: Sequence[str], gate: str) -> TestRunResult:
            return _run_tests(
                self.sandbox_factory, options, workdir, discovered.command, tests, gate
            )

        f2p, p2p = instance.fail_to_pass, instance.pass_to_pass
        result = run(task_dir, f2p, GATE_FAIL_TO_PASS)
        passing = [t for t in f2p if result.outcomes.get(t) == "passed"]
        if passing:
            raise Rejected(
                GATE_FAIL_TO_PASS,
                f"{len(passing)} of {len(f2p)} FAIL_TO_PASS tests already pass before the gold "
                f"patch ({', '.join(passing[:3])})",
            )
        if p2p:
            result = run(task_dir, p2p, GATE_PASS_TO_PASS)
            failing = [t for t in p2p if result.outcomes.get(t) != "passed"]
            if failing or result.timed_out:
                raise Rejected(
                    GATE_PASS_TO_PASS,
                    f"{len(failing)} of {len(p2p)} PASS_TO_PASS tests do not pass before the "
                    f"gold patch ({_outcomes(result, failing)}), exit {result.exit_code}: "
                    f"{_tail(result)}",
                )
        scrub_tree(task_dir)  # anything the test runs left behind
        solved, changed = self._gold(task_dir, instance, run)
        graded = tuple(dict.fromkeys((*f2p, *p2p)))
        protected = (*test_files, *discovered.test_files, *discovered.conftest_files)
        task = FDTask(
            task_id=instance.task_id,
            repo=instance.repo,
            file=changed[0],
            qualname=instance.instance_id,
            target_tests=f2p,
            passing_tests=p2p,
            prompt=_prompt(instance),
            files=_files(task_dir),
            workdir=str(task_dir),
            test_command=discovered.command,
            test_files=tuple(dict.fromkeys(f for f in protected if not is_protected(f))),
            python=options.get("python"),
            python_root=(options.get("ro_binds") or [None])[0],
            image=options.get("image"),
            kind="swe",
            graded_tests=graded,
        )
        ref = TaskReference(
            task_id=instance.task_id,
            file=changed[0],
            start_line=0,
            end_line=0,
            stub="",
            body="",
            files=solved,
        )
        return self._solvable(task, ref, task_dir)

    def _gold(
        self,
        task_dir: Path,
        instance: SWEInstance,
        run: Callable[[Path, Sequence[str], str], TestRunResult],
    ) -> tuple[dict[str, str | None], list[str]]:
        """Gate 4 on a copy of the task: the solved text of every file the gold patch
        changes (None: it deletes the file), and those files in patch order."""
        gold = self.scratch / "gold" / slug(instance.task_id)
        shutil.rmtree(gold, ignore_errors=True)
        try:
            shutil.copytree(task_dir, gold, symlinks=True)
            before = set(_files(task_dir))
            changed = apply_patch(gold, instance.patch, GATE_GOLD, "the gold patch")
            after = set(_files(gold))
            changed += sorted(before - after - set(changed))  # renamed away
            if not changed:
                raise Rejected(GATE_GOLD, "the gold patch changes no file")
            solved: dict[str, str | None] = {}
            binary = []
            for rel in changed:  # read before the tests run there
                try:
                    solved[rel] = (gold / rel).read_text(encoding="utf-8") if rel in after else None
                except UnicodeDecodeError:
                    binary.append(rel)
            tests = tuple(dict.fromkeys((*instance.fail_to_pass, *instance.pass_to_pass)))
            result = run(gold, tests, GATE_GOLD)
            failing = [t for t in tests if result.outcomes.get(t) != "passed"]
            if failing or result.timed_out:
                raise Rejected(
                    GATE_GOLD,
                    f"with the gold patch {len(failing)} of {len(tests)} FAIL_TO_PASS and "
                    f"PASS_TO_PASS tests do not pass ({_outcomes(result, failing)}), exit "
                    f"{result.exit_code}: {_tail(result)}",
                )
            if binary:
                raise Rejected(
                    GATE_SOLVABLE,
                    f"the gold patch changes {', '.join(binary)}, which is not UTF-8 text: the "
                    "editing tools cannot write it",
                )
            return solved, changed
        finally:
            shutil.rmtree(gold, ignore_errors=True)

    def _solvable(
        self, task: FDTask, ref: TaskReference, task_dir: Path
    ) -> tuple[FDTask, TaskReference, Path]:
        """Gate 5: the reference agent solves the task, held as the environment holds it."""
        if self._solver is None:
            tokenizer = self.tokenizer
            if tokenizer is None:
                from composer_replication.model.loading import load_tokenizer

                tokenizer = load_tokenizer()
            self._solver = ReferenceSolver(
                self.sandbox_factory, self.budgets, tokenizer, self.scratch
            )
        try:
            checked = self._solver.check(task, ref, task_dir)
        except ValueError as err:  # e.g. a reference that deletes a file
            raise Rejected(GATE_SOLVABLE, str(err)) from None
        if isinstance(checked, GateOutcome):
            raise Rejected(checked.gate, checked.reason)
        return checked


def _prompt(instance: SWEInstance) -> str:
    tests = instance.fail_to_pass
    files = list(dict.fromkeys(t.split("::", 1)[0] for t in tests))
    named = (
        ", ".join(tests)
        if len(tests) <= 3
        else f"{len(tests)} tests in {', '.join(files[:5])}"
        + (f" and {len(files) - 5} more files" if len(files) > 5 else "")
    )
    return (
        f"Resolve this issue in the repository {instance.repo}.\n\n"
        f"{instance.problem_statement.strip()}\n\n"
        f"Tests that fail now and must pass once it is resolved: {named}. The tests that pass "
        "now must keep passing. Do not modify tests or test configuration: changes to them "
        "are detected and score zero.\n"
    )


def _outcomes(result: TestRunResult, tests: Sequence[str]) -> str:
    """``id: outcome`` of the first few tests (``missing``: not in the report)."""
    shown = [f"{t}: {result.outcomes.get(t, 'missing')}" for t in tests[:3]]
    return ", ".join(shown) + (f" and {len(tests) - 3} more" if len(tests) > 3 else "")


def _tests_of(tree: Path, test_command: str | None) -> DiscoveredTests:
    """How the tree's tests run: as given, else as it configures them, else plain pytest."""
    try:
        discovered = discover_tests(tree)
    except ValueError as exc:
        fallback = test_command or DEFAULT_TEST_COMMAND
        return DiscoveredTests(fallback, "pytest", (), f"{fallback} (no test modules: {exc})")
    if test_command is not None:
        discovered = replace(discovered, command=test_command, source="the given test command")
    return discovered


def _run_tests(
    factory: SandboxFactory,
    options: Mapping[str, Any],
    workdir: Path,
    command: str,
    tests: Sequence[str],
    gate: str,
) -> TestRunResult:
    """``tests`` in a fresh sandbox on ``workdir``; a sandbox that cannot run them rejects
    the instance at ``gate``."""
    sandbox = factory(workdir, **options) if options else factory(workdir)
    try:
        result = sandbox.run_tests(command, tuple(tests))
    except ValueError as err:  # a test command the sandbox refuses
        raise Rejected(gate, f"the tests cannot run: {err}") from None
    finally:
        close = getattr(sandbox, "close", None)
        if callable(close):
            close()
    if result.infrastructure_error:
        raise Rejected(gate, f"sandbox did not start: {result.infrastructure_error}")
    return result
