"""Where the policy lives and in which precision: device and dtype resolution at run set-up.

Mixed precision (``dtype = "auto"`` on a GPU that supports bfloat16, or on a CPU that
computes bfloat16 matrix products: AMX or AVX512-BF16) keeps float32 master parameters, so AdamW's moments and the update are float32, and runs the forward (sampling,
scoring, the trainer step, evaluation) under ``torch.autocast`` in bfloat16: activations
and matrix products are bfloat16, reductions that autocast keeps in float32 stay float32.
Under FSDP2 the same choice is expressed as ``MixedPrecisionPolicy(param_dtype=bfloat16,
reduce_dtype=float32)`` (see :mod:`composer_replication.distributed`). On a CPU without those instructions ``auto`` is
plain float32 (bfloat16 would be emulated, slower than float32); a sharded run on CPUs
stays float32 too. Sampling has its own precision (``[inference] sampling_dtype``: rollouts
follow the learner's autocast, on a bfloat16 copy of the weights) and so does held-out
evaluation (``[eval] sampling_dtype``: float32 on a CPU unless asked otherwise). An explicit dtype name (``"float32"``, ``"bfloat16"``, ...) casts the
parameters themselves and uses no autocast.

TF32 (``model.tf32``, on by default) lets the float32 matmuls and convolutions that remain on
a CUDA device (those autocast leaves in float32, or every one in a float32 run) use the
tensor cores with 10-bit-mantissa inputs and float32 accumulation: :func:`set_tf32`. It is a
process-wide CUDA setting; on a CPU nothing is changed.

Nothing here imports a CUDA-only module: ``torch.cuda`` queries answer on a CPU build.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from composer_replication.config.placement import (
    DTYPE_NAMES,
    check_device_spec,
    check_dtype_spec,
)

if TYPE_CHECKING:
    import torch

__all__ = [
    "Precision",
    "autocast",
    "cpu_bfloat16_kernels",
    "module_device",
    "precision_line",
    "resolve_device",
    "resolve_precision",
    "set_tf32",
]


def resolve_device(spec: str = "auto") -> torch.device:
    """The ``torch.device`` for a config's ``device`` string.

    ``"auto"`` is ``cuda`` when a GPU is visible, else ``cpu``. ``"cuda"`` (and ``auto``
    on a GPU) under ``torchrun`` is the GPU of this rank's ``LOCAL_RANK``. Asking for a GPU
    that is not there raises ``ValueError`` naming it.
    """
    import torch

    value = check_device_spec(spec)
    if value == "cpu" or (value == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ValueError(
            f"device {spec!r} asks for a GPU but torch sees none (CUDA build: "
            f"{torch.version.cuda is not None}); use device = 'cpu' or 'auto'"
        )
    index = int(value.split(":")[1]) if ":" in value else int(os.environ.get("LOCAL_RANK", "0"))
    if index >= torch.cuda.device_count():
        raise ValueError(
            f"device {spec!r} resolves to cuda:{index} but only {torch.cuda.device_count()} "
            "GPU(s) are visible; pick an index below that (or check CUDA_VISIBLE_DEVICES)"
        )
    return torch.device("cuda", index)


@dataclass(frozen=True)
class Precision:
    """Parameter dtype, and the autocast dtype of forwards (None: no autocast)."""

    param_dtype: torch.dtype
    compute_dtype: torch.dtype | None = None

    @property
    def mixed(self) -> bool:
        return self.compute_dtype is not None


def cpu_bfloat16_kernels() -> str | None:
    """The instructions this CPU computes bfloat16 matrix products with ("AMX" or
    "AVX512-BF16", as torch's CPU build reports them), None when it has neither."""
    import torch

    try:
        if torch.cpu._is_amx_tile_supported():
            return "AMX"
        if torch.cpu._is_avx512_bf16_supported():
            return "AVX512-BF16"
    except AttributeError:  # a torch build without the queries: assume neither
        return None
    return None


def resolve_precision(spec: str, device: torch.device) -> Precision:
    """``"auto"``: float32 parameters + bfloat16 autocast on a CUDA device that supports
    bfloat16 or a CPU with bfloat16 instructions (:func:`cpu_bfloat16_kernels`), plain
    float32 elsewhere; a dtype name: parameters in that dtype, no autocast."""
    import torch

    value = check_dtype_spec(spec)
    if value != "auto":
        return Precision(getattr(torch, DTYPE_NAMES[value]))
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return Precision(torch.float32, torch.bfloat16)
    if device.type == "cpu" and cpu_bfloat16_kernels() is not None:
        return Precision(torch.float32, torch.bfloat16)
    return Precision(torch.float32)


def precision_line(precision: Precision, device: torch.device) -> str:
    """How a run computes, for its first lines: the parameter dtype, and the autocast dtype
    with what decided it (on a CPU, the instructions, and how to turn it off)."""

    params = str(precision.param_dtype).removeprefix("torch.")
    if precision.compute_dtype is None:
        return f"precision: {params}"
    compute = str(precision.compute_dtype).removeprefix("torch.")
    line = f"precision: {params} weights, {compute} autocast"
    if device.type == "cpu":
        line += f" (this CPU has {cpu_bfloat16_kernels()}; model.dtype = 'float32' turns it off)"
    return line


def autocast(precision: Precision, device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """``torch.autocast`` for mixed precision, ``nullcontext()`` otherwise."""
    if precision.compute_dtype is None:
        return contextlib.nullcontext()
    import torch

    return torch.autocast(device_type=device.type, dtype=precision.compute_dtype)


def set_tf32(enabled: bool, device: torch.device) -> bool:
    """Allow (or forbid) TF32 for float32 matmuls (cuBLAS) and convolutions (cuDNN) when
    ``device`` is a CUDA device; returns whether anything was set (False elsewhere).

    Uses ``torch.backends.cuda.matmul.allow_tf32`` / ``torch.backends.cudnn.allow_tf32``,
    which touch CUDA only: ``torch.set_float32_matmul_precision`` would also switch the
    CPU's oneDNN matmuls. Setting these flags needs no GPU, so this is safe to call before
    one is used.
    """
    if device.type != "cuda":
        return False
    import torch

    torch.backends.cuda.matmul.allow_tf32 = bool(enabled)
    torch.backends.cudnn.allow_tf32 = bool(enabled)
    return True


def module_device(model: Any) -> torch.device:
    """The device of ``model``'s first parameter (CPU for a model without parameters)."""
    import torch

    for parameter in model.parameters():
        return parameter.device
    return torch.device("cpu")
