"""`composer-replication datagen REPO -o tasks.jsonl --max-tasks N`: FeatureDeletion from a repo.

`datagen_main` is the library entry (progress bar, per-gate rejection table, exit code);
`datagen_command` is the typer command around it and `app` a one-command typer app, so the
top-level CLI can mount it with `app.command("datagen")(datagen_command)`. rich and the
generator load inside the call, keeping `--help` fast.

`composer-replication import-tasks INSTANCES.jsonl -o tasks.jsonl`: SWE-style instances
(SWE-bench / SWE-Gym JSONL) validated and written as the same task files
(`datagen.swe`); `import_tasks_main` / `import_tasks_command` as above.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from composer_replication.common.errors import command_group
from composer_replication.safety.holdout import DEFAULT_SPLIT, HeldoutSplit

__all__ = [
    "app",
    "datagen_command",
    "datagen_main",
    "import_tasks_command",
    "import_tasks_main",
]


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
    test_command: str | None = None,
    environment: str = "auto",
    wheelhouse: Path | None = None,
    docker_image: str | None = None,
    model: str = "embedded",
    budgets: Any = None,
    kind: str = "deletion",
    bug_kinds: list[str] | None = None,
    combined_bugs: int = 0,
    seed: int = 0,
) -> int:
    """Generate tasks of ``kind`` with a progress bar and print the outcome of every
    candidate.

    Held-out tasks (the project's default `HeldoutSplit` unless `split` says otherwise) go to
    the `.heldout.jsonl` sibling of `output`, never into it. The table counts each outcome
    with an example reason; ``<stem>.candidates.jsonl`` has every candidate's. Returns the
    process exit code: 0 when at least one task was accepted, 1 when none was (no task
    file written: earlier task files stay as they were; the candidates report is written),
    2 for unusable input or an output path the output policy refuses (checked before any
    work).
    """
    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.table import Table

    from composer_replication.common.outputs import OutputError, check_output
    from composer_replication.common.progress import heartbeat
    from composer_replication.datagen.bug_kinds import BUG_KINDS
    from composer_replication.datagen.generation import (
        KINDS,
        AgentBudgets,
        check_outputs,
        generate_tasks,
    )
    from composer_replication.datagen.repository_environment import ENVIRONMENTS

    console = console or Console(stderr=True)
    if not Path(repo).is_dir():
        _error(console, f"repo {str(repo)!r} is not a directory; pass the repository's folder")
        return 2
    if max_tasks < 1:
        _error(console, f"--max-tasks must be >= 1, got {max_tasks}")
        return 2
    if environment not in ENVIRONMENTS:
        _error(console, f"--environment {environment!r}: use {', '.join(ENVIRONMENTS)}")
        return 2
    if wheelhouse is not None and not Path(wheelhouse).is_dir():
        _error(console, f"--wheelhouse {str(wheelhouse)!r} is not a directory of wheels")
        return 2
    if kind not in KINDS:
        _error(console, f"--kind {kind!r}: use {' or '.join(KINDS)}")
        return 2
    unknown = sorted(set(bug_kinds or ()) - set(BUG_KINDS))
    if unknown:
        _error(console, f"--bug-kinds {','.join(unknown)}: use some of {','.join(BUG_KINDS)}")
        return 2
    if combined_bugs < 0:
        _error(console, f"--combined-bugs must be >= 0, got {combined_bugs}")
        return 2
    try:
        output = check_outputs(
            check_output(output, follow_symlinks=follow_symlinks, owns=("task_generation",)),
            input_dirs=[repo],
        )
        tokenizer = _tokenizer(model)
        factory = _sandbox_factory(repo, exec_timeout_s, docker_image)
    except (OutputError, ValueError) as exc:
        _error(console, str(exc))
        return 2

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

        try:
            with heartbeat(bar.console, "datagen", announce=False):
                report = generate_tasks(
                    repo,
                    output,
                    max_tasks=max_tasks,
                    sandbox_factory=factory,
                    split=split,
                    progress=progress,
                    test_command=test_command,
                    budgets=budgets or AgentBudgets(),
                    tokenizer=tokenizer,
                    environment=environment,
                    wheelhouse=wheelhouse,
                    image=docker_image,
                    say=lambda line: bar.console.print(line, soft_wrap=True, highlight=False),
                    kind=kind,
                    bug_kinds=bug_kinds or None,
                    combined_bugs=combined_bugs,
                    seed=seed,
                )
        except (
            ValueError,
            RuntimeError,
        ) as exc:  # a virtualenv that failed, an unusable test command
            _error(console, str(exc))
            return 2
    console.print(_outcome_table(report, Table), soft_wrap=True)
    if Path(report.candidates_output).is_file():
        console.print(f"every candidate and its outcome: {report.candidates_output}")
    if not report.accepted:
        why = "no task passed the gates"
        if not report.candidates and report.unparsable:
            (first, error), more = next(iter(report.unparsable.items())), len(report.unparsable)
            why = (
                f"no candidate: {first} does not parse ({error})"
                + (f", and {more - 1} more files" if more > 1 else "")
                + "; fix the syntax error"
            )
        _error(
            console,
            f"{why}: no task file written ({report.output} and its sibling files left as "
            "they were)",
        )
        return 1
    console.print(f"tasks: {report.output}")
    if report.heldout_output:
        console.print(f"held-out tasks: {report.heldout_output}")
    console.print(f"hidden references (owner-only): {report.reference_output}")
    console.print(f"workdirs: {report.workdirs}  ({report.duration_s:.1f} s)")
    return 0


def _budgets(
    max_turns: int, max_new_tokens: int, max_total_tokens: int, tools: str | None, tool_format: str
) -> Any:
    """The ``AgentBudgets`` the command's options give (``tools``: comma-separated);
    unknown tools or formats are usage errors."""
    from composer_replication.datagen.generation import AgentBudgets
    from composer_replication.envs.fd_tools import DEFAULT_TOOLS, tool_specs
    from composer_replication.rollout.tool_formats import TOOL_FORMAT_MODES

    if tools:
        try:
            tool_specs([t.strip() for t in tools.split(",") if t.strip()])
        except ValueError as exc:
            raise typer.BadParameter(str(exc), param_hint="--tools") from None
    if tool_format not in TOOL_FORMAT_MODES:
        raise typer.BadParameter(
            f"{tool_format!r}; use {', '.join(TOOL_FORMAT_MODES)}", param_hint="--tool-format"
        )
    return AgentBudgets(
        max_turns=max_turns,
        max_new_tokens=max_new_tokens,
        max_total_tokens=max_total_tokens,
        tools=tuple(t.strip() for t in tools.split(",") if t.strip()) if tools else DEFAULT_TOOLS,
        tool_format=tool_format,
    )


def _tokenizer(model: str) -> Any:
    """The tokenizer the solvability gate counts tokens with (the agent model's)."""
    from composer_replication.model.loading import load_tokenizer
    from composer_replication.model.sources import check_model_source

    check_model_source(model, "--model")
    return load_tokenizer(None if model == "embedded" else model)


def _sandbox_factory(repo: Path, exec_timeout_s: float, image: str | None) -> Any:
    """The gates' sandbox factory: local (bubblewrap), or one container per run."""
    from composer_replication.sandbox.workdir import quota_fitting

    if image:
        from composer_replication.sandbox.docker import DockerSandboxFactory

        return DockerSandboxFactory(image, exec_timeout_s=exec_timeout_s)
    from composer_replication.sandbox.local import LocalSubprocessSandbox

    quota_mb = quota_fitting(repo)  # a large repository fits; its tests cannot fill the disk

    def factory(workdir: Path, **options: Any) -> LocalSubprocessSandbox:
        return LocalSubprocessSandbox(
            workdir, exec_timeout_s=exec_timeout_s, workdir_quota_mb=quota_mb, **options
        )

    return factory


def _outcome_table(report: Any, table_type: Any) -> Any:
    """Outcome, count and the first reason of each (reasons cut to one short line)."""
    what = "Bug-fix tasks" if getattr(report, "kind", "") == "bugs" else "FeatureDeletion"
    excluded = getattr(report, "excluded", {})
    baseline = (
        f"; baseline: {report.baseline_passing} tests pass, excluded "
        + (", ".join(f"{n} {why}" for why, n in excluded.items()) or "none")
        if getattr(report, "baseline_passing", 0)
        else ""
    )
    table = table_type(
        title=f"{what} on {report.repo}: {report.candidates} candidates; tests: "
        f"{report.test_command}{baseline}"
    )
    table.add_column("outcome")
    table.add_column("count", justify="right")
    table.add_column("example reason")
    table.add_row("accepted (train)", str(report.train), "")
    table.add_row("accepted (held-out)", str(report.heldout), "")
    first = {}
    for qualname, gate, reason in report.rejections:
        first.setdefault(gate, f"{qualname}: {' '.join(reason.split())}")
    for gate, count in report.rejected.items():
        example = first.get(gate, "")
        table.add_row(
            f"rejected: {gate}", str(count), example[:110] + ("..." if len(example) > 110 else "")
        )
    unparsable = getattr(report, "unparsable", {})
    if unparsable:
        rel, error = next(iter(unparsable.items()))
        table.add_row("files not parsed", str(len(unparsable)), f"{rel}: {error}"[:110])
    return table


# the options datagen and import-tasks share: the agent's budgets and tools, the sandbox's
# test time, the output's links
ModelOption = Annotated[
    str,
    typer.Option(
        "--model", help="The agent model whose tokens the budgets count ('embedded', a dir)."
    ),
]
MaxTurnsOption = Annotated[
    int, typer.Option("--max-turns", min=1, help="Turns an episode may take.")
]
MaxNewTokensOption = Annotated[
    int, typer.Option("--max-new-tokens", min=1, help="Tokens one turn may take.")
]
MaxTotalTokensOption = Annotated[
    int, typer.Option("--max-total-tokens", min=1, help="Tokens an episode may take in all.")
]
ToolsOption = Annotated[
    str | None,
    typer.Option("--tools", help="Comma-separated tools the agent has (default: the editing set)."),
]
ToolFormatOption = Annotated[str, typer.Option("--tool-format", help="auto, native or text.")]
ExecTimeoutOption = Annotated[
    float, typer.Option("--exec-timeout", min=1, help="Seconds one test run may take.")
]
FollowSymlinksOption = Annotated[
    bool, typer.Option("--follow-symlinks", help="Write through an output that is a symbolic link.")
]


def datagen_command(
    repo: Annotated[Path, typer.Argument(help="Repository whose test suite passes.")],
    output: Annotated[
        Path, typer.Option("-o", "--output", help="Training task file (JSONL).")
    ] = Path("tasks.jsonl"),
    max_tasks: Annotated[int, typer.Option("--max-tasks", min=1, help="Stop after N tasks.")] = 10,
    test_command: Annotated[
        str | None,
        typer.Option(
            "--test-command",
            help="How to run the suite (default: as the repository configures it).",
        ),
    ] = None,
    environment: Annotated[
        str,
        typer.Option(
            "--environment",
            help="auto: a virtualenv of the repository's declared dependencies when it declares "
            "any; venv: always; system: the sandbox's interpreter.",
        ),
    ] = "auto",
    wheelhouse: Annotated[
        Path | None,
        typer.Option("--wheelhouse", help="Build the virtualenv offline from these wheels."),
    ] = None,
    docker_image: Annotated[
        str | None,
        typer.Option(
            "--docker-image",
            help="Run the tests in containers of this image (DockerSandbox); recorded on each task.",
        ),
    ] = None,
    model: ModelOption = "embedded",
    max_turns: MaxTurnsOption = 8,
    max_new_tokens: MaxNewTokensOption = 256,
    max_total_tokens: MaxTotalTokensOption = 4096,
    tools: ToolsOption = None,
    tool_format: ToolFormatOption = "auto",
    exec_timeout: ExecTimeoutOption = 300.0,
    follow_symlinks: FollowSymlinksOption = False,
    kind: Annotated[
        str,
        typer.Option(
            "--kind",
            help="deletion: a covered function's body deleted; bugs: a small bug injected "
            "into one (the agent fixes it from the failing tests).",
        ),
    ] = "deletion",
    bug_kinds: Annotated[
        str | None,
        typer.Option(
            "--bug-kinds",
            help="Comma-separated bug kinds to inject (default: all; see docs/agents.md).",
        ),
    ] = None,
    combined_bugs: Annotated[
        int, typer.Option("--combined-bugs", help="Candidates of two bugs in one file, too.")
    ] = 0,
    seed: Annotated[int, typer.Option("--seed", help="Picks the bugs and their order.")] = 0,
) -> None:
    """Tasks from a repository: delete covered function bodies (--kind deletion) or inject
    small bugs (--kind bugs); keep the candidates that pass every gate (the last: the
    reference agent solves them within the agent's budgets)."""
    budgets = _budgets(max_turns, max_new_tokens, max_total_tokens, tools, tool_format)
    raise typer.Exit(
        datagen_main(
            repo,
            output,
            max_tasks,
            kind=kind,
            bug_kinds=[k.strip() for k in bug_kinds.split(",") if k.strip()] if bug_kinds else None,
            combined_bugs=combined_bugs,
            seed=seed,
            follow_symlinks=follow_symlinks,
            test_command=test_command,
            environment=environment,
            wheelhouse=wheelhouse,
            docker_image=docker_image,
            model=model,
            budgets=budgets,
            exec_timeout_s=exec_timeout,
        )
    )


def import_tasks_main(
    instances: Path,
    output: Path,
    *,
    repos: Path | None = None,
    max_tasks: int | None = None,
    split: HeldoutSplit | None = DEFAULT_SPLIT,
    exec_timeout_s: float = 300.0,
    console: Any = None,
    follow_symlinks: bool = False,
    test_command: str | None = None,
    environment: str = "auto",
    wheelhouse: Path | None = None,
    docker_image: str | None = None,
    model: str = "embedded",
    budgets: Any = None,
) -> int:
    """Import SWE-style instances with a progress bar and print the outcome per gate.

    Held-out tasks go to the `.heldout.jsonl` sibling of `output`; ``<stem>.candidates.jsonl``
    has every instance's outcome and reason. Returns the process exit code: 0 when at least
    one task was accepted, 1 when none was (no task file written; the candidates report is),
    2 for unusable input (no instances file, none in it, a bad option, an output the output
    policy refuses), checked before any work.
    """
    from types import SimpleNamespace

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn
    from rich.table import Table

    from composer_replication.common.outputs import OutputError, check_output
    from composer_replication.datagen.generation import AgentBudgets, check_outputs
    from composer_replication.datagen.repository_environment import ENVIRONMENTS
    from composer_replication.datagen.swe import import_instances

    console = console or Console(stderr=True)
    problem = None
    if not Path(instances).is_file():
        problem = f"instances file {str(instances)!r} does not exist; pass a JSONL file"
    elif repos is not None and not Path(repos).is_dir():
        problem = f"--repos {str(repos)!r} is not a directory of repositories"
    elif max_tasks is not None and max_tasks < 1:
        problem = f"--max-tasks must be >= 1, got {max_tasks}"
    elif environment not in ENVIRONMENTS:
        problem = f"--environment {environment!r}: use {', '.join(ENVIRONMENTS)}"
    elif wheelhouse is not None and not Path(wheelhouse).is_dir():
        problem = f"--wheelhouse {str(wheelhouse)!r} is not a directory of wheels"
    if problem is not None:
        _error(console, problem)
        return 2
    try:
        output = check_outputs(
            check_output(output, follow_symlinks=follow_symlinks, owns=("task_generation",)),
            inputs=[instances],
            input_dirs=[repos] if repos is not None else [],
        )
        tokenizer = _tokenizer(model)
    except (OutputError, ValueError) as exc:
        _error(console, str(exc))
        return 2
    if docker_image:
        factory = _sandbox_factory(Path(instances), exec_timeout_s, docker_image)
    else:

        def factory(workdir: Path, **options: Any) -> Any:  # a quota fitting each workdir
            return _sandbox_factory(workdir, exec_timeout_s, None)(workdir, **options)

    with Progress(
        TextColumn("[bold]import-tasks[/bold]"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.description}"),
        console=console,
        transient=False,
    ) as bar:
        job = bar.add_task("reading instances", total=None)

        def progress(done: int, total: int, message: str) -> None:
            bar.update(job, completed=done, total=total, description=message)

        try:
            report = import_instances(
                instances,
                output,
                sandbox_factory=factory,
                split=split,
                repos=repos,
                budgets=budgets or AgentBudgets(),
                tokenizer=tokenizer,
                environment=environment,
                wheelhouse=wheelhouse,
                image=docker_image,
                test_command=test_command,
                say=lambda line: bar.console.print(line, soft_wrap=True, highlight=False),
                progress=progress,
                max_tasks=max_tasks,
            )
        except ValueError as exc:  # no instance in the file, an output the policy refuses
            _error(console, str(exc))
            return 2
    counts = SimpleNamespace(  # what the table's rows read (its title is our own)
        repo="",
        candidates=0,
        test_command="",
        **{k: getattr(report, k) for k in ("train", "heldout", "rejected", "rejections")},
    )
    table = _outcome_table(counts, Table)
    table.title = f"SWE import of {Path(instances).name}: {report.instances} instances"
    if report.not_tried:
        table.add_row("not tried (--max-tasks reached)", str(report.not_tried), "")
    console.print(table, soft_wrap=True)
    console.print(f"every instance and its outcome: {report.candidates_output}")
    if not report.accepted:
        _error(
            console,
            f"no instance passed the gates: no task file written ({report.output} and its "
            "sibling files left as they were)",
        )
        return 1
    console.print(f"tasks: {report.output}")
    if report.heldout_output:
        console.print(f"held-out tasks: {report.heldout_output}")
    console.print(f"hidden references (owner-only): {report.reference_output}")
    console.print(f"workdirs: {report.workdirs}  ({report.duration_s:.1f} s)")
    return 0


def import_tasks_command(
    instances: Annotated[
        Path, typer.Argument(help="SWE-style instances, one JSON object a line (SWE-bench fields).")
    ],
    output: Annotated[
        Path, typer.Option("-o", "--output", help="Training task file (JSONL).")
    ] = Path("tasks.jsonl"),
    repos: Annotated[
        Path | None,
        typer.Option(
            "--repos",
            help="Folder of git repositories, as <owner>__<name> or <name>, for instances "
            "without repo_path.",
        ),
    ] = None,
    max_tasks: Annotated[
        int | None, typer.Option("--max-tasks", min=1, help="Stop after N accepted tasks.")
    ] = None,
    environment: Annotated[
        str,
        typer.Option(
            "--environment",
            help="auto: a virtualenv of the repository's declared dependencies when it declares "
            "any; venv: always; system: the sandbox's interpreter.",
        ),
    ] = "auto",
    wheelhouse: Annotated[
        Path | None,
        typer.Option("--wheelhouse", help="Build the virtualenvs offline from these wheels."),
    ] = None,
    docker_image: Annotated[
        str | None,
        typer.Option(
            "--docker-image",
            help="Run the tests in containers of this image (DockerSandbox); recorded on each task.",
        ),
    ] = None,
    test_command: Annotated[
        str | None,
        typer.Option(
            "--test-command",
            help="How to run the tests (default: as each repository configures them).",
        ),
    ] = None,
    model: ModelOption = "embedded",
    max_turns: MaxTurnsOption = 8,
    max_new_tokens: MaxNewTokensOption = 256,
    max_total_tokens: MaxTotalTokensOption = 4096,
    tools: ToolsOption = None,
    tool_format: ToolFormatOption = "auto",
    exec_timeout: ExecTimeoutOption = 300.0,
    follow_symlinks: FollowSymlinksOption = False,
) -> None:
    """Import SWE-style instances (SWE-bench / SWE-Gym JSONL) as repository tasks.

    Each is validated in the sandbox: its FAIL_TO_PASS tests fail, its PASS_TO_PASS tests
    pass, with the gold patch both pass, and the reference agent solves it within the
    agent's budgets."""
    budgets = _budgets(max_turns, max_new_tokens, max_total_tokens, tools, tool_format)
    raise typer.Exit(
        import_tasks_main(
            instances,
            output,
            repos=repos,
            max_tasks=max_tasks,
            exec_timeout_s=exec_timeout,
            follow_symlinks=follow_symlinks,
            test_command=test_command,
            environment=environment,
            wheelhouse=wheelhouse,
            docker_image=docker_image,
            model=model,
            budgets=budgets,
        )
    )


app = command_group("datagen", "Make repository tasks (deleted bodies, injected bugs).")
app.command("datagen")(datagen_command)
