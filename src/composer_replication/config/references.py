"""Model references: which model samples, teaches or serves as a reference.

A reference is one of:
- ``"policy"``: the live trainable model, the only one the framework hosts in-process;
- ``FrozenEndpoint{name, base_url, api_key_env}``: any OpenAI-compatible server (vLLM,
  llama.cpp server, OpenRouter);
- ``LocalFrozenModel{name, local_path}``: a frozen model loaded in-process (the embedded
  default and tests).

A sampling source (``sampling.source``) may also be ``"reference"``
(:data:`REFERENCE_SOLUTIONS`): the environment answers each task with its reference
solution, a demonstration for ``sft`` to imitate (no model samples).

A table with neither ``base_url`` nor ``local_path`` is a parse error: a frozen model the
framework cannot reach is a configuration mistake, not something to discover mid-run.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, field_validator


class FrozenEndpoint(BaseModel):
    """A frozen model behind an OpenAI-compatible HTTP server."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    name: str = Field(min_length=1, description="Model name the server knows it by.")
    base_url: str = Field(
        description="Server root including the API prefix, e.g. 'http://127.0.0.1:8000/v1'."
    )
    api_key_env: str | None = Field(
        None, description="Environment variable holding the API key (None: no auth header)."
    )

    @field_validator("base_url")
    @classmethod
    def _check_base_url(cls, value: str) -> str:
        value = value.strip()
        if not value:
            raise ValueError(
                "base_url is empty: a frozen endpoint needs the server address, e.g. "
                "base_url = 'http://127.0.0.1:8000/v1' (or use local_path for a local model)"
            )
        if not value.startswith(("http://", "https://")):
            raise ValueError(f"base_url {value!r} must start with http:// or https://")
        return value.rstrip("/")


class LocalFrozenModel(BaseModel):
    """A frozen model loaded in-process from a local directory, GGUF file or 'embedded'."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, frozen=True)

    name: str = Field(min_length=1, description="A name for metrics and logs.")
    local_path: str = Field(
        min_length=1,
        description="Directory, .gguf file, or 'embedded' (see model.loading.load_policy).",
    )


#: ``sampling.source`` value: the environment's reference solutions are the samples.
REFERENCE_SOLUTIONS = "reference"


def _check_reference(value: Any, *, names: tuple[str, ...] = ("policy",)) -> Any:
    """Turn the two common mistakes into messages that say what to write instead."""
    if isinstance(value, str) and value not in names:
        allowed = " or ".join(repr(n) for n in names)
        raise ValueError(
            f"model reference {value!r} is not {allowed}; a frozen model is a table: "
            "{name = '...', base_url = 'http://host:port/v1'} or {name = '...', local_path = '...'}"
        )
    if isinstance(value, dict) and not value.get("base_url") and not value.get("local_path"):
        name = value.get("name", "<unnamed>")
        raise ValueError(
            f"frozen model {name!r} has no endpoint: set base_url = 'http://host:port/v1' (an "
            "OpenAI-compatible server) or local_path = '/path/to/model' (loaded in-process)"
        )
    return value


ModelReference = Annotated[
    Literal["policy"] | FrozenEndpoint | LocalFrozenModel, BeforeValidator(_check_reference)
]
"""``"policy"``, a :class:`FrozenEndpoint` or a :class:`LocalFrozenModel`."""


def _check_sampling_source(value: Any) -> Any:
    return _check_reference(value, names=("policy", REFERENCE_SOLUTIONS))


SamplingSource = Annotated[
    Literal["policy", "reference"] | FrozenEndpoint | LocalFrozenModel,
    BeforeValidator(_check_sampling_source),
]
"""What samples an environment's rollouts: a :data:`ModelReference`, or ``"reference"``
(the environment's reference solutions, for ``sft``)."""

FrozenReference = Annotated[FrozenEndpoint | LocalFrozenModel, BeforeValidator(_check_reference)]
"""A frozen model only (no ``"policy"``)."""


def is_frozen(reference: Any) -> bool:
    """True for a frozen endpoint or local model, False for ``"policy"`` and None."""
    return isinstance(reference, FrozenEndpoint | LocalFrozenModel)
