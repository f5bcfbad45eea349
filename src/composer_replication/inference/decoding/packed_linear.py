"""Decode-time linear layers on oneDNN with pre-packed weights (CPU, float32).

A decode step multiplies a few rows by every weight matrix of the model, so its cost is
the matrix products. On this project's reference CPU (2 cores of an AMD EPYC with AVX-512)
the default float32 path reaches about a third of the memory bandwidth for such skinny
products, while oneDNN with the weights reordered once into its blocked layout runs them
in about half the time (``benchmarks/sampling.py`` measures both). The reorder costs one
pass over the weights, so it pays for any decode longer than a few steps; it is redone per
sampling call because the weights change after every optimizer step.

The arithmetic stays float32 (oneDNN's default; no reduced-precision accumulation): the
results differ from the default kernel only by summation order, ~1e-6 relative, the same
order as between any two batch shapes of the default kernel. With ``dtype=torch.bfloat16``
(``[inference] sampling_dtype = "bfloat16"``, on a CPU with bfloat16 instructions) the
packed copy is bfloat16, cast once per sampling call, and each product's input is cast to
it and its output back: half the bytes per token, bfloat16's 8-bit mantissa.

:func:`packed_linears` is a context manager: inside it every ``torch.nn.Linear`` of the
model computes with its packed weight; on exit the modules are exactly as before. Anywhere
the packed path is unavailable (not a CPU model, not float32, a torch build without
oneDNN) it changes nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

__all__ = ["folded_lora_weight", "packed_linear_available", "packed_linears"]


def packed_linear_available(model: Any, dtype: torch.dtype | None = None) -> bool:
    """True when the model's linear layers can run on packed oneDNN weights here (in
    ``dtype``: None for the weights' float32; bfloat16 needs the CPU's bfloat16
    instructions)."""
    ops = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or ops is None:
        return False
    if not (hasattr(ops, "_linear_pointwise") and hasattr(ops, "_reorder_linear_weight")):
        return False
    try:
        parameter = next(model.parameters())
    except StopIteration:
        return False
    if dtype == torch.bfloat16:
        from composer_replication.model.devices import cpu_bfloat16_kernels

        if cpu_bfloat16_kernels() is None:
            return False
    elif dtype not in (None, torch.float32):
        return False
    return parameter.device.type == "cpu" and parameter.dtype == torch.float32


def _packed_forward(weight: torch.Tensor, bias: torch.Tensor | None) -> Any:
    linear = torch.ops.mkldnn._linear_pointwise
    if weight.dtype == torch.float32:

        def forward(x: torch.Tensor) -> torch.Tensor:
            return linear(x, weight, bias, "none", [], "")

        return forward

    def forward_cast(x: torch.Tensor) -> torch.Tensor:
        return linear(x.to(weight.dtype), weight, bias, "none", [], "").to(x.dtype)

    return forward_cast


def folded_lora_weight(module: Any) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(base weight + the active adapters' deltas, base bias) of an unmerged plain LoRA
    linear layer: the weight ``merge()`` would leave, without touching the module; None for
    anything else (no LoRA, a variant such as DoRA, a LoRA bias)."""
    from composer_replication.model.parts import is_unmerged_lora

    if not is_unmerged_lora(module):
        return None
    base = module.get_base_layer()
    if type(base) is not torch.nn.Linear:
        return None
    variants = getattr(module, "lora_variant", {})
    lora_bias = getattr(module, "lora_bias", {})
    adapters = [a for a in module.active_adapters if a in module.lora_A]
    if any(a in variants or lora_bias.get(a) for a in adapters):
        return None
    weight = base.weight.detach()
    if not getattr(module, "disable_adapters", False):
        for adapter in adapters:  # as merge(): base += delta, in the base weight's dtype
            weight = weight + module.get_delta_weight(adapter).to(weight.dtype)
    return weight, None if base.bias is None else base.bias.detach()


@contextlib.contextmanager
def packed_linears(
    model: Any, *, batch_hint: int = 8, dtype: torch.dtype | None = None, fold_lora: bool = False
) -> Iterator[bool]:
    """Run the model's ``nn.Linear`` layers on packed weights inside the block.

    Yields whether the packed path is in use. ``batch_hint`` is the expected number of rows
    per call (oneDNN picks its blocking for it; any row count works). ``dtype``: the packed
    copy's dtype (None: float32, the weights' own; ``torch.bfloat16``). ``fold_lora``: an
    unmerged LoRA layer computes with one packed copy of its base weight plus its adapters
    (:func:`folded_lora_weight`: the same bits as merging first), so sampling needs neither
    a merge nor a saved copy of the base weights. Only for inference: the packed weights
    are a copy, so gradients would not reach the parameters.
    """
    if not packed_linear_available(model, dtype):
        yield False
        return
    patched: list[torch.nn.Module] = []
    folded_bases: set[int] = set()
    try:
        with torch.no_grad():
            for module in model.modules():
                if "forward" in module.__dict__ or id(module) in folded_bases:
                    continue
                folded = folded_lora_weight(module) if fold_lora else None
                if folded is not None:
                    folded_bases.add(id(module.get_base_layer()))
                    weight, bias = folded
                elif type(module) is torch.nn.Linear:
                    weight = module.weight.detach()
                    bias = None if module.bias is None else module.bias.detach()
                else:
                    continue
                if weight.dtype != torch.float32:
                    continue
                if dtype is not None and dtype != weight.dtype:
                    weight = weight.to(dtype)
                    bias = None if bias is None else bias.to(dtype)
                packed = torch.ops.mkldnn._reorder_linear_weight(weight, max(1, int(batch_hint)))
                del weight  # a folded weight's temporary goes before the next layer's
                module.forward = _packed_forward(packed, bias)
                patched.append(module)
        yield True
    finally:
        for module in patched:
            del module.forward
