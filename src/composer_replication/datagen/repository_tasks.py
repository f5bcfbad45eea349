"""Tasks of a repository made on first use and kept: the ``repo`` option of a run's entry.

An ``[[envs]]`` entry of ``feature_deletion`` may name a repository instead of a task file::

    [[envs]]
    name = "feature_deletion"
    options = { repo = "smallkit", max_tasks = 40 }

``repo`` is a folder (relative to the config file) or the name of a repository shipped in
the package (``SHIPPED_REPOSITORIES``: ``smallkit``). The first run generates its tasks with
``datagen.feature_deletion.generate_tasks``, solvable within the entry's own budgets
(``max_turns``, ``max_total_tokens``, ``tools``, ``tool_format`` options and its
``sampling.max_new_tokens``), split as the run splits, and keeps them under
``<cache>/tasks/<name>-<key>/`` (the key hashes the repository's files, the budgets, the
tokenizer and the split), so later runs, and entries with the same budgets, reuse them. The
entry then reads them as its ``task_file``. A generation that fails leaves nothing behind
but its candidates report (why each candidate was refused), and is made again next time.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from composer_replication.config.environments import builtin_environment
from composer_replication.datagen.generation import AgentBudgets, generate_tasks
from composer_replication.envs.fd_tools import DEFAULT_TOOLS

__all__ = [
    "GENERATION_OPTIONS",
    "SHIPPED_REPOSITORIES",
    "check_generation_options",
    "repository_path",
    "repository_tasks",
    "resolve_repository_options",
]

#: repositories shipped in the package, by name
SHIPPED_REPOSITORIES = ("smallkit",)
#: options that say how tasks are made from ``repo`` (read here, not by the environment)
GENERATION_OPTIONS = (
    "repo",
    "max_tasks",
    "environment",
    "wheelhouse",
    "kind",
    "bug_kinds",
    "bugs_per_function",
    "combined_bugs",
    "bug_seed",
)
_MARKER = ".complete.json"
# bump when generation changes what a task holds: older caches are then made again
_GENERATION_VERSION = 7
_SKIP = frozenset({".git", "__pycache__", ".pytest_cache", ".venv", ".tox"})


def repository_path(repo: str) -> Path:
    """The folder ``repo`` names: a shipped repository's name, or a path.

    Raises:
        ValueError: neither names a folder.
    """
    if repo in SHIPPED_REPOSITORIES:
        return Path(__file__).resolve().parents[1] / "envs" / "repos" / repo
    path = Path(repo).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"repo {repo!r} is neither a folder nor a shipped repository "
            f"({', '.join(SHIPPED_REPOSITORIES)}); give the repository's folder"
        )
    return path.resolve()


def check_generation_options(options: Mapping[str, Any], where: str) -> None:
    """Refuse, before anything loads, generation options that cannot make tasks: a ``repo``
    that names no folder (or a file), a repository without tests, an unknown ``kind`` or bug
    kind, a bad count. ``where`` names the entry in messages (``envs.0.options``).

    Raises:
        ValueError: one line naming the option, the value and the fix.
    """
    from composer_replication.datagen.bug_kinds import BUG_KINDS
    from composer_replication.datagen.generation import KINDS
    from composer_replication.datagen.test_discovery import discover_tests

    if "repo" in options:
        repo = options["repo"]
        if not isinstance(repo, str) or not repo.strip():
            raise ValueError(f"{where}.repo = {repo!r}: give a folder or a shipped repository")
        path = Path(repo).expanduser()
        if repo not in SHIPPED_REPOSITORIES and path.exists() and not path.is_dir():
            raise ValueError(
                f"{where}.repo = {repo!r} is a file, not a repository; give the repository's folder"
            )
        try:
            root = repository_path(repo)
            discover_tests(root)
        except ValueError as exc:
            raise ValueError(f"{where}.repo: {exc}") from None
    kind = options.get("kind", "deletion")
    if kind not in KINDS:
        raise ValueError(f"{where}.kind = {kind!r}: use {' or '.join(KINDS)}")
    kinds = options.get("bug_kinds")
    if kinds is not None:
        unknown = sorted(set(kinds) - set(BUG_KINDS)) if isinstance(kinds, list) else [kinds]
        if unknown:
            raise ValueError(
                f"{where}.bug_kinds: {unknown} unknown; use some of {', '.join(BUG_KINDS)}"
            )
    for name, least in (("max_tasks", 1), ("bugs_per_function", 1), ("combined_bugs", 0)):
        value = options.get(name, least)
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{where}.{name} = {value!r}: give an integer >= {least}")


def _content_digest(root: Path) -> str:
    digest = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in _SKIP)
        for name in sorted(filenames):
            path = Path(dirpath) / name
            digest.update(path.relative_to(root).as_posix().encode() + b"\0")
            digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()


def repository_tasks(
    repo: str,
    *,
    split: Any,
    budgets: AgentBudgets,
    tokenizer: Any,
    max_tasks: int = 1000,
    environment: str = "auto",
    wheelhouse: str | None = None,
    cache_root: Path | None = None,
    say: Callable[[str], None] | None = None,
    kind: str = "deletion",
    bug_kinds: Sequence[str] | None = None,
    bugs_per_function: int = 2,
    combined_bugs: int = 0,
    bug_seed: int = 0,
) -> Path:
    """The task file of ``repo``'s tasks of ``kind`` ("deletion" or "bugs", with the bug
    options of ``generate_tasks``) for these budgets and split, generated on first use.

    Raises:
        ValueError: an unknown repository; a repository that yields no task (the reason of
            each candidate is in the candidates report named in the message).
    """
    from composer_replication.common.project_cache import cache_dir

    say = say or (lambda _line: None)
    root = repository_path(repo)
    key_source = {
        "version": _GENERATION_VERSION,
        "content": _content_digest(root),
        "budgets": budgets.environment_options() | {"max_new_tokens": budgets.max_new_tokens},
        "tokenizer": getattr(tokenizer, "name_or_path", None),
        "split": split.to_record() if split is not None else None,
        "max_tasks": max_tasks,
        "environment": environment,
        "wheelhouse": wheelhouse,
        "kind": kind,
        "bugs": {
            "kinds": sorted(bug_kinds) if bug_kinds else None,
            "per_function": bugs_per_function,
            "combined": combined_bugs,
            "seed": bug_seed,
        }
        if kind == "bugs"
        else None,
    }
    key = hashlib.sha256(json.dumps(key_source, sort_keys=True).encode()).hexdigest()[:12]
    name = root.name if kind == "deletion" else f"{root.name}-{kind}"
    folder = (cache_root or cache_dir() / "tasks") / f"{name}-{key}"
    task_file = folder / "tasks.jsonl"
    if (folder / _MARKER).is_file():
        return task_file
    folder.parent.mkdir(parents=True, exist_ok=True)
    with open(folder.with_name(folder.name + ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one generation at a time (ranks, parallel runs)
        if (folder / _MARKER).is_file():  # made while we waited
            return task_file
        kinds = {
            "kind": kind,
            "bug_kinds": bug_kinds,
            "bugs_per_function": bugs_per_function,
            "combined_bugs": combined_bugs,
            "seed": bug_seed,
        }
        return _generate(
            repo, root, folder, key_source, split, budgets, tokenizer, max_tasks,
            environment, wheelhouse, say, kinds,
        )  # fmt: skip


def _generate(
    repo: str,
    root: Path,
    folder: Path,
    key_source: dict[str, Any],
    split: Any,
    budgets: AgentBudgets,
    tokenizer: Any,
    max_tasks: int,
    environment: str,
    wheelhouse: str | None,
    say: Callable[[str], None],
    kinds: Mapping[str, Any],
) -> Path:
    from composer_replication.sandbox.local import LocalSubprocessSandbox
    from composer_replication.sandbox.workdir import quota_fitting

    task_file = folder / "tasks.jsonl"
    shutil.rmtree(folder, ignore_errors=True)  # a generation that never finished
    folder.mkdir(parents=True)
    quota_mb = quota_fitting(root)

    def factory(workdir: Path, **options: Any) -> LocalSubprocessSandbox:
        return LocalSubprocessSandbox(
            workdir, exec_timeout_s=120, workdir_quota_mb=quota_mb, **options
        )

    say(f"generating the tasks of {repo} into {folder} (once; later runs reuse them)")
    try:

        def progress(done: int, total: int, message: str) -> None:
            if done == total or done % 10 == 0:
                say(f"  {done}/{total} candidates tried")

        report = generate_tasks(
            root,
            task_file,
            max_tasks=max_tasks,
            sandbox_factory=factory,
            split=split,
            progress=progress,
            budgets=budgets,
            tokenizer=tokenizer,
            environment=environment,
            wheelhouse=wheelhouse,
            say=say,
            **kinds,
        )
        if not report.accepted:
            raise ValueError(
                f"repo {repo!r} gave no task within these budgets; each candidate's reason is "
                f"in {report.candidates_output}"
            )
    except BaseException:
        if not (folder / "tasks.candidates.jsonl").is_file():
            shutil.rmtree(folder, ignore_errors=True)
        raise
    (folder / _MARKER).write_text(json.dumps(key_source, sort_keys=True) + "\n")
    say(f"{report.accepted} tasks ({report.train} train, {report.heldout} held out) from {repo}")
    return task_file


def resolve_repository_options(
    name: str,
    options: Mapping[str, Any],
    *,
    max_new_tokens: int,
    split: Any,
    tokenizer: Any,
    say: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """An entry's options with ``repo`` (and the other generation options) replaced by the
    ``task_file`` of that repository's tasks; other options, or other environments, as
    they are."""
    options = dict(options)
    builtin = builtin_environment(name)
    if builtin is None or not builtin.repository_tasks or "repo" not in options:
        return options
    if "task_file" in options:
        raise ValueError(
            f"{name} options name both repo and task_file; keep one (repo generates "
            "the tasks, task_file reads tasks datagen wrote)"
        )
    generation = {k: options.pop(k) for k in GENERATION_OPTIONS if k in options}
    budgets = AgentBudgets(
        max_turns=int(options.get("max_turns", AgentBudgets.max_turns)),
        max_new_tokens=max_new_tokens,
        max_total_tokens=int(options.get("max_total_tokens", AgentBudgets.max_total_tokens)),
        tools=tuple(options.get("tools", DEFAULT_TOOLS)),
        tool_format=str(options.get("tool_format", "auto")),
    )
    repo = str(generation.pop("repo"))
    options["task_file"] = str(
        repository_tasks(
            repo, split=split, budgets=budgets, tokenizer=tokenizer, say=say, **generation
        )
    )
    return options
