"""``AlgorithmConfig``: how one environment's rollouts are sampled and turned into signal.

Shape (as PRIME-RL's algorithm configs after its PR #2746)::

    [sampling]
    source = "policy"          # or {name, base_url[, api_key_env]} / {name, local_path}
                               # or "reference" (the environment's reference solutions)
    group_size = 4
    [advantage]
    type = "grpo"              # grpo | max_rl | reward | custom | opd | opsd | sdpo | sft
                               # | echo | replay_dpo | composer | "pkg.mod:Class" (a user's
                               # Algorithm subclass); then the type's own fields

A top-level ``model`` (alias ``teacher``) is shorthand that folds into the slot the type
declares (opd / opsd -> ``advantage.model``, sft -> ``sampling.source``); after folding it
is None, so ``to_toml`` writes the canonical form. Validation at config time, each error
saying what to change:
- opd against ``"policy"`` (or without a teacher) -> rejected: the KL is 0;
- a frozen sampling source feeding a type that trains ``rl`` (``needs_policy_logprobs``)
  -> rejected: no policy log-probs to form the importance ratio;
- sft sampling from ``"policy"`` -> rejected;
- ``"reference"`` (reference solutions as demonstrations) feeding anything but sft ->
  rejected; its group is the one demonstration (``group_size`` 1 when left out, another
  value rejected);
- a ``group_relative`` type with ``group_size = 1`` -> a loud ``UserWarning`` (all
  advantages are 0);
- a frozen reference without ``base_url`` / ``local_path`` -> parse error.
"""

from __future__ import annotations

import sys
import warnings
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from composer_replication.config.advantage import AdvantageConfig, GRPOAdvantage
from composer_replication.config.references import (
    REFERENCE_SOLUTIONS,
    ModelReference,
    SamplingSource,
    is_frozen,
)
from composer_replication.config.toml_writer import dumps

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10 needs the tomli backport
    import tomli as tomllib


class SamplingConfig(BaseModel):
    """Who generates the rollouts and how many per task."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    source: SamplingSource = Field(
        "policy",
        description="Sampling model: 'policy', a frozen model (sft only), or 'reference': the "
        "environment's reference solutions as demonstrations (sft only; the environment "
        "must give them, as python_functions does).",
    )
    group_size: int = Field(
        4, ge=1, le=1_000_000, description="Rollouts per task (the advantage group)."
    )
    temperature: float = Field(1.0, gt=0, description="Sampling temperature.")
    max_new_tokens: int = Field(256, ge=1, le=10_000_000, description="Generation budget per turn.")


class AlgorithmConfig(BaseModel):
    """Sampling + advantage (the algorithm, by ``advantage.type``) of one environment."""

    model_config = ConfigDict(
        extra="forbid", allow_inf_nan=False, validate_by_name=True, validate_by_alias=True
    )

    sampling: SamplingConfig = Field(
        default_factory=SamplingConfig, description="Who samples and how many per task."
    )
    advantage: AdvantageConfig = Field(
        default_factory=GRPOAdvantage, description="The algorithm and its own settings."
    )
    model: ModelReference | None = Field(
        None,
        alias="teacher",
        description="Shorthand for the type's model slot (opd/opsd: advantage.model, sft: "
        "sampling.source); folded in at validation.",
    )

    @property
    def type(self) -> str:
        """The algorithm's name (``advantage.type``)."""
        return self.advantage.type

    @model_validator(mode="after")
    def _fold_and_validate(self) -> AlgorithmConfig:
        self._fold_model_shorthand()
        adv, source = self.advantage, self.sampling.source
        if adv.type == "opd" and adv.model is None:
            raise ValueError(
                "opd needs a frozen teacher: set advantage.model (or top-level model) to "
                "{name, base_url} or {name, local_path}"
            )
        if adv.type == "opd" and adv.model == "policy":
            raise ValueError(
                "opd against 'policy' is degenerate (the KL of the policy to itself is 0): "
                "give a frozen teacher, or use type = 'opsd'"
            )
        if adv.type == "sft" and source == "policy":
            raise ValueError(
                "sft trains on tokens sampled from a frozen source; sampling.source = 'policy' "
                "would imitate the policy's own samples: set sampling.source (or top-level "
                "model) to {name, base_url} or {name, local_path}, or to 'reference' (the "
                "environment's reference solutions)"
            )
        if source == REFERENCE_SOLUTIONS and adv.type != "sft":
            raise ValueError(
                f"sampling.source = 'reference' (the environment's reference solutions) feeds "
                f"only type = 'sft', which imitates them; advantage type {adv.type!r} needs "
                "the policy's own samples: set sampling.source = 'policy'"
            )
        if source == REFERENCE_SOLUTIONS:
            self._one_demonstration_per_task()
        if adv.needs_policy_logprobs() and is_frozen(source):
            raise ValueError(
                f"advantage type {adv.type!r} trains the rl component, which needs the "
                f"policy's own sampling log-probs; the frozen source {source.name!r} has none: "
                "set sampling.source = 'policy', or use type = 'sft' to imitate that model"
            )
        if adv.group_relative and self.sampling.group_size == 1:
            warnings.warn(
                f"advantage type {adv.type!r} is group-relative, but sampling.group_size = 1: "
                "every advantage is 0 and the rl component learns nothing. Set "
                "sampling.group_size >= 2 (or use type = 'reward').",
                UserWarning,
                stacklevel=2,
            )
        return self

    def _one_demonstration_per_task(self) -> None:
        """A task has one reference solution: its group is that one demonstration."""
        if "group_size" not in self.sampling.model_fields_set:
            self.sampling = self.sampling.model_copy(update={"group_size": 1})
        elif self.sampling.group_size != 1:
            raise ValueError(
                f"sampling.source = 'reference' gives each task its one reference solution; "
                f"group_size = {self.sampling.group_size} would only repeat it: set "
                "group_size = 1 (or leave it out)"
            )

    def _fold_model_shorthand(self) -> None:
        if self.model is None:
            return
        slot = self.advantage.model_slot
        if slot is None:
            raise ValueError(
                f"top-level model (teacher) has no slot in advantage type "
                f"{self.advantage.type!r}: only opd / opsd (advantage.model) and sft "
                "(sampling.source) take one; remove it"
            )
        parent, field = slot.split(".")
        owner = getattr(self, parent)
        current = getattr(owner, field)
        if field in owner.model_fields_set and current != self.model:
            raise ValueError(
                f"top-level model {_describe(self.model)} contradicts {slot} = "
                f"{_describe(current)}; give the model in one place only"
            )
        # A copy: the caller's sub-config object (if one was passed in) stays untouched.
        setattr(self, parent, owner.model_copy(update={field: self.model}))
        self.model = None

    # ---------------------------------------------------------------- TOML

    @classmethod
    def from_toml(cls, source: str | Path) -> AlgorithmConfig:
        """Parse TOML text, or read a file (a ``Path``, or a one-line str ending in .toml)."""
        text = source
        if isinstance(source, Path) or ("\n" not in source and source.strip().endswith(".toml")):
            text = Path(source).read_text(encoding="utf-8")
        return cls.model_validate(tomllib.loads(str(text)))

    def to_toml(self) -> str:
        """The config as TOML text (canonical: shorthand folded, None fields left out)."""
        data: dict[str, Any] = self.model_dump(mode="json", exclude_none=True)
        data.pop("model", None)
        advantage = data["advantage"]
        data["advantage"] = {"type": advantage.pop("type"), **advantage}
        return dumps(data)


def _describe(reference: Any) -> str:
    return repr(reference) if isinstance(reference, str) else repr(reference.model_dump())
