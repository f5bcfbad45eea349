"""Write-only shorthands of a run config: the ``advantage`` tables, folded on raw input.

Two spellings put an advantage table (``type`` plus that type's fields) where it belongs
without writing ``[envs.algorithm.advantage]``:

- a run-level ``[advantage]`` table: the advantage of every environment that gives none of
  its own (with no ``[[envs]]``, of the default environment);
- a per-environment ``advantage = {...}`` key on an ``[[envs]]`` entry: that environment's.

Precedence: an environment's own advantage (its shorthand or its
``algorithm.advantage``) wins over the run-level table, which it replaces whole (an
environment assembles its own algorithm; it never edits the inherited one). One
environment's shorthand and its ``algorithm.advantage`` fill each other: given both, they
must describe the same advantage (same type, same settings), else it is a one-line error.

The shorthands are folded before validation and leave no trace: a validated config (and
its ``config.json`` dump) holds the full ``envs[i].algorithm.advantage`` only, and
re-validating the dump gives the same config.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, TypeAdapter, ValidationError

from composer_replication.config.advantage import AdvantageConfig

#: The shorthand's key, at the top of a run config and on an ``[[envs]]`` entry.
SHORTHAND = "advantage"


def fold_run_advantage(data: Any, default_envs: Callable[[], list[dict[str, Any]]]) -> Any:
    """Raw run-config ``data`` with a run-level ``advantage`` table moved onto every
    environment that has no advantage of its own (as that environment's shorthand).

    ``default_envs()`` gives the default environment list as raw data without its
    advantage (used when ``data`` names no ``envs``). Non-dict input passes through.
    """
    if not isinstance(data, dict) or SHORTHAND not in data:
        return data
    out = dict(data)
    table = out.pop(SHORTHAND)
    envs = out.get("envs")
    if envs is None:
        envs = default_envs()
    if not isinstance(envs, list):
        return out  # the envs field reports its own type error
    if envs and all(has_own_advantage(env) for env in envs):
        field = next(iter(table), "type") if isinstance(table, dict) and table else "type"
        raise ValueError(
            "advantage: every environment of this config has an advantage of its own, which "
            "a run-level advantage never replaces (it would be ignored); set "
            f"envs.<i>.algorithm.advantage.{field} instead"
        )
    if isinstance(table, dict) and "type" not in table:
        raise ValueError(
            "advantage.type is missing: a run-level advantage is a whole table (type = "
            "'grpo', 'sdpo', 'composer', ...), not an edit of the environments' own"
        )
    _check_run_table(table)
    out["envs"] = [_inherit(env, table) for env in envs]
    return out


def _check_run_table(table: Any) -> None:
    """A run-level table that is not a valid advantage: one error naming ``advantage.<key>``
    (where the user wrote it), not the environment it would have been copied into."""
    with warnings.catch_warnings():  # old spellings warn once, in the real validation
        warnings.simplefilter("ignore")
        try:
            _ADVANTAGE.validate_python(table)
        except ValidationError as exc:
            first = exc.errors()[0]
            loc = [str(p) for p in first.get("loc", ())]
            if loc and isinstance(table, dict) and loc[0] == table.get("type"):
                loc = loc[1:]  # the union's tag: the user wrote no such level
            value = first.get("input")
            shown = "" if isinstance(value, dict) else f" (got {value!r})"
            message = str(first.get("msg", "")).removeprefix("Value error, ")
            raise ValueError(f"{'.'.join([SHORTHAND, *loc])}: {message}{shown}") from None


def fold_env_advantage(data: Any, where: str = "an environment") -> Any:
    """Raw ``[[envs]]`` entry ``data`` with its ``advantage`` shorthand folded into
    ``algorithm.advantage``; given both, they must agree (``ValueError`` otherwise)."""
    if not isinstance(data, dict) or SHORTHAND not in data:
        return data
    out = dict(data)
    table = out.pop(SHORTHAND)
    algorithm = out.get("algorithm")
    if algorithm is None:
        algorithm = {}
    elif isinstance(algorithm, BaseModel):
        algorithm = _written(algorithm)
    if not isinstance(algorithm, dict):
        return out  # the algorithm field reports its own type error
    algorithm = dict(algorithm)
    explicit = algorithm.get(SHORTHAND)
    difference = None if explicit is None else _difference(table, explicit)
    if difference is not None:
        name = data.get("name", "")
        label = f"environment {name!r}" if isinstance(name, str) and name else where
        raise ValueError(
            f"{label}: {difference}; give the advantage in one place (the advantage "
            "shorthand or algorithm.advantage)"
        )
    algorithm[SHORTHAND] = table if explicit is None else explicit
    out["algorithm"] = algorithm
    return out


def has_own_advantage(env: Any) -> bool:
    """Whether raw ``[[envs]]`` entry ``env`` gives its own advantage (either spelling)."""
    if isinstance(env, BaseModel):
        algorithm = env.algorithm
        return "algorithm" in env.model_fields_set and SHORTHAND in algorithm.model_fields_set
    if not isinstance(env, dict):
        return False
    algorithm = env.get("algorithm")
    if isinstance(algorithm, BaseModel):
        return SHORTHAND in algorithm.model_fields_set
    return SHORTHAND in env or (isinstance(algorithm, dict) and SHORTHAND in algorithm)


def _inherit(env: Any, table: Any) -> Any:
    if has_own_advantage(env):
        return env  # per environment wins over the run level
    if isinstance(env, BaseModel):
        env = _written(env)
    if not isinstance(env, dict):
        return env
    return {**env, SHORTHAND: table}


def _written(model: BaseModel) -> dict[str, Any]:
    """The fields of a validated config that were given (not defaults), sub-configs kept
    as objects, so re-validation gives it back."""
    return {name: getattr(model, name) for name in model.model_fields_set}


_ADVANTAGE = TypeAdapter(AdvantageConfig)


def _difference(shorthand: Any, explicit: Any) -> str | None:
    """None when two advantage tables validate to the same settings; else what differs."""
    with warnings.catch_warnings():  # old spellings warn once, in the real validation
        warnings.simplefilter("ignore")
        try:
            a, b = _ADVANTAGE.validate_python(shorthand), _ADVANTAGE.validate_python(explicit)
        except (ValidationError, ValueError, TypeError):
            return (
                f"advantage = {_describe(shorthand)} and algorithm.advantage = "
                f"{_describe(explicit)} are both given"
            )
    first, second = a.model_dump(mode="json"), b.model_dump(mode="json")
    keys = ["type"] if a.type != b.type else [k for k in first if first[k] != second[k]]
    if not keys:
        return None
    return ", ".join(
        f"advantage.{k} = {first[k]!r} but algorithm.advantage.{k} = {second[k]!r}" for k in keys
    )


def _describe(table: Any) -> str:
    if isinstance(table, BaseModel):
        return repr(table)
    try:
        return json.dumps(table, sort_keys=True, default=str)
    except (TypeError, ValueError):
        return repr(table)
