"""Releasing the static decode loop's buffers before the learner runs."""

from __future__ import annotations

import torch

from composer_replication.inference.decoding.decode_memory import release_decode_buffers
from composer_replication.inference.decoding.static_decode import decoder_for, static_decode_rows


def _greedy(model, prompts):
    rows = static_decode_rows(model, prompts, max_new_tokens=6, temperature=0.0, eos_ids=[2])
    return [row.tokens if hasattr(row, "tokens") else row for row in rows]


def test_release_frees_the_kept_buckets_of_the_named_devices_only():
    from composer_replication.model.loading import tiny_model

    model = tiny_model(seed=0, vocab_size=256).eval()
    prompts = [[1, 5, 9, 11], [1, 7, 3]]
    with torch.no_grad():
        first = _greedy(model, prompts)
    decoder = decoder_for(model)
    assert decoder.buckets()  # kept across calls
    assert release_decode_buffers() == 0  # CUDA only by default: a CPU decoder keeps them
    assert decoder.buckets()
    assert release_decode_buffers(("cpu",)) >= 1
    assert not decoder.buckets()
    with torch.no_grad():  # the next decode allocates again and samples the same
        assert _greedy(model, prompts) == first
    assert decoder_for(model) is decoder and decoder.buckets()
