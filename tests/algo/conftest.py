"""Shared fixtures of the algorithm tests: the tiny Llama policy with the real tokenizer."""

from __future__ import annotations

import pytest

from composer_replication.model.loading import tiny_model


@pytest.fixture(scope="session")
def teacher_model():
    """A second tiny model (another seed): a frozen teacher that differs from the policy."""
    return tiny_model(seed=1).eval()
