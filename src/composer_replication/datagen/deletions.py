"""FeatureDeletion candidates: a covered function's body deleted, to be written again.

Each candidate function or method (found with `ast`, ``envs.fd_tasks.find_candidates``; the
test modules are never candidates) becomes a :class:`~datagen.modification.Modification`
whose changed file has the body replaced by a one-line stub that raises (signature,
decorators and docstring kept, so the agent sees what to rebuild); the removed lines are
the hidden reference. The prompt names the function, shows its header and the tests that
exercise it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from pathlib import Path

from composer_replication.datagen.modification import Modification
from composer_replication.envs.fd_tasks import (
    STUB_EXCEPTION,
    delete_body,
    find_candidates,
    make_task_id,
)

__all__ = ["KIND", "deletion_candidates", "deletion_prompt"]

#: the task kind deletions record
KIND = "feature_deletion"


def deletion_candidates(
    base: Path, repo_name: str, *, exclude: Collection[str] = ()
) -> list[Modification]:
    """One deletion per candidate function of the repository copy ``base``, in file
    order; ``exclude``: files never changed (the repository's test modules)."""
    out = []
    texts: dict[str, str] = {}
    for cand in find_candidates(base, exclude=exclude):
        if cand.file not in texts:
            texts[cand.file] = (base / cand.file).read_text(encoding="utf-8")
        changed, reference = delete_body(texts[cand.file], cand)
        out.append(
            Modification(
                task_id=make_task_id(repo_name, cand.file, cand.qualname),
                kind=KIND,
                file=cand.file,
                qualname=cand.qualname,
                name=cand.name,
                changed={cand.file: changed},
                original={cand.file: texts[cand.file]},
                reference=reference,
                lines=(cand.header_start, cand.body_start),
                sites=tuple(range(cand.body_start, cand.body_end + 1)),
                detail=f"body of {cand.qualname} (lines {cand.body_start}-{cand.body_end})",
            )
        )
    return out


def deletion_prompt(workdir: Path, modification: Modification, targets: Sequence[str]) -> str:
    """The task: which body was deleted, its header (as the workdir shows it) and the tests
    that exercise it."""
    lines = (workdir / modification.file).read_text(encoding="utf-8").splitlines()
    first, stub = modification.lines
    shown = "\n".join(lines[first - 1 : stub])
    files = list(dict.fromkeys(t.split("::", 1)[0] for t in targets))
    examples = (
        ", ".join(targets)
        if len(targets) <= 3
        else f"{len(targets)} tests in {', '.join(files[:5])}"
        + (f" and {len(files) - 5} more files" if len(files) > 5 else "")
    )
    return (
        f"The body of `{modification.qualname}` in `{modification.file}` was deleted; it now "
        f"raises {STUB_EXCEPTION}. Restore the implementation so that the test suite passes "
        f"again. Tests that exercise it: {examples}. Do not modify tests or test "
        "configuration: changes to them are detected and score zero.\n\n"
        f"```python\n{shown}\n```\n"
    )
