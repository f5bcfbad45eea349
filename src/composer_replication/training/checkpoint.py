"""Training-state checkpoints: atomic, keep-last-N, and complete enough to resume exactly.

A checkpoint directory ``<run>/checkpoints/step_NNNNNN`` holds either

- ``trainable.safetensors`` (one process): the parameters that train (LoRA adapters, or
  every weight), with the optimizer's state inside ``state.pt``; or
- ``sharded/`` (several ranks): a ``torch.distributed.checkpoint`` of the trainable
  parameters and the optimizer state, each rank writing its own FSDP2 shards (no rank
  gathers the model);

and ``state.pt``: LR scheduler, the Python / NumPy / torch RNG states (every rank's, in a
sharded checkpoint), the step counter and the JSON states of the curriculum, the kill switch
and the teacher models.

Either is written into a temporary sibling and renamed into place by rank 0 once every rank
has written its part, so a run killed at any moment (SIGKILL included) leaves the previous
checkpoint intact, and resuming from it replays the same steps with the same random
numbers. Both load into any number of ranks: a sharded checkpoint is resharded by
``torch.distributed.checkpoint`` (one process reads it whole), a one-process checkpoint is
split into the ranks' shards.
"""

from __future__ import annotations

import contextlib
import json
import random
import re
import shutil
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from composer_replication.common.atomic_io import build_dir_atomically
from composer_replication.common.errors import UsageError
from composer_replication.distributed.ranks import RankGroup

_STEP_DIR = re.compile(r"step_(\d{6,})")
#: the torch.distributed.checkpoint directory of a checkpoint written by several ranks
SHARDED_DIR = "sharded"


def rng_state() -> dict[str, Any]:
    import numpy as np

    return {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        # GPU sampling draws from the CUDA generators (absent on a CPU-only machine)
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
    }


def set_rng_state(state: dict[str, Any]) -> None:
    import numpy as np

    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a collective: every rank calls it), else itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def trainable_state(model: Any) -> dict[str, torch.Tensor]:
    """Host copies of the trainable parameters, whole (gathered when sharded: every rank
    of a sharded model must call it)."""
    return {
        n: _full(p.detach()).to("cpu", copy=True).contiguous()
        for n, p in model.named_parameters()
        if p.requires_grad
    }


def optimizer_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """The optimizer's whole state keyed by parameter name, on the host (gathered when the
    model is sharded), so a checkpoint resumes on any number of ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_optimizer_state_dict(model, optimizer, options=options)


def load_optimizer_state(model: Any, optimizer: Any, state: dict[str, Any]) -> None:
    """Restore :func:`optimizer_state` (or a plain ``optimizer.state_dict()`` of an older
    checkpoint, keyed by parameter index) into ``optimizer``, sharded or not."""
    groups = state.get("param_groups", [])
    if any(isinstance(i, int) for group in groups for i in group.get("params", [])):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True)
    with _state_on_model_device(model):
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=options)


def _state_on_model_device(model: Any) -> torch.device:
    """The model's device as the default device, for ``set_optimizer_state_dict``: it takes a
    zero-gradient step to create the state it fills, and before torch 2.13 Adam creates its
    step counter there without a device (it then follows any default device, not the model)."""
    from composer_replication.model.devices import module_device

    return torch.device(module_device(model))


def load_trainable_state(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    if set(tensors) != trainable:
        missing, extra = sorted(trainable - set(tensors)), sorted(set(tensors) - trainable)
        raise UsageError(
            f"checkpoint does not match the model's trainable parameters (missing "
            f"{missing[:3]}, unexpected {extra[:3]}): was it written with another LoRA setting?"
        )
    wrong = [
        (n, tuple(v.shape), tuple(params[n].shape))
        for n, v in tensors.items()
        if not hasattr(params[n], "device_mesh") and tuple(v.shape) != tuple(params[n].shape)
    ]
    if wrong:
        name, saved, here = wrong[0]
        raise UsageError(
            f"checkpoint does not match the model: {name} is {list(saved)} in the checkpoint "
            f"and {list(here)} in the model ({len(wrong)} such parameters): was it written "
            "for another model (model.source)?"
        )
    with torch.no_grad():
        for name, value in tensors.items():
            param = params[name]
            if hasattr(param, "device_mesh"):  # an FSDP2 shard: keep this rank's part
                from torch.distributed.tensor import distribute_tensor

                value = distribute_tensor(
                    value.to(param.device), param.device_mesh, param.placements
                )
            param.copy_(value)


def sharded_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """What a sharded checkpoint holds, as ``torch.distributed.checkpoint`` saves and loads it
    in place: the trainable parameters by name (each rank's FSDP2 shards, or whole tensors in
    one process) and the optimizer state keyed by parameter name.

    The parameters themselves, not ``get_model_state_dict``: a tied LM head is one parameter
    here under one name, whether the model is sharded (the head reads the embedding) or not.
    """
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    params = {n: p for n, p in model.named_parameters() if p.requires_grad}
    return {"model": params, "optim": get_optimizer_state_dict(model, optimizer)}


@contextlib.contextmanager
def _quiet_dcp() -> Iterator[None]:
    """torch.distributed.checkpoint warns on every call in one process (no process group):
    that is an intended use here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to (save|load)")
        yield


def save_sharded(state: dict[str, Any], directory: Path) -> None:
    """Every rank writes its shards of :func:`sharded_state` into ``directory`` (a
    collective; rank 0 writes the metadata once every rank's files exist)."""
    import torch.distributed.checkpoint as dcp

    with _quiet_dcp():
        dcp.save(state, checkpoint_id=str(directory))


def load_sharded(directory: Path, *, model: Any, optimizer: Any) -> None:
    """Load a sharded checkpoint into ``model`` and ``optimizer`` with however many ranks
    this run has (resharded as needed; in one process, read whole)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    state = sharded_state(model, optimizer)
    try:
        with _quiet_dcp(), torch.no_grad():
            dcp.load(state, checkpoint_id=str(directory))
    except (CheckpointException, RuntimeError, ValueError) as err:
        if "Missing key" in str(err) or "Unexpected key" in str(err):
            missing = str(err).split("Missing key in checkpoint state_dict:")[-1].split("\n")[0]
            raise UsageError(
                f"checkpoint {directory.parent} does not match the model's trainable "
                f"parameters (e.g. {missing.strip()}): was it written with another LoRA "
                "setting?"
            ) from None
        raise
    with _state_on_model_device(model):
        set_optimizer_state_dict(model, optimizer, optim_state_dict=state["optim"])


def _write_identity(folder: Path, extra: dict[str, Any]) -> None:
    """The run identity beside the state (readable without torch: ``--resume`` checks it
    before anything loads)."""
    if extra.get("identity") is not None:
        (folder / IDENTITY_FILE).write_text(json.dumps(extra["identity"], sort_keys=True) + "\n")


def _rank_rng(state: dict[str, Any], rank: int) -> dict[str, Any]:
    """This rank's RNG states in a checkpoint: its own when the checkpoint has them (same
    number of ranks or more), else a saved rank's (``rank`` modulo their number)."""
    per_rank = state.get("rng_per_rank") or [state["rng"]]
    return per_rank[rank % len(per_rank)]


@contextlib.contextmanager
def _unreadable(file: Path, checkpoint: Path) -> Iterator[None]:
    """A damaged checkpoint file (truncated, overwritten) is a one-line error naming it and
    the fix, not the loader's traceback."""
    try:
        yield
    except Exception as exc:
        detail = (str(exc).strip().splitlines() or [type(exc).__name__])[0].split(". ")[0][:120]
        raise UsageError(
            f"checkpoint file {str(file)!r} cannot be read ({detail}): move {str(checkpoint)!r} "
            "away to resume from the checkpoint before it, or start a new run without --resume"
        ) from exc


#: each checkpoint's record of the run identity it belongs to (``config.identity``)
IDENTITY_FILE = "identity.json"


class CheckpointManager:
    """Writes and finds checkpoints under ``<run_dir>/checkpoints``."""

    def __init__(self, run_dir: str | Path, *, keep_last: int = 2) -> None:
        if keep_last < 1:
            raise ValueError(f"keep_last={keep_last} must be >= 1")
        self.root = Path(run_dir) / "checkpoints"
        self.keep_last = keep_last

    def path_for(self, step: int) -> Path:
        return self.root / f"step_{step:06d}"

    def steps(self) -> list[int]:
        if not self.root.is_dir():
            return []
        found = []
        for child in self.root.iterdir():
            m = _STEP_DIR.fullmatch(child.name)
            weights = (child / "trainable.safetensors").exists() or (
                child / SHARDED_DIR / ".metadata"
            ).exists()
            if m and (child / "state.pt").exists() and weights:
                found.append(int(m.group(1)))
        return sorted(found)

    def latest(self) -> Path | None:
        steps = self.steps()
        return self.path_for(steps[-1]) if steps else None

    def save(
        self,
        step: int,
        *,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        extra: dict[str, Any],
        ranks: RankGroup | None = None,
    ) -> Path:
        """Atomically write the checkpoint of ``step`` (the number of steps completed).

        Under several ``ranks`` every rank calls it: each writes its own shards, rank 0
        alone writes ``state.pt`` and commits the directory.
        """
        ranks = ranks or RankGroup()
        state = {
            "step": step,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "extra": extra,
        }
        if ranks.distributed:
            return self._save_sharded(step, state, model=model, optimizer=optimizer, ranks=ranks)
        from safetensors.torch import save_file

        tensors = trainable_state(model)
        state.update(optimizer=optimizer_state(model, optimizer), rng=rng_state())

        def write(tmp: Path) -> None:
            save_file(tensors, str(tmp / "trainable.safetensors"))
            torch.save(state, tmp / "state.pt")
            _write_identity(tmp, extra)

        path = build_dir_atomically(self.path_for(step), write, replace=True)
        self._prune()
        return path

    def _save_sharded(
        self, step: int, state: dict[str, Any], *, model: Any, optimizer: Any, ranks: RankGroup
    ) -> Path:
        rngs = ranks.gather_shares([rng_state()], ranks.world_size)
        shards = sharded_state(model, optimizer)
        if ranks.is_writer:
            state.update(rng=rngs[0], rng_per_rank=rngs, world_size=ranks.world_size)

            def write(tmp: Path) -> None:
                ranks.agree(str(tmp))  # where the other ranks write their shards
                save_sharded(shards, tmp / SHARDED_DIR)
                torch.save(state, tmp / "state.pt")
                _write_identity(tmp, state["extra"])

            build_dir_atomically(self.path_for(step), write, replace=True)
            self._prune()
        else:
            save_sharded(shards, Path(ranks.agree("")) / SHARDED_DIR)
        ranks.barrier()  # committed before any rank reads or prunes again
        return self.path_for(step)

    def load(
        self,
        path: str | Path,
        *,
        model: Any,
        optimizer: Any,
        scheduler: Any,
        ranks: RankGroup | None = None,
    ) -> dict[str, Any]:
        """Restore model, optimizer, scheduler and this rank's RNG; return ``{"step",
        "extra"}``. Every rank of the run calls it."""
        path = Path(path)
        if not (path / "state.pt").exists():
            raise FileNotFoundError(f"{path} is not a checkpoint (no state.pt)")
        ranks = ranks or RankGroup()
        # host tensors; the optimizer's state moves to each parameter's device on load
        with _unreadable(path / "state.pt", path):
            state = torch.load(path / "state.pt", weights_only=False, map_location="cpu")
        if (path / SHARDED_DIR / ".metadata").exists():
            load_sharded(path / SHARDED_DIR, model=model, optimizer=optimizer)
        else:
            from safetensors.torch import load_file

            with _unreadable(path / "trainable.safetensors", path):
                tensors = load_file(str(path / "trainable.safetensors"))
            try:
                load_trainable_state(model, tensors)
            except UsageError as exc:
                raise UsageError(
                    f"{path}: {exc}; or resume with the settings it was written with"
                ) from None
            load_optimizer_state(model, optimizer, state["optimizer"])
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])
        set_rng_state(_rank_rng(state, ranks.rank))
        if ranks.rank >= len(state.get("rng_per_rank") or [None]):
            # a rank the checkpoint did not have: its own stream, derived from the state
            torch.manual_seed(int(torch.randint(0, 2**31, (1,))) + 7919 * ranks.rank)
        return {"step": int(state["step"]), "extra": state["extra"]}

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep_last]:
            shutil.rmtree(self.path_for(step), ignore_errors=True)
