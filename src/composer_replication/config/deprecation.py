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


def rename_deprecated(data: Any, renames: Mapping[str, str], where: str) -> Any:
    """``data`` (raw validator input) with the old keys of ``renames`` moved to the new ones.

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
            f"{where}: {old!r} is deprecated, write {new!r} instead",
            ConfigDeprecationWarning,
            stacklevel=6,
        )
        out[new] = value
    return out
