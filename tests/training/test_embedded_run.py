"""The real embedded SmolLM2 through the training loop (one short step): CI's end-to-end."""

from __future__ import annotations

import math

import pytest
from transformers import AutoModelForCausalLM

from composer_replication.config import RunConfig
from composer_replication.training.loop import train


@pytest.mark.slow
@pytest.mark.integration
def test_embedded_model_one_step_of_the_default_recipe(tmp_path):
    cfg = RunConfig.default(
        [
            "steps=1",
            f"output_dir={tmp_path / 'run'}",
            "eval.max_tasks=2",
            "eval.every=1",
        ]
    )
    data = cfg.model_dump()
    data["envs"][0]["algorithm"]["sampling"].update(group_size=2, max_new_tokens=24)
    data["envs"][0]["tasks_per_step"] = 1
    cfg = RunConfig.model_validate(data)
    assert cfg.envs[0].algorithm.type == "composer" and cfg.model.source == "embedded"
    result = train(cfg)
    row = result.metrics[-1]
    assert result.steps == 1
    assert math.isfinite(row["loss"]) and row["tokens/dpo"] > 0
    # a group of two with equal rewards has no rl credit: the zero-advantage filter takes it
    assert (row["tokens/rl"] > 0) != (row["rollouts/zero_advantage"] > 0)
    assert 0.0 <= row["heldout/pass@1"] <= 1.0
    assert row["tokens/sampled"] > 0 and row["tokens_per_s/generate"] > 0
    assert row["time/generate_s"] <= row["time/generate_score_s"]
    model = AutoModelForCausalLM.from_pretrained(result.final_model_dir)  # plain HF, LoRA merged
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    assert not any("lora" in name for name, _ in model.named_parameters())
