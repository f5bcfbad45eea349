"""Shard a causal LM with FSDP2 (``torch.distributed.fsdp.fully_shard``) for data parallelism.

Each decoder layer is one FSDP unit; the transformer body (``model.model``: embeddings,
final norm, and through weight tying the LM head) is the root unit. The body, not the
``*ForCausalLM`` wrapper, is the root because the trainer step calls the body's forward
and applies the head itself on hidden states (:mod:`composer_replication.ops.head`): the
root's parameters are gathered in the body's forward and, as FSDP2 does for a root, stay
gathered until backward, so the head reads the full tied weight. A model with an untied
``lm_head`` outside the body is refused (its weight would never be gathered).

Gradients are SUMMED over ranks (divide factor 1), not averaged: the trainer step divides
each component by its global token count (:mod:`.counts`), so each rank's gradient is
already its share of the whole batch's mean.

Ranks run different numbers of forwards (each samples, packs and grades its own share:
decode lengths, micro-batch counts, teacher forwards differ), while FSDP2 all-gathers in
every forward. :class:`GatheredWeights` therefore gathers every unit once (the same
collective on every rank), runs the rank's forwards and backwards with no communication
(gradients accumulate unsharded), and reduces the gradients in one final backward that
every rank runs exactly once.

LoRA: the adapters live inside the decoder layers, so they are sharded with their layer;
frozen base weights are sharded too (FSDP2 shards per parameter and reduces only the
trainable ones).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from composer_replication.model.devices import Precision

__all__ = ["GatheredWeights", "NoSharding", "gathered_policy", "shard_policy"]


def _tied_head_class() -> type:
    import torch

    class TiedHead(torch.nn.Module):
        """An LM head that reads the input embedding's CURRENT weight on every use.

        FSDP2 swaps the embedding's parameter between its sharded and gathered forms; a head
        outside the sharded body holding the old parameter object would silently train a
        stale, unsynchronised copy. This head holds no parameter of its own.
        """

        def __init__(self, embedding: torch.nn.Module) -> None:
            super().__init__()
            object.__setattr__(self, "_embedding", embedding)  # not a child: no double owner

        @property
        def weight(self) -> torch.Tensor:
            return self._embedding.weight

        bias = None

        def forward(self, hidden: torch.Tensor) -> torch.Tensor:
            return torch.nn.functional.linear(hidden, self.weight)

    return TiedHead


def _body_and_layers(policy: Any) -> tuple[Any, Any, list[Any]]:
    from composer_replication.model.parts import _unwrap_peft

    base = _unwrap_peft(policy)
    body = getattr(base, getattr(base, "base_model_prefix", "model"), None)
    layers = getattr(body, "layers", None)
    if body is None or layers is None:
        raise ValueError(
            f"cannot shard {type(base).__name__}: expected a transformers causal LM whose "
            "body (model.model) holds its decoder layers in .layers"
        )
    head = getattr(base, "lm_head", None)
    embed = getattr(body, "embed_tokens", None)
    if head is not None and embed is not None and head.weight is not embed.weight:
        raise ValueError(
            f"cannot shard {type(base).__name__}: its lm_head is not tied to the input "
            "embeddings, and the trainer applies the head outside the body's forward; "
            "train it in one process, or tie the embeddings"
        )
    return base, body, list(layers)


def shard_policy(policy: Any, *, precision: Precision | None = None) -> Any:
    """Shard ``policy`` in place over the default process group; return it.

    ``precision`` with a compute dtype becomes FSDP2's ``MixedPrecisionPolicy``
    (parameters gathered in that dtype, gradients reduced in float32); the sharded master
    parameters keep their dtype.
    """
    import torch
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    base, body, layers = _body_and_layers(policy)
    mp = MixedPrecisionPolicy()
    if precision is not None and precision.compute_dtype is not None:
        mp = MixedPrecisionPolicy(param_dtype=precision.compute_dtype, reduce_dtype=torch.float32)
    for layer in layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(body, mp_policy=mp)
    if getattr(base, "lm_head", None) is not None:
        base.lm_head = _tied_head_class()(body.embed_tokens)
    for module in policy.modules():
        if isinstance(module, FSDPModule):
            module.set_gradient_divide_factor(1.0)
            # plain SUM reductions (gloo has no pre-multiplied sum)
            module.set_force_sum_reduction_for_comms(True)
    return policy


def gathered_policy(policy: Any, *, writer: bool) -> Any | None:
    """A plain (unsharded, host) copy of a sharded ``policy`` on the ``writer`` rank, None
    on the others. A collective: every rank calls it. LoRA adapters are kept (saving
    merges them); the tied head is tied again."""
    import torch
    from transformers import AutoModelForCausalLM

    from composer_replication.model.parts import _unwrap_peft

    whole = {}
    for name, value in policy.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        whole[name] = full.detach().to("cpu", copy=True)
    if not writer:
        return None
    base = _unwrap_peft(policy)
    plain = AutoModelForCausalLM.from_config(
        base.config, dtype=next(iter(whole.values())).dtype, attn_implementation="sdpa"
    )
    peft_config = getattr(policy, "peft_config", None)
    if peft_config:
        from peft import get_peft_model

        plain = get_peft_model(plain, peft_config["default"])
    missing, unexpected = plain.load_state_dict(whole, strict=False)
    if unexpected or any(not key.endswith("lm_head.weight") for key in missing):
        raise RuntimeError(
            f"gathered state does not fit the model: missing {missing[:3]}, unexpected "
            f"{unexpected[:3]}"
        )
    _unwrap_peft(plain).tie_weights()
    if getattr(base, "generation_config", None) is not None:
        _unwrap_peft(plain).generation_config = base.generation_config
    return plain.to(torch.device("cpu"))


class GatheredWeights:
    """Collective-free phases of a sharded policy (see the module docstring)."""

    def __init__(self, policy: Any) -> None:
        from torch.distributed.fsdp import FSDPModule

        self.policy = policy
        self.units = [m for m in policy.modules() if isinstance(m, FSDPModule)]

    def _hold(self, hold: bool) -> None:
        for unit in self.units:
            unit.set_reshard_after_forward(not hold, recurse=False)
            unit.set_reshard_after_backward(not hold, recurse=False)

    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Every unit gathered for the block (one all-gather per unit, on every rank); the
        block's forwards (sampling, scoring, evaluation) communicate nothing."""
        import torch.distributed as dist

        from composer_replication.distributed.setup import lost_peer_error

        self._hold(True)
        try:
            for unit in self.units:
                unit.unshard()
        except (RuntimeError, dist.DistError) as err:
            raise lost_peer_error("gathering the sharded weights") from err
        try:
            yield
        finally:
            for unit in self.units:
                unit.reshard()
            self._hold(False)

    @contextlib.contextmanager
    def accumulating(self) -> Iterator[None]:
        """Forwards and backwards of the block accumulate gradients locally; on exit one
        zero-loss backward on every rank reduce-scatters them (summed over ranks)."""
        import torch.distributed as dist

        from composer_replication.distributed.setup import lost_peer_error

        with self.gathered():
            for unit in self.units:
                unit.set_requires_gradient_sync(False, recurse=False)
            try:
                yield
            finally:
                for unit in self.units:
                    unit.set_requires_gradient_sync(True, recurse=False)
            try:
                self._reduce()
            except (RuntimeError, dist.DistError) as err:
                raise lost_peer_error("reducing the step's gradients") from err

    def _reduce(self) -> None:
        import torch

        from composer_replication.model.parts import last_hidden_states, lm_head_weight

        device = lm_head_weight(self.policy).device
        ids = torch.zeros((1, 1), dtype=torch.long, device=device)
        hidden = last_hidden_states(self.policy, ids, share_prefixes=False)
        weight = lm_head_weight(self.policy)
        (0.0 * hidden.sum() + 0.0 * weight.sum()).backward()


class NoSharding:
    """:class:`GatheredWeights`' interface for a policy in one process: nothing to do."""

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def accumulating(self) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()
