"""The transformers releases this package supports, and the one call that differs across them.

:data:`SUPPORTED_TRANSFORMERS` is the range the test suite passes on; ``pyproject.toml``
declares the same range (a test checks that they agree). The commands that load a model
check the installed release against it first (:func:`check_transformers_version`).

transformers 5.24 renamed the forward's cache argument from ``past_key_values`` to
``cache``; an older release ignores ``cache=`` silently (it builds a cache of its own, so the
one passed stays empty). :func:`cache_kwargs` passes a cache under the installed release's
keyword (:func:`cache_keyword`).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

__all__ = [
    "SUPPORTED_TRANSFORMERS",
    "cache_keyword",
    "cache_kwargs",
    "check_transformers_version",
    "installed_transformers",
]

#: The transformers releases the test suite passes on (a PEP 440 specifier).
SUPPORTED_TRANSFORMERS = ">=5.17,<5.25"

#: The first release whose models take their KV cache as ``cache=``.
_CACHE_RENAMED_IN = Version("5.24")


def installed_transformers() -> str:
    """The installed transformers release, read from its metadata (transformers is not
    imported)."""
    try:
        return version("transformers")
    except PackageNotFoundError:
        raise ValueError(
            f"transformers is not installed; pip install 'transformers{SUPPORTED_TRANSFORMERS}'"
        ) from None


def check_transformers_version(installed: str) -> None:
    """Raise ValueError (one line: the installed and supported releases, and the install
    command) unless ``installed`` lies in :data:`SUPPORTED_TRANSFORMERS`."""
    try:
        # a local build (5.20.0+cpu) or a pre-release of a supported release counts
        supported = SpecifierSet(SUPPORTED_TRANSFORMERS).contains(
            Version(installed).public, prereleases=True
        )
    except InvalidVersion:
        supported = False
    if not supported:
        raise ValueError(
            f"transformers {installed} is installed; composer-replication supports transformers "
            f"{SUPPORTED_TRANSFORMERS}: pip install 'transformers{SUPPORTED_TRANSFORMERS}'"
        )


def cache_keyword(installed: str) -> str:
    """The keyword under which a model of transformers ``installed`` takes its KV cache."""
    return "cache" if Version(installed).release >= _CACHE_RENAMED_IN.release else "past_key_values"


def cache_kwargs(cache: Any) -> dict[str, Any]:
    """The keyword argument that hands ``cache`` to a model's forward (which writes into it)
    under the imported transformers."""
    import transformers

    return {cache_keyword(transformers.__version__): cache}
