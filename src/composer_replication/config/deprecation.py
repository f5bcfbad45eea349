"""Old spellings of config fields: accepted with a warning, mapped to the one current name.

Each knob has one name across TOML, the command line, the library and the trl trainer. A
config that still uses an old spelling keeps working: the value moves to the new name and a
:class:`ConfigDeprecationWarning` says what to write instead. Giving both spellings with
different values is an error that names both.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any


class ConfigDeprecationWarning(FutureWarning):
    """A config used an old field name (shown to users by default)."""


def rename_deprecated(
    data: Any, renames: Mapping[str, str], where: str, *, advice: str = ""
) -> Any:
    """``data`` (raw validator input) with the old keys of ``renames`` moved to the new ones;
    ``advice`` ends each warning (say what else changed with the name).

    Non-dict inputs pass through (pydantic validates model instances itself).
    """
    if not isinstance(data, dict):
        return data
    out = dict(data)
    for old, new in renames.items():
        if old not in out:
            continue
        value = out.pop(old)
        if new in out and out[new] != value:
            raise ValueError(
                f"{where}: {old} = {value!r} (old spelling) contradicts {new} = {out[new]!r}; "
                f"keep only {new}"
            )
        warnings.warn(
            f"{where}: {old!r} is deprecated, write {new!r} instead{advice}",
            ConfigDeprecationWarning,
            stacklevel=6,
        )
        out[new] = value
    return out


def fold_engine_table(data: Any) -> Any:
    """A run config's raw data with the old ``[engine] type = X`` table as
    ``[roles] placement = X`` (the table says where the roles run), warning once."""
    if not isinstance(data, dict) or "engine" not in data:
        return data
    table = data["engine"]
    if isinstance(table, dict) and "type" in table:
        table = {"placement": table["type"], **{k: v for k, v in table.items() if k != "type"}}
    return rename_deprecated(
        {**data, "engine": table},
        {"engine": "roles"},
        "run config",
        advice=" (its 'type' is now 'placement': [roles] placement = 'in_process' | 'monarch')",
    )


def fold_run_level_spellings(config: Any) -> None:
    """Move a run config's deprecated run-level settings (``jsd_teacher``, ``ema_decay``,
    ``pairs_file``) into the algorithms of its ``envs`` that own them, warning once each."""
    moves = (
        ("jsd_teacher", "teacher", "sdpo / composer"),
        ("ema_decay", "ema_decay", "sdpo / composer"),
        ("pairs_file", "pairs_path", "replay_dpo / composer"),
    )
    for run_field, field, owners in moves:
        value = getattr(config, run_field)
        if value is None:
            continue
        warnings.warn(
            f"{run_field} is deprecated: write advantage.{field} in the {owners} "
            "algorithms of [[envs]]",
            ConfigDeprecationWarning,
            stacklevel=3,
        )
        for i, env in enumerate(config.envs):
            advantage = env.algorithm.advantage
            if field not in type(advantage).model_fields:
                continue
            current = getattr(advantage, field)
            if field in advantage.model_fields_set and current != value:
                raise ValueError(
                    f"{run_field} = {value!r} contradicts envs.{i}.algorithm.advantage."
                    f"{field} = {current!r}; set it in one place (advantage.{field})"
                )
            updated = advantage.model_copy(update={field: value})
            updated.model_fields_set.add(field)
            algorithm = env.algorithm.model_copy(update={"advantage": updated})
            config.envs[i] = env.model_copy(update={"algorithm": algorithm})
        setattr(config, run_field, None)
