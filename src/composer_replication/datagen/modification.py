"""A candidate change to a repository, the thing a repository task asks the agent to undo.

Task generation (``datagen.generation``) is blind to what the change is: each kind of task
(a deleted body, ``datagen.deletions``; an injected bug, ``datagen.bug_tasks``) proposes
:class:`Modification` records, and the gates, the reference agent and the task files treat
them all alike. A modification holds the changed text of the files it touches, their
untouched text and the hidden reference that undoes it (the inverse patch).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from composer_replication.envs.fd_tasks import TaskReference

__all__ = ["Modification"]


@dataclass(frozen=True)
class Modification:
    """One candidate change.

    Attributes:
        task_id: The id the task gets (what the held-out split hashes: up to its ``#``).
        kind: The task kind recorded on the task ("feature_deletion", "bug").
        file: The file the change is in (repository-relative, POSIX).
        qualname: The function it changes.
        name: The identifier a test would mention to cover it (static preselection).
        changed: Repository-relative path -> the file's text with the change.
        original: The same paths -> their untouched text.
        reference: The hidden answer (its ``task_id`` is ``task_id``).
        lines: The changed function's first and last line in the changed file (1-based,
            decorators in).
        sites: Lines of the untouched file whose running the change needs to be noticed
            (a test that runs none of them cannot fail).
        detail: What the change is, for the candidates report (never shown to an agent).
        bug_kind: The injected bug's kind (None for other kinds).
    """

    task_id: str
    kind: str
    file: str
    qualname: str
    name: str
    changed: Mapping[str, str]
    original: Mapping[str, str]
    reference: TaskReference
    lines: tuple[int, int]
    sites: tuple[int, ...] = ()
    detail: str = ""
    bug_kind: str | None = None

    def __post_init__(self) -> None:
        if self.reference.task_id != self.task_id:
            object.__setattr__(self, "reference", replace(self.reference, task_id=self.task_id))

    def covered(self, lines: Mapping[str, Collection[int]]) -> bool:
        """Whether a test runs one of its sites (``lines``: what the suite runs, by file)."""
        ran = lines.get(self.file, ())
        return any(line in ran for line in self.sites)

    def apply(self, workdir: Path) -> None:
        """Write the changed files into ``workdir`` (a copy of the repository)."""
        for rel, text in self.changed.items():
            (workdir / rel).write_text(text, encoding="utf-8")
