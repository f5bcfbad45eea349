"""Pieces of a Hugging Face causal LM the hidden-state losses need: the LM-head weight and
the transformer body's final hidden states (PEFT-wrapped models included)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import Tensor


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
    model: Any, input_ids: Tensor, attention_mask: Tensor | None = None, **kwargs: Any
) -> Tensor:
    """(B, T, H) final hidden states of a Hugging Face causal LM, without computing logits."""
    base = _unwrap_peft(model)
    body = (
        getattr(base, base.base_model_prefix, None) if hasattr(base, "base_model_prefix") else None
    )
    if body is None:
        raise ValueError(f"cannot find the transformer body of {type(base).__name__}")
    out = body(input_ids=input_ids, attention_mask=attention_mask, use_cache=False, **kwargs)
    return out.last_hidden_state


def _unwrap_peft(model: Any) -> Any:
    # PeftModel -> LoraModel -> the transformers model (whose layers carry the adapters).
    if hasattr(model, "get_base_model"):
        return model.get_base_model()
    return model
