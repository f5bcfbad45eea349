"""A repository's own content, copied for a task: never anything a task generation wrote.

Task working copies hold every function body but the deleted one, and the reference files
hold the deleted ones: a generation whose outputs lie inside the repository (``-o`` under
it, an earlier run's ``<stem>.workdirs``) would hand the answers of one task to the next.
:func:`copy_repository` copies a git work tree's tracked files only (as they are on disk),
and, in any tree, leaves out every output a generation writes, wherever it was written:

- folders a generation made (``<stem>.workdirs``, ``<stem>.envs``) carry
  :data:`OUTPUT_MARKER` (:func:`mark_output_folder`); an older one without it is known by
  the task file beside it;
- task, held-out, reference and candidate files are known by their first record (a
  ``task_id`` of this project's task kinds), or, empty, by the outputs beside them; split
  records and reference files by name;
- virtualenvs (a ``pyvenv.cfg``), version-control folders and caches are never copied.

The copy is then scrubbed (``sandbox.scrub``).
"""

from __future__ import annotations

import shutil
import subprocess
from collections.abc import Collection
from pathlib import Path

from composer_replication.common.outputs import OUTPUT_MARKER, is_generation_output
from composer_replication.sandbox.scrub import scrub_tree

__all__ = [
    "OUTPUT_MARKER",
    "copy_repository",
    "is_generation_output",
    "mark_output_folder",
    "tracked_files",
]

# not worth copying at all (scrub_tree would delete what is left of the leak list anyway)
_COPY_IGNORE = shutil.ignore_patterns(".git", ".hg", ".svn", ".venv", ".tox", ".nox", "__pycache__")


def mark_output_folder(folder: Path) -> Path:
    """Make ``folder`` (and its parents) and mark it as a generation's output; returns it."""
    folder.mkdir(parents=True, exist_ok=True)
    marker = folder / OUTPUT_MARKER
    if not marker.exists():
        marker.write_text("written by composer-replication; never copied into a task\n")
    return folder


def tracked_files(repo: Path) -> set[str] | None:
    """The paths git tracks in ``repo`` (relative, as they are on disk), or None when it is
    not the top of a git work tree (or git is not installed)."""
    if not (repo / ".git").exists() or shutil.which("git") is None:
        return None
    try:
        done = subprocess.run(
            ["git", "-C", str(repo), "ls-files", "-z", "--cached"],
            capture_output=True,
            timeout=120,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if done.returncode != 0:
        return None
    return {p for p in done.stdout.decode("utf-8", errors="surrogateescape").split("\0") if p}


def copy_repository(src: Path, dst: Path, *, skip: Collection[Path] = ()) -> None:
    """Copy the repository ``src`` to ``dst`` and scrub it: a git work tree's tracked files
    only, never a generation's output (see the module); ``skip``: resolved paths also left
    out (the running generation's own outputs)."""
    skipped = {str(p) for p in skip}
    root = src.resolve()
    tracked = tracked_files(root)
    tracked_dirs = None
    if tracked is not None:
        tracked_dirs = {str(parent) for p in tracked for parent in Path(p).parents}

    def ignore(folder: str, names: list[str]) -> set[str]:
        here = Path(folder).resolve()
        left_out = set(_COPY_IGNORE(folder, names))
        for name in names:
            path = here / name
            if name in left_out:
                continue
            if str(path) in skipped or is_generation_output(path):
                left_out.add(name)
            elif tracked is not None and tracked_dirs is not None:
                rel = str(path.relative_to(root))
                if rel not in tracked and rel not in tracked_dirs:
                    left_out.add(name)
        return left_out

    shutil.copytree(src, dst, symlinks=True, ignore=ignore)
    # a folder that held only what was left out would still hint at it
    for folder in sorted((p for p in dst.rglob("*") if p.is_dir() and not p.is_symlink()),
                         key=lambda p: len(p.parts), reverse=True):  # fmt: skip
        source = src / folder.relative_to(dst)
        if not any(folder.iterdir()) and source.is_dir() and any(source.iterdir()):
            folder.rmdir()
    scrub_tree(dst)
