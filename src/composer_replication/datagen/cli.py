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

from composer_replication.errors import command_group
from composer_replication.safety.holdout import DEFAULT_SPLIT, HeldoutSplit

__all__ = ["app", "datagen_command", "datagen_main"]


def _error(console: Any, message: str) -> None:
    """One line, however wide the terminal (rich would wrap it)."""
    from rich.markup import escape

    console.print(f"[red]error[/red]: {escape(message)}", soft_wrap=True, highlight=False)


def datagen_main(
    repo: Path,
    output: Path,
    max_tasks: int,
    *,
    split: HeldoutSplit | None = DEFAULT_SPLIT,
    exec_timeout_s: float = 300.0,
    console: Any = None,
    follow_symlinks: bool = False,
) -> int:
    """Generate FD tasks with a progress bar and print the rejection summary.

    Held-out tasks (the project's default `HeldoutSplit` unless `split` says otherwise) go to
    the `.heldout.jsonl` sibling of `output`, never into it. Returns the process exit code:
    0 when at least one task was accepted, 1 when none was (nothing written: earlier task
    files stay as they were), 2 for unusable input or an output path the output policy
    refuses (checked before any work).
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.table import Table

    from composer_replication.datagen.feature_deletion import check_outputs, generate_tasks
    from composer_replication.outputs import OutputError, check_output
    from composer_replication.sandbox.local import LocalSubprocessSandbox
    from composer_replication.sandbox.workdir import quota_fitting

    console = console or Console(stderr=True)
    if not Path(repo).is_dir():
        _error(console, f"repo {str(repo)!r} is not a directory; pass the repository's folder")
        return 2
    if max_tasks < 1:
        _error(console, f"--max-tasks must be >= 1, got {max_tasks}")
        return 2
    try:
        output = check_outputs(check_output(output, follow_symlinks=follow_symlinks))
    except OutputError as exc:
        _error(console, str(exc))
        return 2

    quota_mb = quota_fitting(repo)  # a large repository fits; its tests cannot fill the disk

    def factory(workdir: Path) -> LocalSubprocessSandbox:
        return LocalSubprocessSandbox(
            workdir, exec_timeout_s=exec_timeout_s, workdir_quota_mb=quota_mb
        )

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
    if not report.accepted:
        _error(
            console,
            f"no task passed the gates: nothing written ({report.output} and its sibling "
            "files left as they were)",
        )
        return 1
    console.print(f"tasks: {report.output}")
    if report.heldout_output:
        console.print(f"held-out tasks: {report.heldout_output}")
    console.print(f"hidden references (owner-only): {report.reference_output}")
    console.print(f"workdirs: {report.workdirs}  ({report.duration_s:.1f} s)")
    return 0


def datagen_command(
    repo: Annotated[Path, typer.Argument(help="Repository whose pytest suite passes.")],
    output: Annotated[
        Path, typer.Option("-o", "--output", help="Training task file (JSONL).")
    ] = Path("tasks.jsonl"),
    max_tasks: Annotated[int, typer.Option("--max-tasks", min=1, help="Stop after N tasks.")] = 10,
    follow_symlinks: Annotated[
        bool,
        typer.Option("--follow-symlinks", help="Write through an output that is a symbolic link."),
    ] = False,
) -> None:
    """FeatureDeletion: delete covered function bodies, keep tasks that pass all 4 gates."""
    raise typer.Exit(datagen_main(repo, output, max_tasks, follow_symlinks=follow_symlinks))


app = command_group("datagen", "Make FeatureDeletion tasks from a repository.")
app.command("datagen")(datagen_command)
