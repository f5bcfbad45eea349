"""Count the places where the host reads tensor data: the CPU proxy for GPU syncs.

On a GPU, every read of a tensor's values by Python (``.item()``, ``.tolist()``, ``bool(t)``,
a copy to the CPU, a boolean-mask index, which needs ``nonzero``'s output size) makes the
host wait until the device has finished all queued work. A loop that does one per token
leaves the device idle between tokens. On a CPU those reads are free, but they are the same
calls, so counting them on the CPU tells how often the same code would stop a GPU.

:class:`HostReads` counts at two levels at once:

- Python entry points (a ``TorchFunctionMode``): ``item``, ``tolist``, ``numpy``, ``bool``,
  ``int``, ``float``, ``index``, ``cpu``, and ``to`` / ``copy_`` from another device to the
  CPU (a tensor such a read returned is on the host: reading it again is not counted);
- operators (a ``TorchDispatchMode``) that need a value or an output size on the host:
  ``_local_scalar_dense``, ``nonzero``, ``masked_select``, ``equal``, ``is_nonzero``,
  indexing by a boolean mask and the like, unless they run inside an entry point already
  counted.

Every tensor read counts, whatever its device: inside a loop that keeps its bookkeeping in
Python values, any tensor read is a read of device data.

It also counts the other way, host-to-device copies (``uploads``, apart from the reads):
an ``aten::_to_copy`` from the CPU to another device, an ``aten::copy_`` from a CPU tensor
into a tensor on another device, and ``torch.tensor`` / ``as_tensor`` / ``asarray`` of
Python data straight onto another device (made below the dispatcher: counted at the entry).
Each is ``h2d:non_blocking`` or ``h2d:blocking`` (:func:`upload_kind`): a copy to CUDA is
non-blocking only when asked so and read from pinned memory (from pageable memory the host
waits whatever the flag). On a machine without a GPU, run the code with ``device="meta"``:
its copies reach the dispatcher with the device and flag the CUDA path would give them
(a copy from the CPU to the CPU is no upload); there a flagged copy from pageable memory
cannot be told from one from pinned memory (pinning needs CUDA), so the code must pin on
its CUDA path, as :func:`~composer_replication.inference.decoding.uploads.to_device_async` does. Not
seen: an index given as a Python list on a device tensor (``x[[1, 2]]``), whose index
tensor is made and moved inside the operator.
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReads", "upload_kind"]

_READ_METHODS = {
    "item",
    "tolist",
    "numpy",
    "__bool__",
    "__int__",
    "__float__",
    "__index__",
    "cpu",
}
_MOVE_METHODS = {"to", "copy_"}
#: Operators whose result size or value the host needs before it can go on.
_READ_OPS = {
    "aten::_local_scalar_dense",
    "aten::nonzero",
    "aten::masked_select",
    "aten::equal",
    "aten::is_nonzero",
    "aten::allclose",
    "aten::unique_consecutive",
    "aten::_unique2",
    "aten::repeat_interleave",
}
#: Indexing operators that need ``nonzero`` of a boolean mask (``x[mask]``, ``x[mask] = v``).
_MASK_INDEX_OPS = {"aten::index", "aten::index_put_", "aten::index_put", "aten::_index_put_impl_"}


#: Factories that build a tensor from Python data (an upload when their device is not the CPU).
_FROM_DATA = {"tensor", "as_tensor", "asarray"}


def upload_kind(target: torch.device, non_blocking: bool, pinned: bool) -> str:
    """``"h2d:non_blocking"`` when a host-to-``target`` copy lets the host go on, else
    ``"h2d:blocking"``: a CUDA copy from pageable memory waits whatever its flag."""
    if non_blocking and (pinned or target.type != "cuda"):
        return "h2d:non_blocking"
    return "h2d:blocking"


def _upload(name: str, args: tuple, kwargs: dict) -> str | None:
    """The kind of host-to-device copy an operator makes, or None when it makes none."""
    if name == "aten::_to_copy":
        source, target = args[0], kwargs.get("device")
        non_blocking = bool(kwargs.get("non_blocking", False))
    elif name == "aten::copy_":
        dst, source = args[0], args[1]
        target = dst.device
        non_blocking = bool(args[2] if len(args) > 2 else kwargs.get("non_blocking", False))
    else:
        return None
    if target is None or source.device.type != "cpu" or torch.device(target).type == "cpu":
        return None
    target = torch.device(target)
    pinned = target.type == "cuda" and source.is_pinned()  # asked only where it matters
    return upload_kind(target, non_blocking, pinned)


def _from_data_upload(args: tuple, kwargs: dict) -> bool:
    """Whether ``torch.tensor(data, device=...)`` and the like put Python data on a device
    (a tensor given as data is moved by ``_to_copy``, counted there)."""
    device = kwargs.get("device")
    data = args[0] if args else kwargs.get("data")
    return (
        device is not None
        and torch.device(device).type != "cpu"
        and not isinstance(data, torch.Tensor)
    )


def _bool_index(args: tuple) -> bool:
    indices = args[1] if len(args) > 1 else ()
    return any(
        isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()
    )


def _moves_to_cpu(name: str, args: tuple, kwargs: dict) -> bool:
    """Whether a ``to`` / ``copy_`` call moves data from another device to the CPU."""
    if name == "copy_":
        dst, src = args[0], args[1] if len(args) > 1 else kwargs.get("src")
        return (
            isinstance(src, torch.Tensor) and dst.device.type == "cpu" and src.device.type != "cpu"
        )
    source = args[0]
    for value in (*args[1:], kwargs.get("device")):
        target = None
        if isinstance(value, (str, torch.device)):
            target = torch.device(value)
        elif isinstance(value, torch.Tensor):
            target = value.device
        if target is not None:
            return target.type == "cpu" and source.device.type != "cpu"
    return False


class _Entry(TorchFunctionMode):
    def __init__(self, owner: HostReads) -> None:
        super().__init__()
        self.owner = owner

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in _FROM_DATA and _from_data_upload(args, kwargs):
            self.owner.uploads["h2d:blocking"] += 1  # a pageable copy made by the factory
        counted = name in _READ_METHODS or (
            name in _MOVE_METHODS and _moves_to_cpu(name, args, kwargs)
        )
        if counted and args and isinstance(args[0], torch.Tensor):
            counted = not self.owner.is_host_copy(args[0])
        if not counted:
            return func(*args, **kwargs)
        self.owner.counts[name] += 1
        self.owner.depth += 1
        try:
            result = func(*args, **kwargs)
        finally:
            self.owner.depth -= 1
        if isinstance(result, torch.Tensor):  # what was read is on the host now
            self.owner.host_copies[id(result)] = weakref.ref(result)
        return result


class _Ops(TorchDispatchMode):
    def __init__(self, owner: HostReads) -> None:
        super().__init__()
        self.owner = owner

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        name = func._schema.name
        upload = _upload(name, args, kwargs or {})
        if upload is not None:
            self.owner.uploads[upload] += 1
        if self.owner.depth == 0 and (
            name in _READ_OPS or (name in _MASK_INDEX_OPS and _bool_index(args))
        ):
            self.owner.counts[name] += 1
        return func(*args, **(kwargs or {}))


class HostReads:
    """Context manager counting host reads of tensor data inside the block.

    ``total`` is the number of reads; ``counts`` splits it by entry point or operator.
    ``uploads`` counts the host-to-device copies apart, by ``"h2d:blocking"`` and
    ``"h2d:non_blocking"`` (not in ``total``).
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
        self.uploads: Counter[str] = Counter()
        self.depth = 0
        #: tensors this block read to the host: reading them again costs nothing
        self.host_copies: dict[int, weakref.ref[torch.Tensor]] = {}
        self._modes: list[Any] = []

    def is_host_copy(self, tensor: torch.Tensor) -> bool:
        ref = self.host_copies.get(id(tensor))
        return ref is not None and ref() is tensor

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __enter__(self) -> HostReads:
        self._modes = [_Entry(self), _Ops(self)]
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        self._modes = []
