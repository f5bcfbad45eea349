"""The sandbox backend settings of an environment (``EnvConfig.sandbox`` / ``docker``)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from composer_replication.config.environments import ENVIRONMENTS

__all__ = ["SANDBOX_ENVIRONMENTS", "DockerSandboxConfig"]


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


# Docker's size strings: bytes, or a number with a b/k/m/g unit ("512m", "1g").
_DOCKER_SIZE = r"^[0-9]+[bkmgBKMG]?$"
#: the environments whose sandboxes ``sandbox`` selects (a 'pkg.mod:factory' builds its own)
SANDBOX_ENVIRONMENTS = tuple(name for name, env in ENVIRONMENTS.items() if env.sandbox)


class DockerSandboxConfig(_Strict):
    """The Docker sandbox backend of one environment (``sandbox = "docker"``).

    Every attempt runs in its own locked-down container (no network, read-only root, all
    capabilities dropped, non-root user, pids/memory/CPU limits); the fields are the
    ``DockerSandbox`` settings of the same names. Needs a reachable Docker daemon and the
    ``docker`` extra at run time; the config itself is checked without either.
    """

    image: str = Field(
        min_length=1,
        description="Image the containers run; it must provide python (and pytest for "
        "feature_deletion), e.g. 'python:3.11-slim'. Pull it before the run.",
    )
    runtime: str | None = Field(
        None, description="Container runtime, e.g. 'runsc' (gVisor); null: the daemon default."
    )
    mem_limit: str = Field("1g", pattern=_DOCKER_SIZE, description="Memory cap, e.g. '1g'.")
    memswap_limit: str | None = Field(
        None, pattern=_DOCKER_SIZE, description="Memory + swap cap; null: mem_limit (no swap)."
    )
    pids_limit: int = Field(256, ge=1, description="Processes per container (fork bombs).")
    nano_cpus: int = Field(2_000_000_000, ge=1, description="CPU quota in 1e-9 CPUs (2e9 = 2).")
    user: str = Field("1000:1000", description="Non-root 'uid:gid' (or user name) to run as.")
    tmpfs_size: str = Field("64m", pattern=_DOCKER_SIZE, description="Size of the /tmp tmpfs.")
    exec_timeout_s: float | None = Field(
        None,
        gt=0,
        allow_inf_nan=False,
        description="Wall-clock limit per command; null: the environment's own limit "
        "(python_functions 20 s, feature_deletion 60 s).",
    )

    @model_validator(mode="after")
    def _non_root(self) -> DockerSandboxConfig:
        if self.user.partition(":")[0] in ("", "0", "root"):
            raise ValueError(
                f"docker.user = {self.user!r} would run candidate code as root; use a non-root "
                "'uid:gid' such as '1000:1000'"
            )
        return self

    def sandbox_kwargs(self) -> dict[str, Any]:
        """The ``DockerSandbox`` keyword arguments (unset optional fields left out)."""
        kwargs = self.model_dump(exclude_none=True)
        kwargs.setdefault("memswap_limit", self.mem_limit)
        return kwargs
