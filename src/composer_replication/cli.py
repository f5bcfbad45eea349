"""The ``composer-replication`` command line.

Thin: every command parses its options and calls one library function. Heavy imports
(torch, transformers) happen inside the commands so ``--help`` answers at once.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

app = typer.Typer(
    name="composer-replication",
    help="Post-train coding agents with the Composer recipe.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def user_error(exc: BaseException) -> str:
    """One line for a user's mistake: a config value and what is valid, a missing file."""
    from pydantic import ValidationError

    if isinstance(exc, ValidationError):
        parts = []
        for err in exc.errors()[:3]:
            where = ".".join(str(p) for p in err.get("loc", ()))
            message = str(err.get("msg", "")).removeprefix("Value error, ")
            value = err.get("input")
            shown = "" if isinstance(value, dict) else f" (got {value!r})"
            parts.append(f"{where}: {message}{shown}" if where else message)
        more = len(exc.errors()) - 3
        return "; ".join(parts) + (f"; and {more} more" if more > 0 else "")
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text


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


def _check_model_source(source: str) -> None:
    """A model path that does not exist fails before anything is loaded or created."""
    if source == "embedded" or ("/" not in source and not source.endswith(".gguf")):
        return  # the embedded model, or a cached hub id resolved by the loader
    if not Path(source).expanduser().exists():
        raise FileNotFoundError(
            f"model.source {source!r} does not exist; give a Hugging Face model directory, "
            "a .gguf file, or 'embedded'"
        )


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
) -> None:
    """Loss/model smoke: compose_loss on build_batch, AdamW steps, print the components."""
    from rich.console import Console

    from composer_replication.smoke import run_smoke

    console = Console()
    console.print(f"[bold]smoke[/bold]: loading {model or 'embedded SmolLM2-135M-Instruct'}")
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
    resume: bool = typer.Option(False, "--resume", help="Continue from the latest checkpoint."),
    output_dir: str | None = typer.Option(
        None, help="Where the run writes (overrides output_dir)."
    ),
    backend: str = typer.Option(
        "native", help="Training backend: native (this framework's loop) or trl (GRPOTrainer)."
    ),
    debug: bool = typer.Option(False, "--debug", help="Show full tracebacks of errors."),
) -> None:
    """Train a policy. With no config: the embedded default job (a few minutes on a CPU)."""
    from rich.console import Console

    from composer_replication.trainer.lifecycle import EXIT_KILL_SWITCH, EXIT_USAGE

    console = Console()
    try:
        cfg = _run_config(config, list(set_), output_dir, backend, resume)
        _check_model_source(cfg.model.source)
    except Exception as exc:  # a bad config or path: one line that says what to fix
        if debug:
            raise
        typer.echo(f"Error: {user_error(exc)} (--debug shows the traceback)", err=True)
        raise typer.Exit(code=EXIT_USAGE) from None
    from composer_replication.safety import CollapseStopError
    from composer_replication.trainer.loop import train as run_training
    from composer_replication.trainer.setup import quiet_library_progress_bars

    quiet_library_progress_bars()  # in a log file, one plain line per step instead
    console.print(
        f"[bold]train[/bold] ({backend} backend): {cfg.model.source} on "
        f"{', '.join(f'{e.name} ({e.algorithm.type})' for e in cfg.envs)}, "
        f"{cfg.steps} steps -> {cfg.output_dir}"
    )
    try:
        if backend == "trl":
            from composer_replication.trainer.trl_backend import train_with_trl

            result = train_with_trl(cfg, console=console)
        else:
            result = run_training(cfg, resume=resume, console=console)
    except CollapseStopError as stop:
        console.print(f"[bold red]stopped by the kill switch[/bold red]: {stop}")
        console.print(f"final checkpoint and metrics in {cfg.output_dir}")
        raise typer.Exit(code=EXIT_KILL_SWITCH) from stop
    before = "n/a" if result.heldout_before is None else f"{result.heldout_before:.3f}"
    after = "n/a" if result.heldout_after is None else f"{result.heldout_after:.3f}"
    ev = cfg.eval
    how = (
        "greedy"
        if ev.temperature == 0
        else f"{ev.samples_per_task} samples/task at T={ev.temperature:g}, seed {ev.seed}"
    )
    console.print(f"held-out pass@1 ({how}): before {before} -> after {after}")
    console.print(f"final model: {result.final_model_dir}  report: {result.run_dir / 'report'}")


@app.command("eval")
def evaluate(
    model: str = typer.Argument(
        ..., help="A model directory (e.g. a run's final_model), a .gguf file, or 'embedded'."
    ),
    env: str = typer.Option("python_functions", "--env", help="Environment to evaluate on."),
    samples: int = typer.Option(4, min=1, help="Samples per task (pass@1 averages them)."),
    temperature: float = typer.Option(1.0, min=0.0, help="Sampling temperature (0 = greedy)."),
    max_new_tokens: int = typer.Option(80, min=1, help="Completion budget."),
    seed: int = typer.Option(0, help="Seed of the evaluation sampling."),
    heldout_fraction: float = typer.Option(0.25, help="Held-out share (must match training)."),
    split: str = typer.Option("heldout", help="Which tasks: heldout, train or all."),
    output: Path | None = typer.Option(
        None, "-o", "--output", help="Write the result as JSON here."
    ),
) -> None:
    """Held-out pass@1 of a model on an environment, printed and written as JSON."""
    import json

    from composer_replication.evaluate import evaluate_model

    result = evaluate_model(
        model,
        env_name=env,
        samples_per_task=samples,
        temperature=temperature,
        max_new_tokens=max_new_tokens,
        heldout_fraction=heldout_fraction,
        split=split,
        seed=seed,
    )
    typer.echo(
        f"{env} {split}: pass@1 {result['pass@1']:.3f} over {result['n_tasks']} tasks "
        f"x {samples} samples (mean reward {result['mean_reward']:.3f})"
    )
    if output:
        output.parent.mkdir(parents=True, exist_ok=True)
        output.write_text(json.dumps(result, indent=2))


@app.command()
def version() -> None:
    """Print the package version."""
    from composer_replication import __version__

    typer.echo(__version__)


def _register_subcommands() -> None:
    from composer_replication.datagen.cli import datagen_command
    from composer_replication.diloco.cli import diloco_app
    from composer_replication.traces import cli as trace_cli

    app.command("datagen")(datagen_command)
    trace_cli.register(app)
    app.add_typer(diloco_app, name="diloco")


_register_subcommands()


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
