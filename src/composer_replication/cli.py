"""The ``composer-replication`` command line.

Thin: every command parses its options and calls one library function. Heavy imports
(torch, transformers) happen inside the commands so ``--help`` answers at once.
"""

from __future__ import annotations

from typing import Optional

import typer

app = typer.Typer(
    name="composer-replication",
    help="Post-train coding agents with the Composer recipe.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
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
    model: Optional[str] = typer.Option(  # noqa: UP045 - typer needs Optional on 3.10
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
    model: Optional[str] = typer.Option(  # noqa: UP045
        None, help="Policy: 'embedded' (default), a local HF directory, or a .gguf file."
    ),
    steps: int = typer.Option(1, min=1, help="Optimizer steps."),
    lr: float = typer.Option(1e-5, help="Learning rate."),
    seed: int = typer.Option(0, help="Random seed."),
) -> None:
    """Train on the embedded default. Currently: the loss/model smoke job (see `smoke`)."""
    smoke(model=model, steps=steps, lr=lr, seed=seed)


@app.command()
def version() -> None:
    """Print the package version."""
    from composer_replication import __version__

    typer.echo(__version__)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
