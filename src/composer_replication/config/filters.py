"""``FiltersConfig``: the ``[filters]`` table of a run config (what leaves a step's batch).

Filters act on an algorithm's training samples after ``assign`` and before scoring and
packing. Each filter is a sub-table named after it; ``enforce = false`` keeps its samples
and only counts them.
"""

from __future__ import annotations

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


class FiltersConfig(BaseModel):
    """The ``[filters]`` table: one sub-table per filter."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    zero_advantage: ZeroAdvantageFilterConfig = Field(
        default_factory=ZeroAdvantageFilterConfig,
        description="Zero-advantage groups (on by default).",
    )
