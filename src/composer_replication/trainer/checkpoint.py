"""Training-state checkpoints: atomic, keep-last-N, and complete enough to resume exactly.

A checkpoint directory ``<run>/checkpoints/step_NNNNNN`` holds:
- ``trainable.safetensors``: the parameters that train (LoRA adapters, or every weight);
- ``state.pt``: optimizer, LR scheduler, the Python / NumPy / torch RNG states, the step
  counter and the JSON states of the curriculum, the kill switch and the teacher models.
It is written into a temporary sibling and renamed into place, so a run killed at any
moment (SIGKILL included) leaves the previous checkpoint intact, and resuming from it
replays the same steps with the same random numbers.
"""

from __future__ import annotations

import random
import re
import shutil
from pathlib import Path
from typing import Any

import torch

from composer_replication.atomic_io import build_dir_atomically

_STEP_DIR = re.compile(r"step_(\d{6,})")


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
    set_optimizer_state_dict(model, optimizer, optim_state_dict=state, options=options)


def load_trainable_state(model: Any, tensors: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    trainable = {n for n, p in params.items() if p.requires_grad}
    if set(tensors) != trainable:
        missing, extra = sorted(trainable - set(tensors)), sorted(set(tensors) - trainable)
        raise ValueError(
            f"checkpoint does not match the model's trainable parameters (missing "
            f"{missing[:3]}, unexpected {extra[:3]}): was it written with another LoRA setting?"
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
            if m and (child / "state.pt").exists() and (child / "trainable.safetensors").exists():
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
        writer: bool = True,
    ) -> Path:
        """Atomically write the checkpoint of ``step`` (the number of steps completed).

        With a sharded model every rank calls it (the state is gathered) and only the
        ``writer`` (rank 0) writes.
        """
        from safetensors.torch import save_file

        tensors = trainable_state(model)
        optimizer_whole = optimizer_state(model, optimizer)
        if not writer:
            return self.path_for(step)
        state = {
            "step": step,
            "optimizer": optimizer_whole,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": rng_state(),
            "extra": extra,
        }

        def write(tmp: Path) -> None:
            save_file(tensors, str(tmp / "trainable.safetensors"))
            torch.save(state, tmp / "state.pt")

        path = build_dir_atomically(self.path_for(step), write, replace=True)
        self._prune()
        return path

    def load(
        self, path: str | Path, *, model: Any, optimizer: Any, scheduler: Any
    ) -> dict[str, Any]:
        """Restore model, optimizer, scheduler and RNG; return ``{"step", "extra"}``."""
        from safetensors.torch import load_file

        path = Path(path)
        if not (path / "state.pt").exists():
            raise FileNotFoundError(f"{path} is not a checkpoint (no state.pt)")
        load_trainable_state(model, load_file(str(path / "trainable.safetensors")))
        # host tensors; optimizer.load_state_dict moves its state to each parameter's device
        state = torch.load(path / "state.pt", weights_only=False, map_location="cpu")
        load_optimizer_state(model, optimizer, state["optimizer"])
        if scheduler is not None and state["scheduler"] is not None:
            scheduler.load_state_dict(state["scheduler"])
        set_rng_state(state["rng"])
        return {"step": int(state["step"]), "extra": state["extra"]}

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep_last]:
            shutil.rmtree(self.path_for(step), ignore_errors=True)
