"""``[engine]``: where a run's roles execute.

``in_process`` (the default) runs sampling, grading and learning in the calling process
(trainer/loop.py). ``monarch`` places them on a Monarch process mesh
(recipes/monarch/): ``generators`` sampler processes, ``rewarders`` grader processes and one
learner process, driven by the same controller logic. (Teacher replay builds its preference
pairs before a run; ``TeacherPoolActor`` runs it on a mesh when asked.)
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class InProcessEngineConfig(BaseModel):
    """Every role in the calling process (the native loop)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["in_process"] = Field("in_process", description="The native loop.")


class MonarchEngineConfig(BaseModel):
    """Roles as Monarch actors on process meshes of this host (``torchmonarch`` extra)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    type: Literal["monarch"] = Field("monarch", description="Roles on a Monarch process mesh.")
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


EngineConfig = Annotated[InProcessEngineConfig | MonarchEngineConfig, Field(discriminator="type")]

ENGINE_NAMES = ("in_process", "monarch")


def engine_config(name: str) -> InProcessEngineConfig | MonarchEngineConfig:
    """The default settings of the engine called ``name`` (``--engine NAME``)."""
    if name == "in_process":
        return InProcessEngineConfig()
    if name == "monarch":
        return MonarchEngineConfig()
    raise ValueError(f"unknown engine {name!r}; choose one of {', '.join(ENGINE_NAMES)}")
