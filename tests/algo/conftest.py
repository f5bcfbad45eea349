"""Shared fixtures of the algorithm tests: the tiny Llama policy with the real tokenizer."""

from __future__ import annotations

import pytest

from composer_replication.models import tiny_model, tiny_policy


@pytest.fixture(scope="session")
def tiny():
    """(model in eval mode, SmolLM2 tokenizer)."""
    model, tokenizer = tiny_policy(seed=0)
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def tokenizer(tiny):
    return tiny[1]


@pytest.fixture(scope="session")
def teacher_model():
    """A second tiny model (another seed): a frozen teacher that differs from the policy."""
    return tiny_model(seed=1).eval()
