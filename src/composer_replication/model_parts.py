"""Pieces of a Hugging Face causal LM the hidden-state losses need: the LM-head weight and
the transformer body's final hidden states (PEFT-wrapped models included), and the
adapter-free view of a LoRA policy that serves as its frozen initial policy."""

from __future__ import annotations

from collections.abc import Iterator
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

    layers = [m for m in model.modules() if _is_unmerged_lora(m)]
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


def _is_unmerged_lora(module: Any) -> bool:
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


def last_hidden_states(
    model: Any,
    input_ids: Tensor,
    attention_mask: Tensor | None = None,
    *,
    share_prefixes: bool | None = None,
    **kwargs: Any,
) -> Tensor:
    """(B, T, H) final hidden states of a Hugging Face causal LM, without computing logits.

    Rows that share a prefix (a group's prompt, a pair's agent prompt) compute it once, in
    one packed forward of their distinct tokens where the model allows it, else a forward
    per shared segment (:mod:`composer_replication.shared_prefix`; same values up to float
    rounding, gradients included); ``share_prefixes=False`` runs every row in full (default: as
    :func:`~composer_replication.shared_prefix.prefix_sharing` sets, on).
    """
    if isinstance(model, AdapterDisabled):
        with model.peft_model.disable_adapter():
            return last_hidden_states(
                model.peft_model,
                input_ids,
                attention_mask,
                share_prefixes=share_prefixes,
                **kwargs,
            )
    base = _unwrap_peft(model)
    body = (
        getattr(base, base.base_model_prefix, None) if hasattr(base, "base_model_prefix") else None
    )
    if body is None:
        raise ValueError(f"cannot find the transformer body of {type(base).__name__}")
    from composer_replication.shared_prefix import (
        packed_prefix_forward,
        packed_prefix_trie,
        prefix_sharing_enabled,
        prefix_tree,
        shared_prefix_forward,
    )

    if share_prefixes is None:
        share_prefixes = prefix_sharing_enabled()
    if share_prefixes and not kwargs:
        config = getattr(base, "config", None)
        trie = packed_prefix_trie(config, input_ids, attention_mask)
        if trie is not None:
            additive = getattr(config, "_attn_implementation", None) == "eager"
            return packed_prefix_forward(
                body, trie, tuple(input_ids.shape), device=input_ids.device, additive=additive
            )
        if not _checkpointed(base):
            # (recomputing layers in backward drops the cache: checkpointed models go row by row)
            tree = prefix_tree(input_ids, attention_mask)
            if tree[0]:
                return shared_prefix_forward(body, input_ids, attention_mask, tree)
    out = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
    return out.last_hidden_state


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
