"""A checkpoint of another model whose parameters have the same names is refused in one line
naming a parameter and both shapes (it used to fail deep in a tensor copy)."""

from __future__ import annotations

import pytest

from composer_replication.common.errors import UsageError
from composer_replication.model.loading import tiny_model
from composer_replication.training.checkpoint import load_trainable_state


def test_same_names_other_shapes_is_one_line_naming_the_parameter():
    saved = tiny_model(seed=0)
    other = tiny_model(seed=0, hidden_size=96)
    tensors = {n: p.detach().clone() for n, p in saved.named_parameters()}
    assert set(tensors) == {n for n, _ in other.named_parameters()}  # same names
    with pytest.raises(UsageError) as err:
        load_trainable_state(other, tensors)
    message = str(err.value)
    assert "is [49152, 64] in the checkpoint and [49152, 96] in the model" in message
    assert "another model (model.source)" in message and "\n" not in message
    before = [p.detach().clone() for p in other.parameters()]
    assert all((a == b).all() for a, b in zip(before, other.parameters()))  # untouched
    load_trainable_state(saved, tensors)  # its own checkpoint loads
