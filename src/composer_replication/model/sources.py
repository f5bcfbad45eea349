"""Whether a model source names a model, checked before anything loads it: ``embedded``, a
model directory (with ``config.json``), a file that begins with the GGUF magic, or a model
in the local Hugging Face cache. Every command that takes a model calls it first."""

from __future__ import annotations

from pathlib import Path

from composer_replication.common.errors import UsageError, did_you_mean

__all__ = ["check_model_source"]

_MODEL_FIX = (
    "give a Hugging Face model directory (e.g. a run's final_model), a .gguf file or 'embedded'"
)


def _in_hub_cache(repo_id: str) -> bool:
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo_id, "config.json"), str)
    except Exception:  # an invalid repo id, or no huggingface_hub: not cached either way
        return False


def check_model_source(source: str, where: str = "model.source") -> None:
    """``source`` is 'embedded', a model directory (with config.json), a file starting
    with the GGUF magic, or a model in the local Hugging Face cache."""
    if source == "embedded":
        return
    path = Path(source).expanduser()
    if source.lower().endswith(".gguf"):
        if not path.is_file():
            raise UsageError(f"{where} {source!r} does not exist; {_MODEL_FIX}")
        with open(path, "rb") as fh:
            magic = fh.read(4)
        if magic != b"GGUF":
            raise UsageError(
                f"{where} {source!r} is not a GGUF file (it does not begin with the GGUF "
                "magic): pass an intact .gguf file"
            )
        return
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise UsageError(
                f"{where} {source!r} is not a model directory (it has no config.json); {_MODEL_FIX}"
            )
        return
    if path.exists():
        raise UsageError(f"{where} {source!r} is a file, not a model directory; {_MODEL_FIX}")
    looks_like_path = source.startswith(("/", ".", "~")) or source.count("/") > 1
    if not looks_like_path and _in_hub_cache(source):
        return
    cached = "" if looks_like_path else " (or a model in the local Hugging Face cache)"
    raise UsageError(
        f"{where} {source!r} does not exist{did_you_mean(source, ['embedded'])}; "
        f"{_MODEL_FIX}{cached}"
    )
