"""The learner's memory estimate against hand-computed numbers, and train's refusal."""

from __future__ import annotations

from pathlib import Path

import pytest

from composer_replication.common.errors import UsageError
from composer_replication.config import RunConfig
from composer_replication.model.memory_estimate import (
    EMBEDDED_SHAPE,
    ModelShape,
    estimate_learner_memory,
    fits,
    largest_fitting_tokens,
    layer_bytes_per_token,
)
from composer_replication.preflight import check_learner_memory

# h 64, 2 layers, intermediate 128, 4 heads of 16, 2 kv heads (k width 32), vocab 256, tied
SMALL = ModelShape(64, 2, 128, 4, 2, 256)
GPU_TOML = Path(__file__).parents[1] / "configs" / "runs" / "gpu.toml"


def test_parameter_counts_match_the_models():
    from composer_replication.model.loading import tiny_model

    # per layer: q 4096 + k 2048 + v 2048 + o 4096 + 3 x 8192 + norms 128; embeddings 16384
    assert SMALL.n_parameters == 2 * 36_992 + 16_384 + 64 == 90_432
    model = tiny_model(vocab_size=256)
    assert SMALL.n_parameters == sum(p.numel() for p in model.parameters())
    assert ModelShape.from_config(model.config) == SMALL
    assert EMBEDDED_SHAPE.n_parameters == 134_515_008  # SmolLM2-135M
    assert SMALL.n_lora_parameters(8, ["q_proj", "v_proj"]) == 2 * (8 * 128 + 8 * 96) == 3_584


def test_bytes_per_token_and_layer_by_hand():
    # norms 4*4*64, casts 5*2*64, attention 3*2*64 + 2*2*32, SwiGLU 4*2*128
    assert layer_bytes_per_token(SMALL, param_bytes=4, compute_bytes=2) == 3_200
    # no autocast: no casts; everything 4 bytes
    assert layer_bytes_per_token(SMALL, param_bytes=4, compute_bytes=4) == 1_024 + 768 + 256 + 2_048


def test_full_fine_tune_estimate_by_hand():
    m = estimate_learner_memory(SMALL, micro_batch_tokens=1000, chunk_size=100)
    assert m.parameters == m.gradients == m.frozen_copies == 90_432 * 4
    assert m.optimizer == 2 * 90_432 * 4 and m.weight_casts == 90_432 * 2
    assert m.activations == 1000 * (2 * 3_200 + 3 * 4 * 64) == 7_168_000
    assert m.head == 2 * 100 * 256 * 4
    assert m.total == 9_362_304
    checkpointed = estimate_learner_memory(
        SMALL, micro_batch_tokens=1000, chunk_size=100, gradient_checkpointing=True
    )
    assert checkpointed.activations == 1000 * (2 * 4 * 64 + 3_200 + 768) == 4_480_000


def test_lora_estimate_by_hand():
    m = estimate_learner_memory(
        SMALL, micro_batch_tokens=10, lora_r=8, lora_targets=["q_proj", "v_proj"], frozen_copies=0
    )
    assert m.parameters == (90_432 + 3_584) * 4
    assert (m.gradients, m.optimizer, m.frozen_copies) == (3_584 * 4, 2 * 3_584 * 4, 0)
    assert m.head == 2 * 10 * 256 * 4  # no chunking: the whole micro-batch's logits


def test_largest_fitting_tokens_is_the_edge_of_fitting():
    settings = {"chunk_size": 100}
    available = 40_000_000
    best = largest_fitting_tokens(SMALL, available, **settings)
    assert best % 1024 == 0 and best > 0
    assert fits(estimate_learner_memory(SMALL, micro_batch_tokens=best, **settings), available)
    over = estimate_learner_memory(SMALL, micro_batch_tokens=best + 1024, **settings)
    assert not fits(over, available)


def test_gpu_toml_fits_an_80_gb_gpu_with_a_tenth_to_spare():
    cfg = RunConfig.from_toml(GPU_TOML)
    memory = check_learner_memory(cfg, available=80 * 10**9)
    assert memory is not None and memory.total <= 0.9 * 80 * 10**9
    # the old packing (64 pairs = 128 rows x 333 tokens beside 32,768 student tokens in one
    # micro-batch) would not have
    settings = {"chunk_size": 4096, "frozen_copies": 1}
    old = estimate_learner_memory(EMBEDDED_SHAPE, micro_batch_tokens=32_768 + 128 * 333, **settings)
    assert not fits(old, 80 * 10**9)


def test_a_config_that_cannot_fit_is_refused_in_one_line_naming_the_settings():
    cfg = RunConfig.from_toml(GPU_TOML)
    with pytest.raises(UsageError) as err:
        check_learner_memory(cfg, available=20 * 2**30)
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("micro_batch_tokens = 32768: ")
    assert "lower micro_batch_tokens (at most 15360 fits)" in message
    assert "model.gradient_checkpointing = true" in message


def test_the_check_is_skipped_on_a_cpu():
    cfg = RunConfig.default(["model.device=cpu"])
    assert check_learner_memory(cfg) is None
