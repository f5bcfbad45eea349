"""Run a data-juicer recipe on in-memory records, without letting data-juicer install anything.

data-juicer (`py-data-juicer`) installs missing optional packages by itself, through uv or
pip, when an operator first touches a lazily imported module. That must never happen inside
our process, so while data-juicer is imported and run:
- its installer (`LazyLoader._install_package`, the one path all its installs take) is
  replaced by one that raises `ImportError` naming the package to install by hand;
- `UV_OFFLINE`, `UV_NO_CACHE`, `PIP_NO_INDEX` and `PIP_NO_INPUT` are set, so that even a
  direct uv/pip call could not fetch anything;
- its loguru output and the `datasets` progress bars are silenced.
All three are restored afterwards, and so is the whole `os.environ` (data-juicer sets a few
variables of its own when imported). The recipe runs on a dataset built in memory (no Hugging
Face json cache is written), with a temporary work directory that is removed afterwards.
"""

from __future__ import annotations

import importlib.util
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

__all__ = ["DJ_EXTRA", "dj_available", "no_auto_install", "run_recipe"]

# The package extra that brings data-juicer and what its executor imports.
DJ_EXTRA = "replaysim"
_GUARD_ENV = {"UV_OFFLINE": "1", "UV_NO_CACHE": "1", "PIP_NO_INDEX": "1", "PIP_NO_INPUT": "1"}


def dj_available() -> bool:
    """True when `data_juicer` is importable (checked without importing it)."""
    return importlib.util.find_spec("data_juicer") is not None


def _refuse_install(cls: type, package_spec: Any, pip_args: Any = None) -> bool:
    raise ImportError(
        f"data-juicer wanted to install {package_spec!r} at run time; composer-replication "
        f"never lets it. Install it yourself (pip install {package_spec}) or drop the operator "
        "that needs it from the recipe."
    )


@contextmanager
def no_auto_install() -> Iterator[None]:
    """Guard a block that imports or runs data-juicer (see the module docstring)."""
    saved_env = dict(os.environ)
    os.environ.update(_GUARD_ENV)
    loader_cls = None
    original = None
    try:
        from data_juicer.utils.lazy_loader import LazyLoader

        loader_cls = LazyLoader
        original = LazyLoader.__dict__["_install_package"]
        LazyLoader._install_package = classmethod(_refuse_install)  # type: ignore[method-assign,assignment]
        import datasets
        from loguru import logger

        bars_were_on = datasets.is_progress_bar_enabled()
        datasets.disable_progress_bars()
        logger.disable("data_juicer")
        try:
            yield
        finally:
            logger.enable("data_juicer")
            if bars_were_on:
                datasets.enable_progress_bars()
    finally:
        if loader_cls is not None and original is not None:
            loader_cls._install_package = original  # type: ignore[method-assign]
        for key in set(os.environ) - set(saved_env):
            del os.environ[key]
        os.environ.update(saved_env)


def run_recipe(recipe_path: Path, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records data-juicer's `DefaultExecutor` keeps after running the recipe on them.

    Each record's text is under "text"; other keys ride along unchanged. Stats columns that
    filters add (`__dj__stats__`) are removed from the output. An operator error raises
    (`skip_op_error` is forced off).
    """
    if not records:
        return []
    with no_auto_install(), tempfile.TemporaryDirectory(prefix="replaysim-dj-") as work:
        from data_juicer.config import init_configs
        from data_juicer.core import DefaultExecutor
        from data_juicer.core.data import NestedDataset

        cfg = init_configs(
            args=[
                "--config",
                str(recipe_path),
                "--export_path",
                str(Path(work) / "export" / "pairs.jsonl"),
                "--work_dir",
                work,
                # An operator that fails must fail the run: data-juicer's default drops the
                # failing samples silently, which would lose pairs without a word.
                "--skip_op_error",
                "false",
            ],
            load_configs_only=True,  # no logger set-up: data-juicer would redirect stdout
        )
        dataset = NestedDataset.from_list(records)
        result = DefaultExecutor(cfg).run(dataset=dataset, skip_export=True)
        rows = result.to_list() if hasattr(result, "to_list") else list(result)
    return [{k: v for k, v in row.items() if not k.startswith("__dj__")} for row in rows]
