"""The loss components, declared once: what each trains on, how it counts, what computes it.

Every training signal reaches the trainer as per-token weights on a set of loss components
(the built-in ``rl``, ``ce``, ``ref_kl``, ``jsd`` and ``dpo``, and any a user registers).
The packer (:mod:`composer_replication.samples.wire`), the per-component counts, the loss assembler
(:mod:`composer_replication.ops.assembler`), the step's metric names (``loss/<name>``,
``tokens/<name>``) and ``[loss] coefficients`` all loop over :func:`loss_components`; none
of them names a component. Each component's mean is normalised by its own count, so
components never dilute each other.

A new term is one module: declare a :class:`LossComponent` whose ``compute`` names a
function of :class:`~composer_replication.ops.assembler.ComponentInputs`, call
:func:`register_component` at import, and have an algorithm stamp the component's weight
stream on its samples (``TrainingSample.weights[stream]``). This module is declarations
only (no torch): the config layer reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

__all__ = [
    "LossComponent",
    "component_names",
    "loss_components",
    "register_component",
    "unregister_component",
]


@dataclass(frozen=True)
class LossComponent:
    """One term of the loss.

    Attributes:
        name: the component's name (``[loss] coefficients`` key, metric suffix).
        stream: the per-token weight stream it trains on: a ``TrainingSample`` field for the
            built-in components, a key of ``TrainingSample.weights`` for registered ones;
            None for a component counted per preference pair (``dpo``).
        counts: which tokens count toward its normaliser: ``"weighted"`` every token with a
            non-zero weight, ``"trainable"`` only those the policy sampled (``loss_mask``),
            ``"pairs"`` every preference pair with a non-zero weight.
        absent: what a sample without the stream means: ``"off"`` (no token of the sample
            trains it) or ``"trainable"`` (weight 1 on every trainable token, as ``rl``).
        head_tokens: its tokens need the policy's log-probs from the head (the head computes
            a log-prob only where some such stream has a weight).
        compute: ``"package.module:function"`` of ``fn(inputs) -> Tensor | None``: the
            component's unnormalised sum over a micro-batch (None when it has nothing there).
    """

    name: str
    stream: str | None
    counts: Literal["weighted", "trainable", "pairs"]
    compute: str
    absent: Literal["off", "trainable"] = "off"
    head_tokens: bool = True

    def __post_init__(self) -> None:
        if not self.name.isidentifier():
            raise ValueError(f"loss component name {self.name!r} must be an identifier")
        if (self.stream is None) != (self.counts == "pairs"):
            raise ValueError(
                f"loss component {self.name!r}: a stream is counted per token "
                f"('weighted' or 'trainable'), a pair component has stream None; got "
                f"stream={self.stream!r}, counts={self.counts!r}"
            )
        if ":" not in self.compute:
            raise ValueError(
                f"loss component {self.name!r}: compute={self.compute!r} must be "
                "'package.module:function'"
            )


_ASSEMBLER = "composer_replication.ops.assembler"

#: The built-in components, in the order they are computed and summed.
_BUILTIN = (
    LossComponent("rl", "rl_weights", "trainable", f"{_ASSEMBLER}:rl_term", absent="trainable"),
    LossComponent("ce", "ce_weights", "weighted", f"{_ASSEMBLER}:ce_term"),
    LossComponent("ref_kl", "ref_kl_weights", "trainable", f"{_ASSEMBLER}:ref_kl_term"),
    LossComponent("jsd", "jsd_weights", "weighted", f"{_ASSEMBLER}:jsd_term", head_tokens=False),
    LossComponent("dpo", None, "pairs", f"{_ASSEMBLER}:dpo_term", head_tokens=False),
)
BUILTIN_NAMES = tuple(c.name for c in _BUILTIN)

_registry: dict[str, LossComponent] = {c.name: c for c in _BUILTIN}


def loss_components() -> tuple[LossComponent, ...]:
    """Every component, built-in ones first, then registered ones in registration order."""
    return tuple(_registry.values())


def component_names() -> tuple[str, ...]:
    """The names of :func:`loss_components`."""
    return tuple(_registry)


def register_component(component: LossComponent) -> LossComponent:
    """Add ``component`` (idempotent for the same declaration; a different component under a
    taken name or stream is a ``ValueError``). Returns it, so a module can write
    ``MY_TERM = register_component(LossComponent(...))``."""
    known = _registry.get(component.name)
    if known == component:
        return component
    if known is not None:
        raise ValueError(
            f"loss component {component.name!r} is already registered as {known}; pick another name"
        )
    taken = {c.stream: c.name for c in _registry.values() if c.stream is not None}
    if component.stream in taken:
        raise ValueError(
            f"loss component {component.name!r}: stream {component.stream!r} already "
            f"belongs to {taken[component.stream]!r}; give it a stream of its own"
        )
    _registry[component.name] = component
    return component


def unregister_component(name: str) -> None:
    """Remove a registered component (built-in ones stay)."""
    if name in BUILTIN_NAMES:
        raise ValueError(f"loss component {name!r} is built in and cannot be removed")
    _registry.pop(name, None)
