"""``composer-replication export prime-rl CONFIG.toml [-o OUT.toml]``: a run config as a
PRIME-RL ``rl`` TOML. Heavy imports happen inside the command."""

from __future__ import annotations

from pathlib import Path

import typer

from composer_replication.common.errors import command_group

export_app = command_group("export", "Write a run config in another engine's format.")


@export_app.command("prime-rl")
def export_prime_rl(
    config: Path = typer.Argument(..., help="Our run config (TOML)."),
    output: Path | None = typer.Option(
        None, "--output", "-o", help="Where to write the PRIME-RL TOML (default: stdout)."
    ),
    seq_len: int = typer.Option(
        2048, "--seq-len", help="PRIME-RL seq_len: prompt + completion tokens per sample."
    ),
    drop_unsupported: bool = typer.Option(
        False,
        "--drop-unsupported",
        help="Export composer as its Dr.GRPO channel (grpo), dropping its jsd and "
        "trace-replay DPO channels (named in a TOML comment and on stderr).",
    ),
    follow_symlinks: bool = typer.Option(
        False, "--follow-symlinks", help="Write through an output that is a symbolic link."
    ),
) -> None:
    """Write CONFIG as a PRIME-RL rl config; fails naming every algorithm it cannot map."""
    from composer_replication.common.atomic_io import write_text_atomic
    from composer_replication.common.errors import EXIT_USAGE, user_error
    from composer_replication.common.outputs import check_output
    from composer_replication.config import RunConfig
    from composer_replication.recipes.prime_rl.export import export_run_config

    try:
        if not config.is_file():
            raise FileNotFoundError(f"config file {str(config)!r} does not exist; pass a run TOML")
        if output is not None:  # refused before the work (the project's output policy)
            output = check_output(output, inputs=[config], follow_symlinks=follow_symlinks)
        result = export_run_config(
            RunConfig.from_toml(config), seq_len=seq_len, drop_unsupported=drop_unsupported
        )
    except (ValueError, OSError) as exc:
        from pydantic import ValidationError

        # one line per environment PRIME-RL cannot express; any other error is one line
        multi = "\n" in str(exc) and not isinstance(exc, (ValidationError, OSError))
        message = str(exc) if multi else user_error(exc)
        typer.echo(f"error: {message}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    for warning in result.warnings:
        typer.echo(f"warning: {warning}", err=True)
    if output is None:
        _to_stdout(result.toml)
    else:
        write_text_atomic(output, result.toml)
        typer.echo(f"wrote {output}", err=True)


def _to_stdout(text: str) -> None:
    """``text`` on stdout, or one line saying why it could not be (closed, full): never
    exit 0 having written nothing."""
    import os
    import sys

    from composer_replication.common.errors import EXIT_NO_RESULT, EXIT_USAGE

    if sys.stdout is None or sys.stdout.closed:
        typer.echo("error: stdout is closed; pass -o FILE to write the export", err=True)
        raise typer.Exit(EXIT_USAGE)
    try:
        sys.stdout.write(text)
        sys.stdout.flush()
    except (OSError, ValueError) as err:
        reason = err.strerror if isinstance(err, OSError) and err.strerror else str(err)
        typer.echo(f"error: cannot write the export to stdout ({reason}); pass -o FILE", err=True)
        with open(os.devnull, "w") as sink:  # what is left in the buffer goes nowhere at exit
            os.dup2(sink.fileno(), sys.stdout.fileno())
        raise typer.Exit(EXIT_NO_RESULT) from None
