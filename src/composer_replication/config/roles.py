"""``[roles]``: where a run's roles execute (``placement``).

``in_process`` (the default) runs sampling, grading and learning in the calling process
(training/loop.py). ``monarch`` places them on a Monarch process mesh
(recipes/monarch/): ``generators`` sampler processes, ``rewarders`` grader processes and one
learner process, driven by the same controller logic. (Teacher replay builds its preference
pairs before a run; ``TeacherPoolActor`` runs it on a mesh when asked.)

The table was called ``[engine]`` (keyed on ``type``); that spelling still loads, with a
warning (:func:`~.deprecation.fold_engine_table`).
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from composer_replication.config.placement import check_role_placement

__all__ = ["InProcessRoles", "MonarchRoles", "RolesConfig", "roles_config"]


class InProcessRoles(BaseModel):
    """Every role in the calling process (the native loop)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    placement: Literal["in_process"] = Field("in_process", description="The native loop.")


class MonarchRoles(BaseModel):
    """Roles as Monarch actors on process meshes of this host (``torchmonarch`` extra)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    placement: Literal["monarch"] = Field("monarch", description="Roles on a Monarch process mesh.")
    generators: int = Field(
        2, ge=1, le=64, description="Sampler processes; each samples a share of a step's tasks."
    )
    rewarders: int = Field(
        1, ge=1, le=64, description="Grader processes; each grades a share of the completions."
    )
    call_timeout_s: float = Field(
        900.0,
        gt=0,
        description="Longest wait for one actor call (a sampling share, a grading share, a "
        "train step); past it the run stops with an error naming the actor.",
    )


RolesConfig = Annotated[InProcessRoles | MonarchRoles, Field(discriminator="placement")]


def roles_config(placement: str) -> InProcessRoles | MonarchRoles:
    """The default settings of the placement called ``placement`` (``--placement NAME``)."""
    name = check_role_placement(placement)
    return MonarchRoles() if name == "monarch" else InProcessRoles()
