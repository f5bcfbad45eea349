"""``composer-replication diloco ...``: launch, watch and stop DiLoCo replica runs.

``launch`` uploads the run config next to the rendezvous, then starts ``--replicas``
trainers of it (:func:`composer_replication.training.replica.train_replica`: the run config
with DiLoCo switched on, trained through the library's ``train``) through the chosen
executor; the replicas meet through the
object-store rendezvous. Launched handles go to a
small state file (``<state-dir>/<run-id>.json``), so ``status``/``logs``/``cancel`` work
from any later shell. Library functions ``launch``/``status``/``logs``/``cancel`` do the
work; the typer commands in ``diloco_app`` only parse options.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import typer

from composer_replication.common.errors import command_group
from composer_replication.diloco.serverless.base import TERMINAL

EXECUTORS = ("local", "eks", "sagemaker", "modal", "hf_jobs")
DEFAULT_STATE_DIR = Path(".diloco")
#: What each launched replica runs (by import path: the executors start it in its own process).
TRAIN_REPLICA = "composer_replication.training.replica.train_replica"
# the options every command that reads a recorded run shares
_RUN_ID = typer.Argument(None, help="Run id (default: the latest).")
_STATE_DIR = typer.Option(DEFAULT_STATE_DIR, help="Where launched runs are recorded.")

diloco_app = command_group(
    "diloco", "Launch and manage DiLoCo replicas that meet through an object store."
)


def parse_options(items: list[str]) -> dict[str, Any]:
    """``["image=x", "volume_size_gb=200"]`` -> ``{"image": "x", "volume_size_gb": 200}``."""
    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"executor option {item!r} must look like key=value")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def build_executor(name: str, run_id: str, options: dict[str, Any], state_dir: Path) -> Any:
    """The executor ``name`` with ``options`` as its keyword arguments."""
    from composer_replication.diloco import serverless

    if name == "local":
        return serverless.LocalProcessExecutor(state_dir / run_id, **options)
    if name == "eks":
        return serverless.EKSExecutor(run_id=run_id, **options)
    if name == "sagemaker":
        return serverless.SageMakerExecutor(run_id=run_id, **options)
    if name == "modal":
        return serverless.ModalExecutor(**options)
    if name == "hf_jobs":
        return serverless.HFJobsExecutor(**options)
    raise ValueError(f"unknown executor {name!r}; choose one of {', '.join(EXECUTORS)}")


def _state_path(state_dir: Path, run_id: str | None) -> Path:
    if state_dir.exists() and not state_dir.is_dir():
        raise ValueError(f"--state-dir {str(state_dir)!r} is not a directory; pass the folder "
                         "`diloco launch` recorded its runs in")  # fmt: skip
    if run_id:
        path = state_dir / f"{run_id}.json"
        if not path.exists():
            raise FileNotFoundError(f"no DiLoCo run {run_id!r} in {state_dir} (see {path})")
        return path
    runs = sorted(state_dir.glob("*.json"), key=lambda p: p.stat().st_mtime)
    if not runs:
        raise FileNotFoundError(f"no DiLoCo runs recorded in {state_dir}; launch one first")
    return runs[-1]


def load_run(state_dir: Path, run_id: str | None = None) -> tuple[dict[str, Any], Any, list[Any]]:
    """``(state, executor, handles)`` of ``run_id`` (default: the latest launched)."""
    from composer_replication.diloco.serverless import ReplicaHandle

    path = _state_path(state_dir, run_id)
    try:
        state = json.loads(path.read_text(encoding="utf-8"))
        if not isinstance(state, dict):
            raise ValueError("it is not a JSON object")
        missing = [k for k in ("executor", "run_id", "options", "handles") if k not in state]
        if missing:
            raise ValueError(f"it lacks {', '.join(missing)}")
        handles = [ReplicaHandle.from_dict(h) for h in state["handles"]]
    except (UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(
            f"the DiLoCo run state {str(path)!r} is not one `diloco launch` wrote ({err}); "
            "its replicas cannot be found from it"
        ) from None
    executor = build_executor(state["executor"], state["run_id"], state["options"], state_dir)
    return state, executor, handles


def launch(
    config_path: str | Path,
    executor: str = "local",
    replicas: int = 2,
    *,
    rendezvous: str | None = None,
    overrides: list[str] | None = None,
    gpu: str | None = None,
    timeout: int = 3600,
    run_id: str | None = None,
    state_dir: Path = DEFAULT_STATE_DIR,
    options: dict[str, Any] | None = None,
    entrypoint: str = TRAIN_REPLICA,
    storage_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Start ``replicas`` trainers of ``config_path``; returns the recorded run state."""
    import fsspec

    if executor not in EXECUTORS:
        raise ValueError(f"unknown executor {executor!r}; choose one of {', '.join(EXECUTORS)}")
    config_path = Path(config_path)
    if not config_path.is_file():
        raise FileNotFoundError(f"config {config_path} does not exist")
    run_id = run_id or f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
    from composer_replication.common.outputs import check_output_dir

    state_dir = check_output_dir(Path(state_dir), option="--state-dir").resolve()
    if rendezvous is None:
        if executor != "local":
            raise ValueError(
                f"--rendezvous is required for executor {executor!r}: an s3://, gs://, hf:// "
                "URI every replica can reach"
            )
        rendezvous = (state_dir / run_id / "rendezvous").as_uri()
    rendezvous = rendezvous.rstrip("/")
    config_uri = f"{rendezvous}/launch/config.toml"
    with fsspec.open(config_uri, "w", auto_mkdir=True, **(storage_options or {})) as fh:
        fh.write(config_path.read_text())
    args = {
        "config_uri": config_uri,
        "rendezvous_uri": f"{rendezvous}/allreduce",
        "world_size": replicas,
        "overrides": list(overrides or []),
    }
    if storage_options:
        args["storage_options"] = storage_options
    runner = build_executor(executor, run_id, dict(options or {}), state_dir)
    handles = runner.launch_replicas(replicas, entrypoint, args, gpu=gpu, timeout=timeout)
    state = {
        "run_id": run_id,
        "executor": executor,
        "options": dict(options or {}),
        "rendezvous": rendezvous,
        "replicas": replicas,
        "created": time.time(),
        "handles": [h.to_dict() for h in handles],
    }
    state_dir.mkdir(parents=True, exist_ok=True)
    tmp = state_dir / f".{run_id}.json.tmp"
    tmp.write_text(json.dumps(state, indent=2))
    os.replace(tmp, state_dir / f"{run_id}.json")
    return state


def status(run_id: str | None = None, *, state_dir: Path = DEFAULT_STATE_DIR) -> list[dict]:
    """``[{"rank": r, "status": s}, ...]`` for the run (default: the latest)."""
    _, executor, handles = load_run(Path(state_dir), run_id)
    return [{"rank": h.rank, "status": executor.poll(h)} for h in handles]


def logs(
    run_id: str | None = None,
    *,
    rank: int | None = None,
    n_lines: int = 200,
    state_dir: Path = DEFAULT_STATE_DIR,
) -> dict[int, str]:
    """The last ``n_lines`` of each replica's log (or only ``rank``'s)."""
    _, executor, handles = load_run(Path(state_dir), run_id)
    chosen = [h for h in handles if rank is None or h.rank == rank]
    if not chosen:
        raise ValueError(f"rank {rank} is not in this run (ranks 0..{len(handles) - 1})")
    return {h.rank: executor.stream_logs(h, n_lines=n_lines) for h in chosen}


def cancel(run_id: str | None = None, *, state_dir: Path = DEFAULT_STATE_DIR) -> dict[int, str]:
    """Cancel every replica of the run that is still pending or running; returns each
    rank's status before (a replica that ended, or whose record is stale, is left alone)."""
    _, executor, handles = load_run(Path(state_dir), run_id)
    before = {h.rank: executor.poll(h) for h in handles}
    for handle in handles:
        if before[handle.rank] not in TERMINAL:
            executor.cancel(handle)
    return before


# ---------------------------------------------------------------------- typer commands


@diloco_app.command("launch")
def launch_command(
    config: Path = typer.Argument(..., help="Run config TOML every replica trains."),
    executor: str = typer.Option("local", help=f"Where replicas run: {', '.join(EXECUTORS)}."),
    replicas: int = typer.Option(2, min=1, help="How many replicas (the DiLoCo world size)."),
    rendezvous: str | None = typer.Option(
        None, help="Object-store URI the replicas meet at (default for local: under state-dir)."
    ),
    set_: list[str] = typer.Option([], "--set", help="Config override for every replica."),
    opt: list[str] = typer.Option(
        [], "--opt", help="Executor argument key=value, e.g. --opt image=... --opt role_arn=..."
    ),
    gpu: str | None = typer.Option(None, help="GPU per replica, e.g. A100, H100:8, A10G."),
    timeout: int = typer.Option(3600, min=1, help="Hard deadline per replica, seconds."),
    run_id: str | None = typer.Option(None, help="Run id (default: timestamp + random)."),
    state_dir: Path = _STATE_DIR,
    entrypoint: str = typer.Option(TRAIN_REPLICA, hidden=True, help="Replica function."),
) -> None:
    """Start N replicas of `train CONFIG` with DiLoCo on, meeting through the rendezvous."""
    with _one_line_errors():
        state = launch(
            config,
            executor,
            replicas,
            rendezvous=rendezvous,
            overrides=set_,
            gpu=gpu,
            timeout=timeout,
            run_id=run_id,
            state_dir=state_dir,
            options=parse_options(opt),
            entrypoint=entrypoint,
        )
    typer.echo(f"launched run {state['run_id']}: {replicas} replicas on {executor}")
    typer.echo(f"rendezvous: {state['rendezvous']}")


@contextlib.contextmanager
def _one_line_errors() -> Iterator[None]:
    """A run that is not recorded, or a backend's refusal, as a one-line usage error."""
    try:
        yield
    except (ValueError, FileNotFoundError, RuntimeError) as exc:
        raise typer.BadParameter(str(exc)) from exc


@diloco_app.command("status")
def status_command(
    run_id: str | None = _RUN_ID,
    state_dir: Path = _STATE_DIR,
) -> None:
    """Each replica's status: pending, running, succeeded, failed, cancelled or gone (its
    process is not there and its pid belongs to another process now)."""
    with _one_line_errors():
        rows = status(run_id, state_dir=state_dir)
    for row in rows:
        typer.echo(f"rank {row['rank']}: {row['status']}")


@diloco_app.command("logs")
def logs_command(
    run_id: str | None = _RUN_ID,
    rank: int | None = typer.Option(None, help="Only this replica."),
    lines: int = typer.Option(200, min=1, help="Lines per replica."),
    state_dir: Path = _STATE_DIR,
) -> None:
    """The tail of each replica's log."""
    with _one_line_errors():
        tails = logs(run_id, rank=rank, n_lines=lines, state_dir=state_dir)
    for r, text in tails.items():
        typer.echo(f"===== rank {r} =====\n{text}")


@diloco_app.command("cancel")
def cancel_command(
    run_id: str | None = _RUN_ID,
    state_dir: Path = _STATE_DIR,
) -> None:
    """Stop every replica of the run."""
    with _one_line_errors():
        before = cancel(run_id, state_dir=state_dir)
    live = [r for r, s in before.items() if s not in TERMINAL]
    line = f"cancelled {len(live)} replica{'s' if len(live) != 1 else ''}"
    left = [f"rank {r} {s}" for r, s in before.items() if s in TERMINAL]
    typer.echo(line + (f"; left alone: {', '.join(left)}" if left else ""))
