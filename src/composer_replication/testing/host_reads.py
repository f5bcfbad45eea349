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
"""

from __future__ import annotations

import weakref
from collections import Counter
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["HostReads"]

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
        if self.owner.depth == 0 and (
            name in _READ_OPS or (name in _MASK_INDEX_OPS and _bool_index(args))
        ):
            self.owner.counts[name] += 1
        return func(*args, **(kwargs or {}))


class HostReads:
    """Context manager counting host reads of tensor data inside the block.

    ``total`` is the number of reads; ``counts`` splits it by entry point or operator.
    """

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()
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
