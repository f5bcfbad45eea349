"""``LossConfig``: the settings of the trainer's loss components (the ``[loss]`` table).

One owner per knob: the loss computation settings live here, under the names the seed API
uses for the same knobs (``compose_loss`` and ``ComposerReplicationTrainer``:
``sdpo_jsd_beta``, ``sdpo_temperature``, ``sdpo_token_clip``, ``sdpo_wrapper``, ``taid_t``,
``entropy_opd_h_max``, ``replay_dpo_beta``, ``dpo_variant``, ``simpo_beta``,
``simpo_gamma``). An algorithm may require a value (for example ``replay_dpo`` with
``dpo_variant = "simpo"``); the run config then fills it in here, and a value the user set
explicitly to something else is an error naming both (``RunConfig`` validation).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from composer_replication.config.advantage import IMPORT_PATH_PATTERN
from composer_replication.config.components import BUILTIN_NAMES, component_names
from composer_replication.config.deprecation import rename_deprecated

#: The built-in loss components (every registered one: ``config.components.component_names``).
COMPONENTS = BUILTIN_NAMES

#: The knobs of the self-distillation channel (the jsd component), named alike in
#: ``compose_loss``, ``ComposerReplicationTrainer`` and the ``[loss]`` table.
DIVERGENCE_KNOBS = (
    "sdpo_jsd_beta",
    "sdpo_temperature",
    "sdpo_token_clip",
    "sdpo_wrapper",
    "taid_t",
    "entropy_opd_h_max",
)
#: The knobs of the trace-replay channel (the dpo component), named alike there too.
PAIR_KNOBS = ("dpo_variant", "replay_dpo_beta", "simpo_beta", "simpo_gamma")

#: Old spelling -> current name.
LOSS_RENAMES = {
    "jsd_beta": "sdpo_jsd_beta",
    "jsd_temperature": "sdpo_temperature",
    "dpo_beta": "replay_dpo_beta",
    "dpo_loss": "dpo_variant",
}


class LossConfig(BaseModel):
    """Settings of the loss components ``rl``, ``ce``, ``ref_kl``, ``jsd`` and ``dpo``.

    ``type`` picks the ``rl`` component: ``"default"`` (DPPO trust region + log-ratio
    penalty, set by the knobs below) or ``"custom"``: a user function named by
    ``import_path``, called as ``fn(logprobs, inference_logprobs, advantages, loss_mask,
    weights, **kwargs)`` on (B, T-1) tensors and returning the rl sum over the batch's tokens
    (a 0-d tensor, or a tuple whose first item is that sum); the trainer divides it by the rl
    token count, as it does the default's. The other components are fixed.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["default", "custom"] = Field(
        "default", description="rl component: 'default' (DPPO + KL) or 'custom' (import_path)."
    )
    import_path: str | None = Field(
        None,
        pattern=IMPORT_PATH_PATTERN,
        description="type = 'custom': 'package.module:function' of the rl loss.",
    )
    kwargs: dict[str, Any] = Field(
        default_factory=dict,
        description="type = 'custom': keyword arguments passed to the rl loss function.",
    )

    mask_low: float = Field(
        0.2, ge=0, description="DPPO trust region below: drop A<=0 tokens with dp < -mask_low."
    )
    mask_high: float = Field(
        0.2, ge=0, description="DPPO trust region above: drop A>0 tokens with dp > mask_high."
    )
    adv_tau: float = Field(1.0, ge=0, description="Scale of the advantage term of rl.")
    kl_tau: float = Field(1e-3, ge=0, description="Weight of the log-ratio^2 penalty (rl, ref_kl).")
    temperature: float | None = Field(
        None,
        gt=0,
        description="Temperature of the trainer's log-probs (logits / temperature); null: the "
        "environments' sampling.temperature, which it must equal.",
    )
    sdpo_jsd_beta: float = Field(
        0.5, ge=0, le=1, description="jsd: generalized JSD mixture (0 forward KL, 1 reverse KL)."
    )
    sdpo_temperature: float = Field(
        1.0, gt=0, description="jsd: softmax temperature of student and teacher."
    )
    sdpo_token_clip: float | None = Field(
        None, gt=0, description="jsd: clamp each token's divergence to this (null: no clamp)."
    )
    sdpo_top_k: int | None = Field(
        None,
        ge=1,
        description="jsd (generalized JSD only): compare over the teacher's top-k tokens plus "
        "one tail bucket holding the rest of each distribution's mass (SDPO, arXiv "
        "2601.20802); null: the whole vocabulary.",
    )
    sdpo_wrapper: Literal["none", "taid", "entropy_opd"] = Field(
        "none",
        description="jsd divergence: 'none' (generalized JSD), 'taid' (TAID, arXiv "
        "2501.16937) or 'entropy_opd' (entropy-aware OPD, arXiv 2603.07079).",
    )
    taid_t: float | None = Field(
        None,
        ge=0,
        le=1,
        description="TAID interpolation t; null: TAIDScheduler over the run's steps, from "
        "taid_t_start to taid_t_end, driven by the jsd loss.",
    )
    taid_t_start: float = Field(0.4, ge=0, le=1, description="TAID schedule's first t.")
    taid_t_end: float = Field(1.0, ge=0, le=1, description="TAID schedule's last t.")
    entropy_opd_h_max: float | None = Field(
        None,
        gt=0,
        description="Entropy-aware OPD: entropy where forward KL takes over (null: log V).",
    )
    replay_dpo_beta: float = Field(0.1, gt=0, description="dpo: DPO beta.")
    dpo_variant: Literal["dpo", "simpo"] = Field(
        "dpo", description="dpo: 'dpo' (against reference log-probs) or 'simpo' (reference-free)."
    )
    simpo_beta: float = Field(
        2.0, gt=0, description="dpo: SimPO reward scale (dpo_variant='simpo')."
    )
    simpo_gamma: float = Field(1.0, ge=0, description="dpo: SimPO margin (dpo_variant='simpo').")
    lm_ce_label_smoothing: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="ce: label smoothing in [0, 1) (torch's cross-entropy convention); needs "
        "ce weights of 0 or 1.",
    )
    coefficients: dict[str, float] = Field(
        default_factory=lambda: dict.fromkeys(COMPONENTS, 1.0),
        description="Multiplier of each component's mean (rl, ce, ref_kl, jsd, dpo), on top of "
        "the per-token weights the algorithms set (e.g. composer's alpha_sdpo on jsd).",
    )
    kl_token_trust_threshold: float | None = Field(
        None,
        ge=0,
        description="Mask ref_kl tokens whose k2 estimate to the reference exceeds this.",
    )
    chunk_size: int | None = Field(
        None, ge=1, description="Rows per chunk on the hidden-state path."
    )

    @model_validator(mode="before")
    @classmethod
    def _old_spellings(cls, data: Any) -> Any:
        return rename_deprecated(data, LOSS_RENAMES, "loss")

    @model_validator(mode="after")
    def _check(self) -> LossConfig:
        known = component_names()
        unknown = set(self.coefficients) - set(known)
        if unknown:
            raise ValueError(
                f"loss.coefficients names unknown components {sorted(unknown)}; known: {known}"
            )
        if self.type == "custom" and self.import_path is None:
            raise ValueError(
                "loss.type = 'custom' needs loss.import_path = 'package.module:function' "
                "(the rl loss function)"
            )
        if self.type == "default" and (self.import_path is not None or self.kwargs):
            raise ValueError(
                "loss.import_path / loss.kwargs are set but loss.type = 'default': set "
                "loss.type = 'custom' to use that function, or remove them"
            )
        if self.taid_t_start > self.taid_t_end:
            raise ValueError(
                f"loss.taid_t_start = {self.taid_t_start} is above taid_t_end = {self.taid_t_end}"
            )
        if self.sdpo_top_k is not None and self.sdpo_wrapper != "none":
            raise ValueError(
                f"loss.sdpo_top_k = {self.sdpo_top_k} works with the generalized JSD only: "
                f"unset it or set sdpo_wrapper = 'none' (not {self.sdpo_wrapper!r})"
            )
        return self

    @classmethod
    def from_knobs(cls, **knobs: Any) -> LossConfig:
        """The config of these keyword knobs (``compose_loss``'s and the trl trainer's
        arguments); a bad value is a one-line ``ValueError`` naming it."""
        from pydantic import ValidationError

        try:
            return cls(**knobs)
        except ValidationError as err:
            first = err.errors()[0]
            name = ".".join(str(part) for part in first["loc"])
            value = knobs.get(name, first.get("input"))
            raise ValueError(f"{name}={value!r}: {first['msg']}") from None

    def coefficient(self, component: str) -> float:
        """The multiplier of ``component``'s mean (1.0 when not listed)."""
        if component not in component_names():
            raise ValueError(f"unknown loss component {component!r}; known: {component_names()}")
        return float(self.coefficients.get(component, 1.0))

    @property
    def log_temperature(self) -> float:
        """The temperature of the trainer's log-probs (1.0 before the run resolves it)."""
        return 1.0 if self.temperature is None else float(self.temperature)


def loss_default(name: str) -> Any:
    """The default of the seed API's loss knob ``name`` (``compose_loss``, the trl trainer):
    a :class:`LossConfig` field, or the composer recipe's channel weights ``alpha_sdpo`` /
    ``beta_replay``. The functions' signatures read their defaults here, so each is written
    once, on its config field."""
    if name in LossConfig.model_fields:
        return LossConfig.model_fields[name].default
    from composer_replication.config.advantage import ComposerAdvantage

    return ComposerAdvantage.model_fields[name].default
