"""Names of where things run: a policy's device and precision, and the processes a run's
roles execute in. Pure data, checked at config time.

``device``: ``"auto"`` (a CUDA GPU when one is visible, else the CPU), ``"cpu"``,
``"cuda"`` (the current GPU; under ``torchrun`` each rank's ``LOCAL_RANK`` GPU) or
``"cuda:N"``. ``dtype``: ``"auto"`` (mixed precision on a GPU that supports bfloat16,
float32 otherwise; see :mod:`composer_replication.model.devices`) or a parameter dtype name.
``[roles] placement``: ``"in_process"`` (every role in the calling process) or
``"monarch"`` (the roles as actors on Monarch processes; :mod:`.roles`).
"""

from __future__ import annotations

import re

__all__ = [
    "DEVICE_SPEC",
    "DTYPE_NAMES",
    "ROLE_PLACEMENTS",
    "check_device_spec",
    "check_dtype_spec",
    "check_role_placement",
]

DEVICE_SPEC = re.compile(r"auto|cpu|cuda(:\d+)?")

#: accepted parameter dtype names -> torch attribute names
DTYPE_NAMES = {
    "float32": "float32",
    "fp32": "float32",
    "float16": "float16",
    "fp16": "float16",
    "half": "float16",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float64": "float64",
}


def check_device_spec(spec: str) -> str:
    """``spec`` normalised (lower case, no spaces); ``ValueError`` naming it when it is not
    ``auto``, ``cpu``, ``cuda`` or ``cuda:N``."""
    value = str(spec).strip().lower()
    if DEVICE_SPEC.fullmatch(value) is None:
        raise ValueError(
            f"device {spec!r} is not a device this trainer runs on; use 'auto' (a GPU when one "
            "is visible, else the CPU), 'cpu', 'cuda' or 'cuda:N' (N = a GPU index)"
        )
    return value


def check_dtype_spec(spec: str) -> str:
    """``spec`` normalised; ``ValueError`` naming it when it is neither ``auto`` nor a
    name in :data:`DTYPE_NAMES`."""
    value = str(spec).strip().lower().removeprefix("torch.")
    if value != "auto" and value not in DTYPE_NAMES:
        raise ValueError(
            f"dtype {spec!r} is unknown; use 'auto' (bfloat16 mixed precision on a GPU that "
            f"supports it, float32 otherwise) or one of: {', '.join(sorted(DTYPE_NAMES))}"
        )
    return value


#: where a run's roles can execute (``[roles] placement``)
ROLE_PLACEMENTS = ("in_process", "monarch")


def check_role_placement(name: str) -> str:
    """``name`` when it is one of :data:`ROLE_PLACEMENTS`; ``ValueError`` naming it
    otherwise."""
    if name not in ROLE_PLACEMENTS:
        raise ValueError(
            f"unknown placement {name!r} of the roles; choose one of {', '.join(ROLE_PLACEMENTS)}"
        )
    return name
