"""Grading a repository the agent worked in: put the tests back, then watch the code run.

After the agent's turn, ``restore_protected`` makes every test and runner-configuration file
the pristine one again (what the agent added there is removed), and ``guard_spec`` names
what the behaviour guard of the final test run protects (those files, the report) and whose
behaviour it judges: the files the agent wrote or changed (``agent_changed_files``), while
the repository's untouched code is trusted.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from composer_replication.safety.hack_monitor import HackMonitor, is_protected
from composer_replication.sandbox.base import GuardSpec
from composer_replication.sandbox.files import file_kind

__all__ = ["agent_changed_files", "guard_spec", "restore_protected"]

# Never graded code: version control, caches.
_SKIP_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".pytest_cache"})


def restore_protected(pristine: Path, workdir: Path, monitor: HackMonitor) -> list[str]:
    """Make every test and runner-configuration file of ``workdir`` the pristine one again.

    Protected files of ``pristine`` are copied over whatever is there (a file, a link, a
    FIFO); protected files that exist only in ``workdir`` (a new ``conftest.py``) are
    removed. Returns the relative paths it changed.
    """
    changed = []
    original = {rel: path for rel, path in monitor.protected_files(pristine)}
    current = {rel for rel, _ in monitor.protected_files(workdir)}
    for rel in sorted(current - set(original)):
        (workdir / rel).unlink(missing_ok=True)
        changed.append(rel)
    for rel, source in original.items():
        target = workdir / rel
        data = source.read_bytes()
        if file_kind(target) == "file" and target.read_bytes() == data:
            continue
        if file_kind(target) == "dir":
            shutil.rmtree(target)
        elif file_kind(target) != "missing":
            target.unlink()
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(data)
        changed.append(rel)
    return changed


def _files(root: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(root.rglob("*")):
        rel = path.relative_to(root)
        if _SKIP_DIRS.intersection(rel.parts) or file_kind(path) in ("dir", "missing"):
            continue
        found[rel.as_posix()] = path
    return found


def _same_regular_file(a: Path, b: Path) -> bool:
    if file_kind(a) != "file" or file_kind(b) != "file":
        return False
    return a.stat().st_size == b.stat().st_size and a.read_bytes() == b.read_bytes()


def agent_changed_files(
    pristine: Path, workdir: Path, protected_patterns: tuple[str, ...]
) -> list[str]:
    """Relative paths of the non-test files of ``workdir`` that are new or differ from
    ``pristine`` (links and special files count as changed)."""
    before = _files(pristine)
    changed = []
    for rel, path in _files(workdir).items():
        if is_protected(rel, protected_patterns):
            continue
        old = before.get(rel)
        if not (old is not None and _same_regular_file(path, old)):
            changed.append(rel)
    return changed


def guard_spec(pristine: Path, workdir: Path, monitor: HackMonitor) -> GuardSpec:
    """The behaviour guard's view of a restored ``workdir``: the pristine test and runner
    files are protected; the agent's changed files are the code under judgement."""
    protected = tuple(rel for rel, _ in monitor.protected_files(pristine))
    candidates = agent_changed_files(pristine, workdir, monitor.protected_patterns)
    return GuardSpec(protected=protected, candidates=tuple(candidates))
