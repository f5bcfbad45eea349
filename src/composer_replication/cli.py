"""The ``composer-replication`` command line.

Thin: every command parses its options and calls one library function. Heavy imports
(torch, transformers) happen inside the commands so ``--help`` answers at once.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import typer
from typer.core import TyperGroup

from composer_replication.common.errors import command_group, user_error


class _OneLineErrors(TyperGroup):
    """Every command's usage errors (parsed options and ``typer.BadParameter``) are one
    line on stderr, ``Error: ...``, with the click exit code (2): no usage box."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        import importlib
        import sys

        # the click typer uses (its own copy in recent releases, else click itself)
        exceptions = importlib.import_module(typer.BadParameter.__module__)
        no_args = getattr(exceptions, "NoArgsIsHelpError", ())
        aborts = (typer.Abort, getattr(exceptions, "Abort", typer.Abort))
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
            code = rv if isinstance(rv, int) and not isinstance(rv, bool) else 0
        except exceptions.ClickException as exc:
            if isinstance(exc, no_args):
                exc.show()  # the help text, as asked for
            else:
                message = " ".join(exc.format_message().split())
                typer.echo(f"Error: {message} (--help lists the options)", err=True)
            code = exc.exit_code
        except aborts:
            typer.echo("Error: aborted", err=True)
            code = 130
        if standalone_mode:
            sys.exit(code)
        return code


app = command_group(
    "composer-replication", "Post-train coding agents with the Composer recipe.", cls=_OneLineErrors
)


def _require_supported_transformers() -> None:
    """Exit with the usage code and one line unless the installed transformers release is
    one this package supports (a model would load, then fail later in a less clear way)."""
    from composer_replication.common.compat import (
        check_transformers_version,
        installed_transformers,
    )
    from composer_replication.training.lifecycle import EXIT_USAGE

    try:
        check_transformers_version(installed_transformers())
    except ValueError as exc:
        typer.echo(f"Error: {user_error(exc)}", err=True)
        raise typer.Exit(code=EXIT_USAGE) from None


def _run_config(
    config: Path | None, overrides: list[str], output_dir: str | None, backend: str, resume: bool
) -> Any:
    from composer_replication.config import RunConfig

    if backend not in ("native", "trl"):
        raise ValueError(f"unknown backend {backend!r}; use --backend native or --backend trl")
    if backend == "trl" and resume:
        raise ValueError("--resume needs --backend native (the trl backend keeps no checkpoints)")
    overrides = overrides + ([f"output_dir={output_dir}"] if output_dir else [])
    return RunConfig.from_toml(config, overrides) if config else RunConfig.default(overrides)


def _run_precision(model: Any) -> str:
    """The run's precision line: the ``[model]`` section's dtype as this device resolves it
    (several CPU ranks stay float32)."""
    from composer_replication.model.devices import (
        Precision,
        precision_line,
        resolve_device,
        resolve_precision,
    )

    device = resolve_device(model.device)
    precision = resolve_precision(model.dtype, device)
    if device.type == "cpu" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        precision = Precision(precision.param_dtype)
    return precision_line(precision, device)


def _print_components(title: str, rows: list[tuple[str, dict[str, float]]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col in ("", "lm_ce", "sdpo_jsd", "trace_replay_dpo", "total"):
        table.add_column(col, justify="right")
    for label, values in rows:
        table.add_row(
            label, *(f"{values[k]:.5f}" for k in ("lm_ce", "sdpo_jsd", "trace_replay_dpo", "total"))
        )
    Console().print(table)


@app.command()
def smoke(
    model: str | None = typer.Option(
        None, help="Policy: 'embedded' (default), a local HF directory, or a .gguf file."
    ),
    steps: int = typer.Option(1, min=1, help="AdamW steps to take."),
    lr: float = typer.Option(1e-5, help="Learning rate."),
    seed: int = typer.Option(0, help="Random seed."),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks of errors."),
) -> None:
    """Loss/model smoke: compose_loss on build_batch, AdamW steps, print the components."""
    import math

    _require_supported_transformers()
    from rich.console import Console

    from composer_replication.common.errors import UsageError
    from composer_replication.preflight import check_cache_dir, check_model_source
    from composer_replication.smoke import run_smoke

    with _one_line_errors(debug):
        if model is not None:
            check_model_source(model, "--model")
        if model in (None, "embedded"):
            check_cache_dir()  # where the embedded model is converted once
        if not (math.isfinite(lr) and lr > 0):
            raise UsageError(f"--lr {lr}: give a finite learning rate > 0, e.g. 1e-5")
    console = Console()
    console.print(f"[bold]smoke[/bold]: loading {model or 'embedded SmolLM2-135M-Instruct'}")
    with _one_line_errors(debug):
        report = run_smoke(
            model,
            steps=steps,
            lr=lr,
            seed=seed,
            on_step=lambda i, v: console.print(f"  step {i}: total {v['total']:.5f}"),
        )
    rows = [("before" if i == 0 else f"after step {i}", v) for i, v in enumerate(report.steps)]
    _print_components(f"{report.model_source} ({report.n_parameters:,} parameters)", rows)
    per_step = sum(report.step_seconds) / len(report.step_seconds)
    console.print(f"load {report.load_seconds:.1f} s, {per_step:.2f} s per step")


@app.command()
def train(
    config: Path | None = typer.Argument(
        None,
        help="Run config TOML (default: the embedded job: SmolLM2 + python_functions + composer).",
    ),
    set_: list[str] = typer.Option(
        [], "--set", help="Override a config field, e.g. --set steps=4 --set optim.lr=1e-4."
    ),
    resume: bool = typer.Option(
        False, "--resume", help="Continue from the latest checkpoint (an error when there is none)."
    ),
    resume_or_start: bool = typer.Option(
        False,
        "--resume-or-start",
        help="Continue from the latest checkpoint, or start a new run when there is none.",
    ),
    output_dir: str | None = typer.Option(
        None, help="Where the run writes (overrides output_dir)."
    ),
    backend: str = typer.Option(
        "native", help="Training backend: native (this framework's loop) or trl (GRPOTrainer)."
    ),
    placement: str | None = typer.Option(
        None,
        "--placement",
        help="Where the native loop's roles run: in_process (default) or monarch (actors on "
        "Monarch processes, sized by the config's roles table); unset: the config's roles table.",
    ),
    engine: str | None = typer.Option(
        None, "--engine", help="Old spelling of --placement.", hidden=True
    ),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks of errors."),
    nproc: int = typer.Option(
        1,
        "--nproc",
        min=1,
        help="Data-parallel training ranks on this machine (FSDP2): runs `torchrun "
        "--nproc-per-node N -m composer_replication train ...` with these arguments.",
    ),
) -> None:
    """Train a policy. With no config: the embedded default job (a few minutes on a CPU)."""
    _require_supported_transformers()
    from rich.console import Console

    if nproc > 1:
        import sys

        from composer_replication.distributed.launch import launch_torchrun

        try:  # what every rank would refuse, said once, before any rank starts
            ranked = _run_config(config, list(set_), output_dir, backend, resume)
            ranked.inference.resolved_async_level("cuda", distributed=True)
        except Exception as exc:
            if debug:
                raise
            typer.echo(f"Error: {user_error(exc)} (--debug shows the traceback)", err=True)
            raise typer.Exit(code=2) from None
        raise typer.Exit(code=launch_torchrun(nproc, _without_nproc(sys.argv[1:])))

    from composer_replication.training.lifecycle import EXIT_KILL_SWITCH, EXIT_USAGE

    # under torchrun / accelerate launch only rank 0 speaks (every rank runs this command)
    speaks = os.environ.get("RANK", "0") == "0"
    console = Console(quiet=not speaks)
    try:
        if resume and resume_or_start:
            raise ValueError("--resume and --resume-or-start exclude each other; pass one")
        cfg = _run_config(config, list(set_), output_dir, backend, resume or resume_or_start)
        if engine is not None and placement is not None and engine != placement:
            raise ValueError(f"--engine {engine} contradicts --placement {placement}; keep one")
        placement = placement or engine
        if placement is not None and placement != cfg.roles.placement:
            from composer_replication.config.roles import roles_config

            cfg = cfg.model_copy(update={"roles": roles_config(placement)})
        if cfg.roles.placement != "in_process" and backend != "native":
            raise ValueError(
                f"placement {cfg.roles.placement} runs the native loop; drop --backend trl"
            )
        from composer_replication.preflight import check_resume, check_run, cpu_notice

        check_run(cfg)
        notice = cpu_notice(cfg)
        if notice is not None:
            console.print(notice, soft_wrap=True, highlight=False, markup=False)
        if resume or resume_or_start:
            resume = check_resume(cfg, or_start=resume_or_start)
    except Exception as exc:  # a bad config or path: one line that says what to fix
        if debug:
            raise
        typer.echo(f"Error: {user_error(exc)} (--debug shows the traceback)", err=True)
        raise typer.Exit(code=EXIT_USAGE) from None
    from composer_replication.safety import CollapseStopError
    from composer_replication.training.loop import train as run_training
    from composer_replication.training.setup import quiet_library_progress_bars

    quiet_library_progress_bars()  # in a log file, one plain line per step instead
    console.print(
        f"[bold]train[/bold] ({backend} backend"
        f"{', roles on monarch' if cfg.roles.placement == 'monarch' else ''}): {cfg.model.source} on "
        f"{', '.join(f'{e.name} ({e.algorithm.type})' for e in cfg.envs)}, "
        f"{cfg.steps} steps -> {cfg.output_dir}"
    )
    if backend == "native":
        console.print(_run_precision(cfg.model), highlight=False, markup=False)
    from composer_replication.common.errors import EXIT_INTERRUPTED, UsageError

    try:
        if backend == "trl":
            from composer_replication.backends.trl.run import train_with_trl

            result = train_with_trl(cfg, console=console)
        elif cfg.roles.placement == "monarch":
            from composer_replication.recipes.monarch.engine import train as train_on_monarch

            result = train_on_monarch(cfg, resume=resume, console=console)
        else:
            result = run_training(cfg, resume=resume, console=console)
    except CollapseStopError as stop:
        console.print(f"[bold red]stopped by the kill switch[/bold red]: {stop}")
        console.print(f"final checkpoint and metrics in {cfg.output_dir}")
        raise typer.Exit(code=EXIT_KILL_SWITCH) from stop
    except UsageError as exc:  # found once the run had started (a checkpoint, a task bank)
        if debug:
            raise
        if speaks:
            typer.echo(f"Error: {user_error(exc)} (--debug shows the traceback)", err=True)
        raise typer.Exit(code=EXIT_USAGE) from None
    except KeyboardInterrupt:
        if speaks:
            typer.echo(_interrupted_line(cfg, backend, config, list(set_)), err=True)
        raise typer.Exit(code=EXIT_INTERRUPTED) from None
    before = "n/a" if result.heldout_before is None else f"{result.heldout_before:.3f}"
    after = "n/a" if result.heldout_after is None else f"{result.heldout_after:.3f}"
    ev = cfg.eval
    how = (
        "greedy"
        if ev.temperature == 0
        else f"{ev.samples_per_task} samples/task at T={ev.temperature:g}, seed {ev.seed}"
    )
    console.print(f"held-out pass@1 ({how}): before {before} -> after {after}")
    for line in _heldout_score_lines(result.metrics):
        console.print(line)
    console.print(f"final model: {result.final_model_dir}  report: {result.run_dir / 'report'}")


def _interrupted_line(cfg: Any, backend: str, config: Path | None, overrides: list[str]) -> str:
    """Where an interrupted run's last checkpoint is and the command that continues it."""
    import shlex

    from composer_replication.training.checkpoint import CheckpointManager

    if backend == "trl":
        return f"Interrupted: the trl backend keeps no checkpoints; {cfg.output_dir} is partial"
    latest = CheckpointManager(cfg.output_dir).latest()
    if latest is None:
        return f"Interrupted before the first checkpoint: nothing to resume in {cfg.output_dir}"
    argv = ["composer-replication", "train", *([str(config)] if config else [])]
    argv += [a for o in overrides for a in ("--set", o) if not o.startswith("output_dir=")]
    argv += ["--output-dir", str(cfg.output_dir), "--resume"]
    return f"Interrupted: the last checkpoint is {latest}; continue with: {shlex.join(argv)}"


SUITES = ("heldout", "humaneval")


@contextlib.contextmanager
def _progress_bar() -> Iterator[Callable[[str, int, int], None]]:
    """A ``progress(phase, done, total)`` callback: one bar per phase on a terminal's
    stderr; elsewhere (a log file) one plain line when a phase ends."""
    import time

    from rich.console import Console
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TimeElapsedColumn

    console = Console(stderr=True)
    columns = ("{task.description}", BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
    with Progress(*columns, console=console, disable=not console.is_terminal) as bar:
        phases: dict[str, Any] = {}
        started: dict[str, float] = {}

        def report(phase: str, done: int, total: int) -> None:
            if phase not in phases:
                phases[phase] = bar.add_task(phase, total=total)
                started[phase] = time.perf_counter()
            bar.update(phases[phase], completed=done)
            if done >= total and not console.is_terminal:
                seconds = time.perf_counter() - started[phase]
                typer.echo(f"{phase}: {done}/{total} in {seconds:.0f} s", err=True)

        yield report


def _print_scores(title: str, rows: list[tuple[str, float | None, str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title)
    for col, justify in (("score", "left"), ("value", "right"), ("how", "left")):
        table.add_column(col, justify=justify)  # type: ignore[arg-type]
    for label, value, how in rows:
        table.add_row(label, "n/a" if value is None else f"{value:.3f}", how)
    Console().print(table)


def _heldout_score_lines(rows: list[dict[str, Any]]) -> list[str]:
    """Before/after lines for the evaluation scores beside pass@1 (greedy pass@1, pass@k)."""
    keys = [
        k
        for k in dict.fromkeys(k for r in rows for k in r)
        if k == "heldout/greedy_pass@1" or (k.startswith("heldout/pass@") and k != "heldout/pass@1")
    ]
    lines = []
    for key in keys:
        before = next((r[key] for r in rows if r.get("step") == 0 and key in r), None)
        after = next((r[key] for r in reversed(rows) if r.get(key) is not None), None)
        shown = ["n/a" if v is None else f"{v:.3f}" for v in (before, after)]
        lines.append(
            f"held-out {key.removeprefix('heldout/')}: before {shown[0]} -> after {shown[1]}"
        )
    return lines


@app.command("eval")
def evaluate(
    model: str = typer.Argument(
        ..., help="A model directory (e.g. a run's final_model), a .gguf file, or 'embedded'."
    ),
    suite: str = typer.Option(
        "heldout",
        help="heldout: an environment's held-out tasks; humaneval: OpenAI's HumanEval (164).",
    ),
    env: str = typer.Option(
        "python_functions", "--env", help="Environment to evaluate on (--suite heldout)."
    ),
    samples: int | None = typer.Option(
        None,
        min=1,
        help="Samples per task for sampled pass@1 / pass@k (heldout: default 4; humaneval: "
        "default none, greedy only).",
    ),
    temperature: float = typer.Option(1.0, min=0.0, help="Sampling temperature (0 = greedy)."),
    greedy: bool = typer.Option(
        True, "--greedy/--no-greedy", help="Also report greedy (temperature 0) pass@1."
    ),
    max_new_tokens: int | None = typer.Option(
        None,
        min=1,
        help="Completion budget (default: heldout 80, a turn of feature_deletion 256, "
        "humaneval 512).",
    ),
    task_file: Path | None = typer.Option(
        None, "--task-file", help="--env feature_deletion: the task file datagen wrote."
    ),
    repo: str | None = typer.Option(
        None,
        "--repo",
        help="--env feature_deletion: a repository (folder, or 'smallkit') whose tasks are "
        "made on first use and kept.",
    ),
    rollouts: Path | None = typer.Option(
        None, "--rollouts", help="Write every evaluated rollout here as JSONL (atomically)."
    ),
    config: Path | None = typer.Option(
        None,
        "--config",
        help="A run config: evaluate on its environment as the run trained (the first entry "
        "the policy samples: its options and turn budget, the run's held-out split).",
    ),
    seed: int = typer.Option(0, help="Seed of the evaluation sampling."),
    limit: int | None = typer.Option(None, min=1, help="Only the first N tasks / problems."),
    timeout: float = typer.Option(
        10.0, min=0.1, help="Seconds per HumanEval program in the sandbox (--suite humaneval)."
    ),
    heldout_fraction: float = typer.Option(0.25, help="Held-out share (must match training)."),
    split: str = typer.Option("heldout", help="Which tasks: heldout, train or all."),
    output: Path | None = typer.Option(
        None, "-o", "--output", help="Write the result as JSON here (atomically)."
    ),
    follow_symlinks: bool = typer.Option(
        False, "--follow-symlinks", help="Write through an output that is a symbolic link."
    ),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks of errors."),
) -> None:
    """Score a model: held-out pass@1 / pass@k on an environment, or HumanEval.

    Prints greedy pass@1, sampled pass@1 and pass@k (unbiased estimator, arXiv
    2107.03374) as a table; -o writes the whole result, per task, as JSON.
    """
    import json
    import math

    from composer_replication.common.atomic_io import write_text_atomic
    from composer_replication.common.errors import UsageError
    from composer_replication.common.outputs import check_output
    from composer_replication.config.environments import (
        ENVIRONMENTS,
        builtin_environment,
        eval_max_new_tokens,
    )
    from composer_replication.preflight import check_env_name, check_model_source

    if suite not in SUITES:
        raise typer.BadParameter(f"{suite!r}; use {' or '.join(SUITES)}", param_hint="--suite")
    _require_supported_transformers()
    if suite == "humaneval" and (env, split) != ("python_functions", "heldout"):
        raise typer.BadParameter(
            "--env and --split choose held-out tasks; with --suite humaneval leave them out",
            param_hint="--suite",
        )
    with _one_line_errors(debug):  # everything checked before the model loads
        check_model_source(model, "MODEL")
        if config is not None:
            if suite != "heldout" or env != "python_functions" or task_file or repo:
                raise UsageError(
                    "--config takes the environment from the run config; leave out --suite, "
                    "--env, --task-file and --repo"
                )
            env, config_options, config_tokens, heldout_fraction, config_salt = _config_entry(
                config
            )
            max_new_tokens = max_new_tokens or config_tokens
        if not math.isfinite(temperature):
            raise UsageError(f"--temperature {temperature}: give a finite number >= 0")
        if not math.isfinite(timeout):
            raise UsageError(f"--timeout {timeout}: give a finite number of seconds")
        if suite == "heldout":
            check_env_name(env, "--env")
            builtin = builtin_environment(env)
            takes_tasks = builtin is not None and builtin.repository_tasks
            if takes_tasks and config is None and (task_file is None) == (repo is None):
                raise UsageError(
                    f"--env {env} needs its tasks: pass --task-file (what datagen "
                    "wrote) or --repo (a repository folder, or 'smallkit'), one of them"
                )
            if not takes_tasks and (task_file is not None or repo is not None):
                with_tasks = [n for n, e in ENVIRONMENTS.items() if e.repository_tasks]
                raise UsageError(
                    f"--task-file and --repo choose {' or '.join(with_tasks)} tasks; add "
                    f"--env {with_tasks[0]}"
                )
            if repo is not None:
                from composer_replication.datagen.repository_tasks import repository_path

                try:
                    repository_path(repo)
                except ValueError as exc:
                    raise UsageError(f"--repo: {exc}") from None
            if task_file is not None and not task_file.is_file():
                raise UsageError(
                    f"--task-file {str(task_file)!r} does not exist; pass the file datagen wrote"
                )
            if split not in ("heldout", "train", "all"):
                raise UsageError(f"--split {split!r}: use heldout, train or all")
            if not 0 < heldout_fraction < 1:
                raise UsageError(
                    f"--heldout-fraction {heldout_fraction}: give a number between 0 and 1 "
                    "(the training run's heldout_fraction, default 0.25)"
                )
        source = Path(model).expanduser()  # a model directory is read whole
        for name, path in (("output", output), ("rollouts", rollouts)):
            if path is not None:  # a refused -o must not cost the evaluation
                checked = check_output(
                    path,
                    inputs=([] if source.is_dir() else [source])
                    + ([task_file] if task_file is not None else []),
                    input_dirs=[source] if source.is_dir() else [],
                    follow_symlinks=follow_symlinks,
                )
                output, rollouts = (checked, rollouts) if name == "output" else (output, checked)
    from composer_replication.training.setup import quiet_library_progress_bars

    quiet_library_progress_bars()  # in a log file, the weight-loading bar is noise
    with _one_line_errors(debug):
        if suite == "humaneval":
            result = _eval_humaneval(
                model, samples, temperature, greedy, max_new_tokens, seed, limit, timeout
            )
        else:
            options: dict[str, Any] = dict(config_options) if config is not None else {}
            if task_file is not None:
                options["task_file"] = str(task_file)
            if repo is not None:
                options["repo"] = repo
            result = _eval_heldout(
                model,
                env,
                samples or 4,
                temperature,
                greedy,
                max_new_tokens or eval_max_new_tokens(env),
                seed,
                limit,
                heldout_fraction,
                split,
                options,
                rollouts,
                config_salt if config is not None else None,
            )
    if output:
        write_text_atomic(output, json.dumps(result, indent=2) + "\n")
        typer.echo(f"written: {output}")


@contextlib.contextmanager
def _one_line_errors(debug: bool) -> Iterator[None]:
    """A :class:`~composer_replication.common.errors.UsageError` (or a refused output) becomes one
    line and exit code 2; ``--debug`` keeps the traceback."""
    from composer_replication.common.errors import EXIT_USAGE, UsageError

    try:
        yield
    except UsageError as exc:
        if debug:
            raise
        typer.echo(f"Error: {user_error(exc)} (--debug shows the traceback)", err=True)
        raise typer.Exit(code=EXIT_USAGE) from None


def _eval_heldout(
    model: str,
    env: str,
    samples: int,
    temperature: float,
    greedy: bool,
    max_new_tokens: int,
    seed: int,
    limit: int | None,
    heldout_fraction: float,
    split: str,
    options: dict[str, Any],
    rollouts: Path | None,
    heldout_salt: str | None = None,
) -> dict[str, Any]:
    from composer_replication.evals.heldout import evaluate_model

    salt = {} if heldout_salt is None else {"heldout_salt": heldout_salt}
    result = evaluate_model(
        model,
        **salt,
        env_name=env,
        samples_per_task=samples,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        heldout_fraction=heldout_fraction,
        split=split,
        env_options=options,
        seed=seed,
        greedy=greedy,
        limit=limit,
        rollouts_path=rollouts,
        say=lambda line: typer.echo(line, err=True),
    )
    typer.echo(
        f"{env} {split}: pass@1 {result['pass@1']:.3f} over {result['n_tasks']} tasks "
        f"x {samples} samples (mean reward {result['mean_reward']:.3f})"
    )
    sampled = f"{samples} samples/task, T={temperature:g}, seed {seed}"
    rows: list[tuple[str, float | None, str]] = []
    if greedy:
        rows.append(("greedy pass@1", result["greedy_pass@1"], "1 answer/task, T=0"))
    rows.append(("pass@1", result["pass@1"], sampled))
    rows += [
        (key, result[key], sampled) for key in result if key.startswith("pass@") and key != "pass@1"
    ]
    rows.append(("mean reward", result["mean_reward"], sampled))
    agent = result.get("agent", {})
    if agent:
        rows += [
            ("turns per episode", agent["agent/turns_mean"], sampled),
            ("tool calls per episode", agent["agent/tool_calls_mean"], sampled),
            ("parse failure rate", agent["agent/parse_failure_rate"], sampled),
        ]
        ends = ", ".join(
            f"{k.removeprefix('agent/end/')} {v:.2f}"
            for k, v in agent.items()
            if k.startswith("agent/end/") and v
        )
        rows.append(("episodes ended by", None, ends))
    _print_scores(f"{env} {split} ({result['n_tasks']} tasks): {model}", rows)
    if rollouts is not None:
        typer.echo(f"rollouts: {rollouts}")
    return result


def _config_entry(path: Path) -> tuple[str, dict[str, Any], int, float, str]:
    """(environment, options, turn budget, held-out fraction, salt) of the run config's
    first entry that samples the policy (else its first entry)."""
    from composer_replication.common.errors import UsageError
    from composer_replication.config import RunConfig

    try:
        cfg = RunConfig.from_toml(path)
    except (OSError, ValueError) as exc:
        raise UsageError(f"--config {str(path)!r}: {user_error(exc)}") from None
    entry = next((e for e in cfg.envs if e.algorithm.sampling.source == "policy"), cfg.envs[0])
    return (
        entry.name,
        dict(entry.options),
        entry.algorithm.sampling.max_new_tokens,
        cfg.heldout_fraction,
        cfg.heldout_salt,
    )


def _eval_humaneval(
    model: str,
    samples: int | None,
    temperature: float,
    greedy: bool,
    max_new_tokens: int | None,
    seed: int,
    limit: int | None,
    timeout: float,
) -> dict[str, Any]:
    from composer_replication.evals.humaneval import DEFAULT_MAX_NEW_TOKENS, evaluate_humaneval

    if samples is not None and temperature == 0:
        raise typer.BadParameter(
            f"--samples {samples} with --temperature 0: sampled pass@k needs a temperature "
            "> 0 (greedy pass@1 is always reported; drop --samples for greedy only)",
            param_hint="--temperature",
        )
    if not greedy and samples is None:
        raise typer.BadParameter(
            "--no-greedy without --samples leaves nothing to evaluate; add --samples N",
            param_hint="--no-greedy",
        )
    with _progress_bar() as progress:
        result = evaluate_humaneval(
            model,
            greedy=greedy,
            samples=samples or 0,
            temperature=temperature,
            max_new_tokens=max_new_tokens or DEFAULT_MAX_NEW_TOKENS,
            seed=seed,
            limit=limit,
            timeout_s=timeout,
            progress=progress,
        )
    rows: list[tuple[str, float | None, str]] = []
    broken = 0
    if result["greedy"] is not None:
        g = result["greedy"]
        rows.append(("greedy pass@1", g["pass@1"], f"{g['passed']}/{g['attempts']} passed, T=0"))
        broken += g["infrastructure_count"]
    if result["sampled"] is not None:
        s = result["sampled"]
        how = f"{s['samples_per_problem']} samples/problem, T={s['temperature']:g}, seed {seed}"
        rows += [(f"pass@{k}", s[f"pass@{k}"], how) for k in s["ks"]]
        broken += s["infrastructure_count"]
    _print_scores(f"HumanEval ({result['n_problems']} problems): {model}", rows)
    if broken:
        typer.echo(
            f"warning: {broken} attempt(s) never ran (sandbox infrastructure errors) and are "
            "left out of the scores",
            err=True,
        )
    return result


@app.command()
def version() -> None:
    """Print the package version."""
    from composer_replication import __version__

    typer.echo(__version__)


def _register_subcommands() -> None:
    from composer_replication.datagen.cli import datagen_command, import_tasks_command
    from composer_replication.diloco.cli import diloco_app
    from composer_replication.recipes.prime_rl.cli import export_app
    from composer_replication.traces import cli as trace_cli

    app.command("datagen")(datagen_command)
    app.command("import-tasks")(import_tasks_command)
    trace_cli.register(app)
    app.add_typer(diloco_app, name="diloco")
    app.add_typer(export_app, name="export")


_register_subcommands()


def _without_nproc(argv: list[str]) -> list[str]:
    """The command line with its ``--nproc N`` / ``--nproc=N`` removed."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def main(argv: list[str] | None = None) -> int:
    """Console-script entry point: run the command line ``argv`` (default: the process's)
    and return its exit code (``composer_replication.common.errors`` lists them)."""
    from typer.main import get_command

    from composer_replication.model.cpu_threads import limit_thread_spinning

    limit_thread_spinning()  # before torch loads: idle CPU threads sleep soon
    return int(get_command(app).main(args=argv, standalone_mode=False) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
