"""Checks the commands make before their work starts, so that a user's mistake is one line
(:class:`~composer_replication.common.errors.UsageError`: the value, and the fix) and not a
traceback minutes later: the model source, environment names, the device, pairs files,
the run directory, what ``--resume`` will find there, and whether the learner's step fits
the GPU's memory.

Each check is cheap: none loads a model; ``check_device`` and ``check_learner_memory``
import torch (the latter reads the model's ``config.json`` only).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from composer_replication.common.errors import UsageError, did_you_mean
from composer_replication.config.environments import BUILTIN_ENVIRONMENTS
from composer_replication.config.identity import identity_difference, run_identity
from composer_replication.model.sources import check_model_source

__all__ = [
    "BUILTIN_ENVIRONMENTS",
    "check_device",
    "check_env_name",
    "check_learner_memory",
    "check_loss_function",
    "check_model_source",
    "check_pairs_files",
    "check_resume",
    "check_run",
]


def check_env_name(name: str, where: str = "environment") -> None:
    """A built-in environment or an importable ``pkg.module:factory``."""
    if name in BUILTIN_ENVIRONMENTS:
        return
    fix = f"use {' or '.join(BUILTIN_ENVIRONMENTS)}, or 'pkg.module:factory'"
    if ":" in name:
        module, _, attr = name.partition(":")
        try:
            found = bool(module and attr) and importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise UsageError(f"{where} {name!r}: module {module!r} cannot be imported; {fix}")
        return
    raise UsageError(
        f"{where} {name!r} is not an environment{did_you_mean(name, BUILTIN_ENVIRONMENTS)}; {fix}"
    )


def check_device(spec: str, where: str = "model.device") -> None:
    """The device resolves here (a GPU that is asked for is visible)."""
    from composer_replication.model.devices import resolve_device

    try:
        resolve_device(spec)
    except ValueError as exc:
        raise UsageError(f"{where}: {exc}") from None


def check_pairs_files(config: Any) -> None:
    """Every ``pairs_path`` an environment's algorithm names is a readable JSONL of pairs."""
    from composer_replication.algo.replay_dpo import load_pair_records

    for i, env in enumerate(config.envs):
        path = getattr(env.algorithm.advantage, "pairs_path", None)
        if path is None:
            continue  # the shipped pairs
        where = f"envs.{i}.algorithm.advantage.pairs_path {path!r}"
        try:
            records = load_pair_records(path)
        except FileNotFoundError:
            raise UsageError(
                f"{where} does not exist; make one with `composer-replication pairs`, or "
                "remove pairs_path for the shipped pairs"
            ) from None
        except UnicodeDecodeError:
            raise UsageError(
                f"{where} is not a text file (not UTF-8); pass a JSONL of pairs"
            ) from None
        except (ValueError, OSError) as exc:
            raise UsageError(f"{where}: {str(exc).splitlines()[0]}") from None
        if not records:
            raise UsageError(f"{where} holds no pairs; pass a JSONL file of pairs")
        if not all(isinstance(r, dict) for r in records):
            raise UsageError(f"{where}: every line must be a JSON object (a pair)")


def check_resume(config: Any, *, or_start: bool = False) -> bool:
    """Whether the run will resume: ``--resume`` needs a checkpoint in the run directory
    (``or_start``: none means a new run), written by a run of the same identity
    (``config.identity``: model, environments and their algorithms and tasks, loss, split)."""
    from composer_replication.training.checkpoint import CheckpointManager

    run_dir = Path(config.output_dir)
    manager = CheckpointManager(run_dir)
    latest = manager.latest()
    steps_done = manager.steps()[-1] if latest is not None else 0
    if latest is not None and steps_done >= config.steps:  # finished: nothing to continue
        raise UsageError(
            f"the run in {str(run_dir)!r} already trained {steps_done} of steps = "
            f"{config.steps}; raise steps (--set steps=N) to train it further, or pass "
            "another --output-dir for a new run"
        )
    if latest is None:
        if or_start:
            return False
        raise UsageError(
            f"--resume: no checkpoint in {str(run_dir / 'checkpoints')!r}; check --output-dir "
            "(or output_dir), or pass --resume-or-start to start a new run when there is none"
        )
    recorded = _recorded_identity(latest, run_dir / "config.json")
    if recorded is None:
        return True  # no readable record: the checkpoint itself is checked on load
    difference = identity_difference(recorded, run_identity(config.model_dump(mode="json")))
    if difference is not None:
        raise UsageError(
            f"--resume: the checkpoint in {str(run_dir)!r} belongs to another run ({difference}); "
            f"resume with the settings it was written with ({str(run_dir / 'config.json')!r}), "
            "or start a new run with another --output-dir"
        )
    return True


def _recorded_identity(checkpoint: Path, config_file: Path) -> dict[str, Any] | None:
    """The identity a checkpoint was written with: its own record, else the run's config."""
    from composer_replication.training.checkpoint import IDENTITY_FILE

    try:
        return json.loads((checkpoint / IDENTITY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        pass
    try:
        return run_identity(json.loads(config_file.read_text(encoding="utf-8")))
    except (OSError, ValueError, AttributeError, TypeError):
        return None


def check_env_options(name: str, options: dict[str, Any], where: str) -> None:
    """A built-in repository environment's options, checked before anything loads (the same
    checks its constructor and task generation make later, deep in the run's set-up)."""
    from composer_replication.config.environments import builtin_environment

    builtin = builtin_environment(name)
    if builtin is None or not builtin.repository_tasks:
        return
    from composer_replication.datagen.repository_tasks import (
        GENERATION_OPTIONS,
        check_generation_options,
    )
    from composer_replication.envs.feature_deletion import check_options

    try:
        check_generation_options(options, where)
        check_options(**{k: v for k, v in options.items() if k not in GENERATION_OPTIONS})
    except ValueError as exc:
        raise UsageError(str(exc)) from None


#: sampled tokens a step above which a config is sized for a GPU (the default job: 2 x 4 x 256)
GPU_SIZED_TOKENS = 32768


def cpu_notice(config: Any) -> str | None:
    """One line to say at once when a config sized for a GPU runs without one (the step's
    sampled tokens past ``GPU_SIZED_TOKENS`` on a CPU): before the minutes of loading and
    the first evaluation, so the user can stop it. None otherwise."""
    tokens = sum(
        e.tasks_per_step * e.algorithm.sampling.group_size * e.algorithm.sampling.max_new_tokens
        for e in config.envs
    )
    if tokens <= GPU_SIZED_TOKENS:
        return None
    from composer_replication.model.devices import resolve_device

    if resolve_device(config.model.device).type != "cpu":
        return None
    return (
        f"note: no GPU here, and this config samples up to {tokens:,} tokens a step (it is "
        "sized for a GPU): a step will take hours on this CPU; the embedded default "
        "(composer-replication train with no config) is sized for one"
    )


def check_run(config: Any) -> None:
    """The checks ``train`` makes on a parsed config before it loads anything."""
    from composer_replication.common.outputs import check_output_dir

    check_model_source(config.model.source)
    check_output_dir(config.output_dir, option="output_dir")
    from composer_replication.training.run_lock import check_run_directory_free

    check_run_directory_free(config.output_dir)
    check_device(config.model.device)
    for i, env in enumerate(config.envs):
        check_env_name(env.name, f"envs.{i}.name")
        check_env_options(env.name, env.options, f"envs.{i}.options")
    check_pairs_files(config)
    check_loss_function(config.loss)
    check_engine(config.roles.placement)
    check_inference_engine(config.inference)
    check_trackers(config.trackers)
    if config.model.source == "embedded":
        check_cache_dir()
    check_learner_memory(config)


def _model_shape(source: str) -> Any:
    """The :class:`~composer_replication.model.memory_estimate.ModelShape` of a model source, or
    None where it cannot be read without loading (a GGUF file, a hub id, an odd config)."""
    from composer_replication.model.memory_estimate import EMBEDDED_SHAPE, ModelShape

    if source == "embedded":
        return EMBEDDED_SHAPE
    path = Path(source).expanduser() / "config.json"
    try:
        return ModelShape.from_config(json.loads(path.read_text(encoding="utf-8")))
    except (OSError, ValueError, TypeError, AttributeError):
        return None


def learner_memory_settings(config: Any) -> dict[str, Any]:
    """:func:`~composer_replication.model.memory_estimate.estimate_learner_memory`'s settings
    (all but the shape and the tokens) from a run config, as ``train`` runs it on a GPU."""
    import os

    from composer_replication.config.placement import DTYPE_NAMES, check_dtype_spec

    dtype = check_dtype_spec(config.model.dtype)
    if dtype == "auto":  # float32 master weights, bfloat16 autocast (a GPU that has it)
        param_bytes, compute_bytes = 4, 2
    else:
        param_bytes = compute_bytes = {"float32": 4, "float64": 8}.get(DTYPE_NAMES[dtype], 2)
    lora = config.model.lora
    mode, _ = config.teacher_mode
    frozen = (0 if lora is not None else 1) + (1 if mode == "ema" else 0)
    return {
        "param_bytes": param_bytes,
        "compute_bytes": compute_bytes,
        "lora_r": None if lora is None else lora.r,
        "lora_targets": () if lora is None else tuple(lora.target_modules),
        "gradient_checkpointing": config.model.gradient_checkpointing,
        "chunk_size": config.loss.chunk_size or None,
        "frozen_copies": frozen,
        "shards": max(1, int(os.environ.get("WORLD_SIZE", "1"))),
    }


def check_learner_memory(config: Any, *, available: int | None = None) -> Any:
    """Refuse a config whose learner step cannot fit the GPU (estimate: :mod:`~composer_\
replication.memory_estimate`, 10% of the memory kept spare); returns the estimate, or None
    where none is made (a CPU run, a model whose shape cannot be read without loading it).

    ``available``: bytes of GPU memory to fit (default: what is free on the run's CUDA
    device, ``torch.cuda.mem_get_info``; on a CPU the check is skipped)."""
    from composer_replication.model.memory_estimate import (
        DEFAULT_RESERVE,
        GIB,
        estimate_learner_memory,
        fits,
        largest_fitting_tokens,
    )

    if available is None:
        from composer_replication.model.devices import resolve_device

        try:
            device = resolve_device(config.model.device)
        except ValueError:
            return None  # check_device names the problem
        if device.type != "cuda":
            return None
        import torch

        available, _ = torch.cuda.mem_get_info(device)
    shape = _model_shape(config.model.source)
    if shape is None:
        return None
    settings = learner_memory_settings(config)
    tokens = config.micro_batch_tokens
    memory = estimate_learner_memory(shape, micro_batch_tokens=tokens, **settings)
    if fits(memory, available):
        return memory
    best = largest_fitting_tokens(shape, available, **settings)
    fixes = [f"lower micro_batch_tokens (at most {best} fits)" if best else None]
    if not settings["gradient_checkpointing"]:
        fixes.append("set model.gradient_checkpointing = true")
    if settings["lora_r"] is None:
        fixes.append("train LoRA adapters (model.lora)")
    fixes = [f for f in fixes if f]
    raise UsageError(
        f"micro_batch_tokens = {tokens}: the learner step needs about {memory.describe()} at "
        f"its peak but the GPU has {available / GIB:.1f} GiB free and {DEFAULT_RESERVE:.0%} of "
        f"it stays spare; {', or '.join(fixes)}"
    )


#: the package each tracker needs (found, not imported)
TRACKER_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "trackio": "trackio"}


def check_trackers(trackers: Any) -> None:
    """Each tracker's package is installed, before anything loads."""
    for name in trackers or ():
        package = TRACKER_PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            raise UsageError(
                f"trackers: {name!r} needs its package: pip install {package} (or drop it "
                "from trackers)"
            )


def check_cache_dir() -> None:
    """The project's cache (where the embedded model is converted once) is a folder, or
    can be made one (a read-only one that already holds the model serves it)."""
    from composer_replication.common.outputs import OutputError, check_output_dir
    from composer_replication.common.project_cache import CACHE_ENV_VAR, cache_dir

    root = cache_dir()
    if root.is_dir():
        return
    try:
        check_output_dir(
            root, option=f"the cache ({CACHE_ENV_VAR} or ~/.cache)", follow_symlinks=True
        )
    except OutputError as err:
        raise UsageError(f"{err}; set {CACHE_ENV_VAR} to a folder you can write") from None


def check_inference_engine(inference: Any) -> None:
    """``inference.engine = "vllm"``: the server it names can be had, before the model loads:
    something listens at ``url``, or the engine's interpreter exists (``command`` is the
    user's own launcher, found when it runs). A user's engine: its factory imports."""
    if ":" in inference.engine:
        from composer_replication.common.callables import load_callable

        try:
            load_callable(inference.engine, "inference.engine (a user's engine factory)")
        except ValueError as err:
            raise UsageError(str(err)) from None
        return
    if inference.engine != "vllm":
        return
    if inference.url:
        from composer_replication.inference.server import dead_endpoint

        problem = dead_endpoint(inference.url)
        if problem is not None:
            raise problem
        return
    if inference.command:
        return
    from composer_replication.inference.server import engine_python

    try:
        engine_python(inference)
    except FileNotFoundError as err:
        raise UsageError(str(err)) from None


def check_engine(placement: str) -> None:
    """The packages the roles' placement needs are installed (found, not imported)."""
    import importlib.util

    if placement == "monarch" and importlib.util.find_spec("monarch") is None:
        raise UsageError(
            "the roles on monarch need torchmonarch: pip install "
            "'composer-replication[monarch]' (or --placement in_process)"
        )


def check_loss_function(loss: Any) -> None:
    """A custom rl loss (``loss.type = 'custom'``) must import and be callable."""
    if loss.type != "custom":
        return
    from composer_replication.common.callables import load_callable

    try:
        load_callable(loss.import_path, "loss.import_path (custom rl loss)")
    except ValueError as exc:
        raise UsageError(str(exc)) from None
