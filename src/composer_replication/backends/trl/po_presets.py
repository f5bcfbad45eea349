"""Policy-optimisation presets for trl's ``GRPOConfig``: one name per published objective.

trl's ``GRPOTrainer`` implements a family of group-relative objectives behind three knobs:
``loss_type`` (how per-token terms are clipped and aggregated), ``scale_rewards`` (how the
group baseline is normalised) and ``importance_sampling_level`` (token or sequence ratios).
``PO_OBJECTIVES`` maps each objective to the knob values its paper uses; ``make_po_config``
builds a ``GRPOConfig`` from a preset plus overrides and checks that every knob really
landed (a trl upgrade that renames or rewrites a knob fails loudly, never silently).

Menu (paper, arXiv id):

- ``grpo``: DeepSeekMath GRPO (2402.03300): per-sequence mean, std-scaled group advantage.
- ``dr_grpo`` (default, Composer's choice): Dr. GRPO (2503.20783): sum over tokens / a
  constant (``max_completion_length``), no std scaling: no length or difficulty bias.
- ``bnpo``: per-token mean over the local batch, batch-std scaling ("PPO Lite",
  2508.08221, as trl's docstring cites for ``scale_rewards="batch"``).
- ``dapo``: DAPO (2503.14476): clip-higher (epsilon_high = 0.28), truncated completions
  masked, token mean over the accumulated batch, no KL term.
- ``gspo``: GSPO (2507.18071): sequence-level importance ratios with the GRPO aggregation.
- ``cispo``: MiniMax-M1 CISPO (2506.13585): clipped, stop-gradient IS weights times
  log-prob; epsilon_max = 5.0 as in ScaleRL (2510.13786).
- ``sapo``: SAPO (2511.20347): a sigmoid soft gate instead of hard clipping.
- ``luspo``: LUSPO (2602.05261): GSPO with each sequence's loss scaled by its length.
- ``vespo``: VESPO (2602.10693): a Gamma-shaped soft weight on sequence-level IS ratios.

KL to the reference. trl adds ``beta * k3`` per token to the loss, with the k3 estimator
``exp(lp_ref - lp) - (lp_ref - lp) - 1`` (Schulman, "Approximating KL divergence", 2020):
unbiased for KL(pi || ref) on samples from pi and never negative, but as a *loss* its
gradient is not the gradient of the KL. Composer instead uses k1, ``lp - lp_ref``, folded
into the per-token policy-gradient signal (``ops.token_losses.ref_kl_loss`` treats
``stopgrad(lp_ref - lp)`` as a reward), whose expected gradient is the reverse-KL gradient.
Every preset keeps trl's default ``beta = 0`` (no KL term, no reference model): Composer's
KL control lives in the held-out guard (``safety.HeldOutGuard``), not in the loss.
"""

from __future__ import annotations

import dataclasses
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Mapping

    from trl import GRPOConfig

__all__ = [
    "PO_OBJECTIVES",
    "PO_PAPERS",
    "machine_defaults",
    "make_dr_grpo_config",
    "make_po_config",
]


def _preset(**knobs: Any) -> Mapping[str, Any]:
    return MappingProxyType(knobs)


PO_OBJECTIVES: dict[str, Mapping[str, Any]] = {
    "grpo": _preset(loss_type="grpo", scale_rewards="group", importance_sampling_level="token"),
    "dr_grpo": _preset(loss_type="dr_grpo", scale_rewards="none"),
    "bnpo": _preset(loss_type="bnpo", scale_rewards="batch"),
    "dapo": _preset(
        loss_type="dapo",
        scale_rewards="none",
        epsilon_high=0.28,
        mask_truncated_completions=True,
        beta=0.0,
    ),
    "gspo": _preset(loss_type="grpo", scale_rewards="group", importance_sampling_level="sequence"),
    "cispo": _preset(loss_type="cispo", scale_rewards="none", epsilon_high=5.0),
    "sapo": _preset(loss_type="sapo", scale_rewards="group", importance_sampling_level="token"),
    "luspo": _preset(
        loss_type="luspo", scale_rewards="group", importance_sampling_level="sequence"
    ),
    "vespo": _preset(loss_type="vespo", scale_rewards="group", importance_sampling_level="token"),
}
"""Objective name -> the ``GRPOConfig`` knobs it sets (read-only mappings)."""

PO_PAPERS: dict[str, str] = {
    "grpo": "arXiv:2402.03300",
    "dr_grpo": "arXiv:2503.20783",
    "bnpo": "arXiv:2508.08221",
    "dapo": "arXiv:2503.14476",
    "gspo": "arXiv:2507.18071",
    "cispo": "arXiv:2506.13585",
    "sapo": "arXiv:2511.20347",
    "luspo": "arXiv:2602.05261",
    "vespo": "arXiv:2602.10693",
}
"""Objective name -> the paper that defines it."""

# Knobs make_dr_grpo_config pins in addition to the dr_grpo preset.
_DR_GRPO_FORCED: Mapping[str, Any] = MappingProxyType(
    {**PO_OBJECTIVES["dr_grpo"], "num_iterations": 1}
)
# trl documents these aliases of scale_rewards; normalised before building the config so
# that "did the knob apply?" compares like with like.
_SCALE_ALIASES = {True: "group", False: "none"}


def make_po_config(objective: str = "dr_grpo", **overrides: Any) -> GRPOConfig:
    """A ``trl.GRPOConfig`` for ``objective`` (a ``PO_OBJECTIVES`` key) plus ``overrides``.

    Overrides win over the preset (``make_po_config("dapo", epsilon_high=0.3)``); every
    other keyword goes to ``GRPOConfig`` as is (``output_dir``, ``learning_rate``, ...).
    Device and precision follow the machine unless given (:func:`machine_defaults`: on a
    CPU, ``use_cpu=True, bf16=False``).

    Raises:
        ValueError: ``objective`` is not on the menu (the message lists it).
        AssertionError: the installed trl lacks a knob the preset sets, does not document
            its ``loss_type``, or the built config holds another value than requested.
    """
    if objective not in PO_OBJECTIVES:
        menu = ", ".join(f"{name} ({PO_PAPERS[name]})" for name in PO_OBJECTIVES)
        raise ValueError(f"unknown objective {objective!r}; choose one of: {menu}")
    knobs = {**PO_OBJECTIVES[objective], **_pick(overrides, PO_OBJECTIVES[objective])}
    return _build(knobs, overrides, label=f"objective {objective!r}")


def make_dr_grpo_config(**overrides: Any) -> GRPOConfig:
    """A ``trl.GRPOConfig`` for Dr. GRPO (arXiv 2503.20783), Composer's objective.

    Forces ``loss_type="dr_grpo"``, ``scale_rewards="none"`` and ``num_iterations=1``
    (one gradient step per generation: on-policy, so the clipped ratio is 1) unless
    ``overrides`` sets them, then asserts that they applied. Device and precision follow
    the machine unless given (:func:`machine_defaults`).
    """
    knobs = {**_DR_GRPO_FORCED, **_pick(overrides, _DR_GRPO_FORCED)}
    return _build(knobs, overrides, label="make_dr_grpo_config")


def _pick(overrides: Mapping[str, Any], preset: Mapping[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in overrides.items() if k in preset}


def machine_defaults(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """Device and precision settings for the machine the config is built on, unless given.

    trl defaults to bf16 autocast, which raises on a machine without a bf16-capable GPU;
    on such a machine (a CPU, or a GPU without bf16) the trainer runs in the model's own
    dtype (``bf16=False``), and without any GPU it runs on the CPU (``use_cpu=True``).
    """
    import torch

    out: dict[str, Any] = {}
    has_cuda = torch.cuda.is_available()
    if "use_cpu" not in overrides and not has_cuda:
        out["use_cpu"] = True
    if "bf16" not in overrides and not (has_cuda and torch.cuda.is_bf16_supported()):
        out["bf16"] = False
    return out


def _build(knobs: dict[str, Any], overrides: Mapping[str, Any], *, label: str) -> GRPOConfig:
    from trl import GRPOConfig

    overrides = {**machine_defaults(overrides), **overrides}

    if "scale_rewards" in knobs:
        knobs["scale_rewards"] = _SCALE_ALIASES.get(knobs["scale_rewards"], knobs["scale_rewards"])
    _check_against_trl(GRPOConfig, knobs, label)
    config = GRPOConfig(**{**overrides, **knobs})
    wrong = {k: (v, getattr(config, k)) for k, v in knobs.items() if getattr(config, k) != v}
    if wrong:
        detail = ", ".join(f"{k}: asked {a!r}, got {b!r}" for k, (a, b) in wrong.items())
        raise AssertionError(
            f"{label}: GRPOConfig did not apply {detail}; the installed trl "
            f"({_trl_version()}) rewrites these knobs: check its GRPOConfig.__post_init__ or "
            "pin trl==1.16.*"
        )
    return config


def _check_against_trl(config_cls: type, knobs: Mapping[str, Any], label: str) -> None:
    """Drift guard: each knob is a field of the installed GRPOConfig, and trl documents
    the requested ``loss_type`` as supported."""
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    missing = sorted(k for k in knobs if k not in fields)
    if missing:
        raise AssertionError(
            f"{label}: the installed trl ({_trl_version()}) GRPOConfig has no field(s) "
            f"{missing}; pin trl==1.16.* or update composer_replication.backends.trl.po_presets"
        )
    loss_type = knobs.get("loss_type")
    documented = str(fields["loss_type"].metadata.get("help", ""))
    if loss_type is not None and f"'{loss_type}'" not in documented:
        raise AssertionError(
            f"{label}: loss_type={loss_type!r} is not among the loss types the installed trl "
            f"({_trl_version()}) documents; pin trl==1.16.* or pick another objective"
        )


def _trl_version() -> str:
    import trl

    return f"trl {getattr(trl, '__version__', 'unknown')}"
