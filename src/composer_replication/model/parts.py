"""Pieces of a Hugging Face causal LM the hidden-state losses need: the LM-head weight and
the transformer body's final hidden states (PEFT-wrapped models included), and the
adapter-free view of a LoRA policy that serves as its frozen initial policy."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


@dataclass(frozen=True)
class AdapterDisabled:
    """A LoRA policy seen with its adapters switched off: the initial policy, without a copy.

    LoRA trains only the adapters, so the base weights under them stay the initial policy
    (the adapters start at zero, arXiv 2106.09685). Every forward through this view runs
    inside ``peft_model.disable_adapter()``; it is only ever used under ``no_grad``.
    """

    peft_model: Any

    @staticmethod
    def applies_to(model: Any) -> bool:
        """True when ``model`` is a PEFT model whose only trainable weights are LoRA's."""
        if not hasattr(model, "disable_adapter"):
            return False
        trainable = [n for n, p in model.named_parameters() if p.requires_grad]
        return bool(trainable) and all("lora_" in n for n in trainable)


@contextmanager
def lora_merged(model: Any) -> Iterator[Any]:
    """Inside the block, a LoRA model's adapters are folded into its base weights.

    Sampling then runs the plain architecture (on 2 CPU cores, SmolLM2 with r=16 adapters
    on all seven projections generates about 1.4x slower unmerged). On exit the base
    weights are restored bit for bit from a copy taken on entry (subtracting the adapter
    again would leave rounding error in the frozen weights). Models without unmerged LoRA
    layers pass through untouched. Use under ``no_grad`` only.
    """
    import torch

    layers = [m for m in model.modules() if is_unmerged_lora(m)]
    if not layers:
        yield model
        return
    saved = [layer.get_base_layer().weight.detach().clone() for layer in layers]
    try:
        with torch.no_grad():
            for layer in layers:
                layer.merge()
        yield model
    finally:
        with torch.no_grad():
            for layer, weight in zip(layers, saved):
                if layer.merged:
                    layer.unmerge()
                layer.get_base_layer().weight.copy_(weight)


def is_unmerged_lora(module: Any) -> bool:
    """Whether ``module`` is a LoRA layer whose adapters are not folded into its base."""
    return (
        hasattr(module, "merge")
        and hasattr(module, "get_base_layer")
        and hasattr(module, "lora_A")
        and not getattr(module, "merged", True)
        and bool(getattr(module, "lora_A", None))
    )


def lm_head_weight(model: Any) -> Tensor:
    """The (V, H) output-projection weight of a Hugging Face causal LM (PEFT-wrapped or not).

    Raises ``ValueError`` for heads that are not a plain bias-free linear map of the final
    hidden state (logit soft-capping, logit scaling, a bias), for which the hidden-state
    path would compute something else than the model does.
    """
    base = _unwrap_peft(model)
    head = base.get_output_embeddings()
    if head is None:
        raise ValueError(f"{type(base).__name__} has no output embeddings (not a causal LM?)")
    if getattr(head, "bias", None) is not None:
        raise ValueError(f"{type(base).__name__}'s LM head has a bias: use the logits path")
    config = getattr(base, "config", None)
    for attr in ("final_logit_softcapping", "logit_scale"):
        if getattr(config, attr, None) not in (None, 1.0):
            raise ValueError(
                f"{type(base).__name__} applies {attr}={getattr(config, attr)} to its logits: "
                "the hidden-state path does not support it, use the logits path"
            )
    # A LoRA adapter on the head itself would change the projection.
    if hasattr(head, "base_layer"):
        raise ValueError("LoRA on the LM head is not supported by the hidden-state path")
    return head.weight


#: Devices where a forward per shared segment pays. It saves the shared tokens' arithmetic
#: at the price of one whole forward (every layer's kernels) per segment: worth it where
#: arithmetic is the cost (a CPU), not on a GPU, where a gpu.toml step ran 15x more
#: operators that way (a bounded single packed forward still shares prefixes there).
SEGMENT_SHARING_DEVICES = ("cpu",)


def last_hidden_states(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    share_prefixes: bool | None = None,
    row_tokens: Sequence[Sequence[int]] | None = None,
    **kwargs: Any,
) -> Tensor:
    """(B, T, H) final hidden states of a Hugging Face causal LM, without computing logits.

    Given ``row_tokens`` on a device of
    :data:`~composer_replication.model.packed_attention.PACKING_DEVICES` (a GPU, the CPU), the
    rows run packed end to end without padding, rows that share a prefix (a group's prompt, a
    pair's agent prompt) holding it once, under a block-sparse mask
    (:mod:`composer_replication.model.packed_attention`). Elsewhere, shared prefixes are computed
    once in one packed forward of the distinct tokens with a dense mask where the model
    allows it, else (on the devices of :data:`SEGMENT_SHARING_DEVICES`) in a forward per
    shared segment (:mod:`composer_replication.model.shared_prefix`). All give the same values up
    to float rounding, gradients included. ``share_prefixes=False`` runs every row in full,
    packed side by side or padded (default: as
    :func:`~composer_replication.model.shared_prefix.prefix_sharing` sets, on).

    ``row_tokens``: each row's real tokens as host lists, the rows right-padded (as packed
    micro-batches and pair rows are): the layout and the padding are then planned from
    them, and nothing is read back from the device (each such read makes a GPU idle). The
    positions each forward computes are recorded for
    :func:`~composer_replication.samples.forward_tokens.counting_forward_tokens`.
    """
    if isinstance(model, AdapterDisabled):
        with model.peft_model.disable_adapter():
            return last_hidden_states(
                model.peft_model,
                input_ids,
                attention_mask,
                share_prefixes=share_prefixes,
                row_tokens=row_tokens,
                **kwargs,
            )
    base = _unwrap_peft(model)
    body = (
        getattr(base, base.base_model_prefix, None) if hasattr(base, "base_model_prefix") else None
    )
    if body is None:
        raise ValueError(f"cannot find the transformer body of {type(base).__name__}")
    from composer_replication.model.packed_attention import (
        packed_forward,
        packed_layout,
        packing_applies,
    )
    from composer_replication.model.shared_prefix import (
        packed_prefix_forward,
        packed_prefix_trie,
        prefix_sharing_enabled,
        prefix_tree,
        shared_prefix_forward,
        tree_forward_tokens,
    )
    from composer_replication.samples.forward_tokens import padded_rows_tokens, record_forward

    if share_prefixes is None:
        share_prefixes = prefix_sharing_enabled()
    config = getattr(base, "config", None)
    if (
        row_tokens is not None
        and not kwargs
        and packing_applies(config, input_ids.device, row_tokens)
    ):
        layout = packed_layout(row_tokens, share=share_prefixes)
        if 0 < len(layout) < input_ids.numel():  # it saves padding or shared tokens
            record_forward(len(layout), 0)
            return packed_forward(body, layout, tuple(input_ids.shape), device=input_ids.device)
    if share_prefixes and not kwargs:
        trie = packed_prefix_trie(config, input_ids, attention_mask, row_tokens=row_tokens)
        if trie is not None:
            additive = getattr(config, "_attn_implementation", None) == "eager"
            record_forward(len(trie), 0)
            return packed_prefix_forward(
                body, trie, tuple(input_ids.shape), device=input_ids.device, additive=additive
            )
        if not _checkpointed(base) and input_ids.device.type in SEGMENT_SHARING_DEVICES:
            # (recomputing layers in backward drops the cache: checkpointed models go row by row)
            tree = prefix_tree(input_ids, attention_mask, row_tokens=row_tokens)
            if tree[0]:
                if row_tokens is not None:
                    lengths = [len(row) for row in row_tokens]
                    record_forward(*tree_forward_tokens(tree, lengths, input_ids.shape[1]))
                return shared_prefix_forward(body, input_ids, attention_mask, tree)
    if row_tokens is not None:
        record_forward(*padded_rows_tokens([len(r) for r in row_tokens], input_ids.shape[1]))
    elif attention_mask is None:  # no padding
        record_forward(input_ids.numel(), 0)
    if row_tokens is not None and not kwargs:
        attention_mask = _right_padded_attention(base, attention_mask, row_tokens)
    out = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
    return out.last_hidden_state


def _right_padded_attention(
    model: Any, attention_mask: Tensor | None, row_tokens: Sequence[Sequence[int]]
) -> Tensor | None:
    """The mask to hand ``model`` for right-padded rows whose lengths the host knows.

    Given a 2-D mask, the model reads on the host whether it holds padding (a GPU waits),
    then builds the (B, 1, T, T) causal-and-padding mask. With padding, that mask is built
    here on the device instead (booleans for SDPA, 0 / dtype-min for eager attention), the
    same values without the read. Without padding the 2-D mask goes through unchanged: the
    model then runs SDPA's causal kernel (flash attention on a GPU), worth more than the one
    read it costs (an explicit mask, or none, costs the kernel or a read of the positions).
    Other attention implementations also get the 2-D mask."""
    import torch

    if attention_mask is None:
        return None
    width = attention_mask.shape[-1]
    if all(len(row) == width for row in row_tokens):
        return attention_mask
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation not in ("sdpa", "eager"):
        return attention_mask
    causal = torch.ones((width, width), dtype=torch.bool, device=attention_mask.device).tril()
    allowed = causal & (attention_mask != 0)[:, None, None, :]
    if implementation == "sdpa":
        return allowed
    dtype = model.get_input_embeddings().weight.dtype
    additive = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
    return additive.masked_fill_(~allowed, torch.finfo(dtype).min)


def _checkpointed(model: Any) -> bool:
    """Whether activation checkpointing is on in any of ``model``'s layers."""
    return any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules())


def _unwrap_peft(model: Any) -> Any:
    if isinstance(model, AdapterDisabled):
        model = model.peft_model
    # PeftModel -> LoraModel -> the transformers model (whose layers carry the adapters).
    if hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model
