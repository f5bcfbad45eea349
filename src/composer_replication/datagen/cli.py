"""`composer-replication datagen REPO -o tasks.jsonl --max-tasks N`: FeatureDeletion from a repo.

`datagen_main` is the library entry (progress bar, per-gate rejection table, exit code);
`datagen_command` is the typer command around it and `app` a one-command typer app, so the
top-level CLI can mount it with `app.command("datagen")(datagen_command)`. rich and the
generator load inside the call, keeping `--help` fast.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from composer_replication.safety.holdout import DEFAULT_SPLIT, HeldoutSplit

__all__ = ["app", "datagen_command", "datagen_main"]


def datagen_main(
    repo: Path,
    output: Path,
    max_tasks: int,
    *,
    split: HeldoutSplit | None = DEFAULT_SPLIT,
    exec_timeout_s: float = 300.0,
    console: Any = None,
) -> int:
    """Generate FD tasks with a progress bar and print the rejection summary.

    Held-out tasks (the project's default `HeldoutSplit` unless `split` says otherwise) go to
    the `.heldout.jsonl` sibling of `output`, never into it. Returns the process exit code:
    0 when at least one task was accepted, 1 when none was, 2 for unusable input.
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.table import Table

    from composer_replication.datagen.feature_deletion import generate_tasks
    from composer_replication.sandbox.local import LocalSubprocessSandbox

    console = console or Console(stderr=True)
    if not Path(repo).is_dir():
        console.print(f"[red]error[/red]: repo {str(repo)!r} is not a directory")
        return 2
    if max_tasks < 1:
        console.print(f"[red]error[/red]: --max-tasks must be >= 1, got {max_tasks}")
        return 2

    def factory(workdir: Path) -> LocalSubprocessSandbox:
        return LocalSubprocessSandbox(workdir, exec_timeout_s=exec_timeout_s)

    with Progress(
        TextColumn("[bold]datagen[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=False,
    ) as bar:
        job = bar.add_task("finding candidates", total=None)

        def progress(done: int, total: int, message: str) -> None:
            bar.update(job, completed=done, total=total, description=message)

        report = generate_tasks(
            repo,
            output,
            max_tasks=max_tasks,
            sandbox_factory=factory,
            split=split,
            progress=progress,
        )
    table = Table(title=f"FeatureDeletion on {report.repo}: {report.candidates} candidates")
    table.add_column("outcome")
    table.add_column("count", justify="right")
    table.add_row("accepted (train)", str(report.train))
    table.add_row("accepted (held-out)", str(report.heldout))
    for gate, count in report.rejected.items():
        table.add_row(f"rejected: {gate}", str(count))
    console.print(table)
    console.print(f"tasks: {report.output}")
    if report.heldout_output:
        console.print(f"held-out tasks: {report.heldout_output}")
    console.print(f"hidden references (owner-only): {report.reference_output}")
    console.print(f"workdirs: {report.workdirs}  ({report.duration_s:.1f} s)")
    return 0 if report.accepted else 1


def datagen_command(
    repo: Annotated[Path, typer.Argument(help="Repository whose pytest suite passes.")],
    output: Annotated[
        Path, typer.Option("-o", "--output", help="Training task file (JSONL).")
    ] = Path("tasks.jsonl"),
    max_tasks: Annotated[int, typer.Option("--max-tasks", min=1, help="Stop after N tasks.")] = 10,
) -> None:
    """FeatureDeletion: delete covered function bodies, keep tasks that pass all 4 gates."""
    raise typer.Exit(datagen_main(repo, output, max_tasks))


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)
app.command("datagen")(datagen_command)
