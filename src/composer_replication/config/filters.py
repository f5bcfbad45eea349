"""``FiltersConfig``: the ``[filters]`` table of a run config (what leaves a step's batch).

Filters act on an algorithm's training samples after ``assign`` and before scoring and
packing. Each filter is a sub-table named after it; ``enforce = false`` keeps its samples
and only counts them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class ZeroAdvantageFilterConfig(BaseModel):
    """Groups whose advantage streams are all zero (every rollout of a group-relative
    algorithm earned the same reward) carry no rl signal. Their samples leave the batch, so
    they neither cost a forward pass nor dilute the rl mean of the groups that learn; a
    sample that also trains another component (ce, ref_kl, jsd, a dpo pair) stays with
    its rl weights set to 0. Samples without rl credit (``advantages`` None: opd, opsd,
    sft, pair-only samples) are never touched."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    enforce: bool = Field(
        True,
        description="Drop the rl part of zero-advantage groups (false: keep them, only count "
        "them in rollouts/zero_advantage).",
    )


class TruncatedFilterConfig(BaseModel):
    """Agent episodes cut short by a budget (the reply budget cut a call off, the turn
    limit, the token cap) scored as failures though the policy never finished. ``mode``:

    - ``keep``: trained as the failures they scored (the default);
    - ``mask``: their rl part leaves the loss, while they still count in their group's
      baseline (as TRL's ``mask_truncated_completions`` and DAPO's overlong filtering,
      arXiv 2503.14476); a sample that also trains another component stays without rl;
    - ``penalize``: their reward is lowered by ``penalty`` before the group is processed
      (a soft overlong punishment, after DAPO), so cutting off scores below finishing wrong.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    mode: Literal["keep", "mask", "penalize"] = Field(
        "keep", description="keep, mask or penalize episodes cut short by a budget."
    )
    penalty: float = Field(
        0.5, ge=0, description="What penalize subtracts from a cut-short episode's reward."
    )


class FiltersConfig(BaseModel):
    """The ``[filters]`` table: one sub-table per filter."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    zero_advantage: ZeroAdvantageFilterConfig = Field(
        default_factory=ZeroAdvantageFilterConfig,
        description="Zero-advantage groups (on by default).",
    )
    truncated: TruncatedFilterConfig = Field(
        default_factory=TruncatedFilterConfig,
        description="Agent episodes cut short by a budget (kept as failures by default).",
    )
