"""Host-to-device copies of the static loop, and the bucket shapes it keeps.

Without a GPU, the uploads are counted on the ``meta`` device: the loop's tensor-building
code runs there and its copies reach the dispatcher with the device and ``non_blocking``
flag the CUDA path gives them (``HostReads.uploads``).
"""

from __future__ import annotations

import copy

import pytest
import torch

import composer_replication.inference.decoding.static_decode as static_decode
from composer_replication.inference.decoding.decode import DecodeStats
from composer_replication.inference.decoding.padding import left_pad
from composer_replication.inference.decoding.static_decode import (
    ShapePlan,
    StaticDecoder,
    plan_shape,
)
from composer_replication.inference.decoding.uploads import to_device_async
from composer_replication.testing.host_reads import HostReads, upload_kind

META = torch.device("meta")


@pytest.fixture(scope="module")
def meta_model(tiny):
    return copy.deepcopy(tiny[0]).to("meta")


# --------------------------------------------------------------------------- counting


def test_upload_kind():
    cuda, meta = torch.device("cuda"), torch.device("meta")
    assert upload_kind(cuda, non_blocking=True, pinned=True) == "h2d:non_blocking"
    # from pageable memory a CUDA copy makes the host wait, whatever the flag
    assert upload_kind(cuda, non_blocking=True, pinned=False) == "h2d:blocking"
    assert upload_kind(cuda, non_blocking=False, pinned=True) == "h2d:blocking"
    assert upload_kind(meta, non_blocking=True, pinned=False) == "h2d:non_blocking"
    assert upload_kind(meta, non_blocking=False, pinned=False) == "h2d:blocking"


def test_host_reads_counts_uploads_apart_from_reads():
    host = torch.arange(6)
    target = torch.empty(6, dtype=torch.long, device=META)
    with HostReads() as reads:
        host.to(META)  # blocking
        host.to(META, non_blocking=True)
        target.copy_(host)  # blocking
        target.copy_(host, non_blocking=True)
        torch.tensor([1, 2], device=META)  # Python data: a pageable copy
        torch.as_tensor([1, 2], device=META)
        to_device_async(host, META)
        host.to("cpu")  # cpu -> cpu: no upload
        host.clone().copy_(host)
        torch.tensor([1, 2])
    assert reads.uploads == {"h2d:blocking": 4, "h2d:non_blocking": 3}
    assert reads.total == 0  # uploads are not host reads


def test_to_device_async_keeps_values_and_skips_same_device():
    host = torch.tensor([[3, 4], [5, 6]])
    assert to_device_async(host, "cpu") is host
    moved = to_device_async(host, META)
    assert (moved.device, moved.shape, moved.dtype) == (META, (2, 2), torch.long)


def test_left_pad_uploads_once():
    ids, mask = left_pad([[5, 6, 7], [8]], pad_id=9)
    assert ids.tolist() == [[5, 6, 7], [9, 9, 8]]
    assert mask.tolist() == [[1, 1, 1], [0, 0, 1]]
    with HostReads() as reads:
        ids, mask = left_pad([[5, 6, 7], [8]], pad_id=9, device=META)
    assert reads.uploads == {"h2d:non_blocking": 1}
    assert ids.device == mask.device == META and ids.shape == mask.shape == (2, 3)


# --------------------------------------------------------------------------- the loop


@pytest.mark.parametrize(
    ("seeded", "temperature", "chunks", "expected"),
    [
        (True, 1.0, 1, 4),  # row lengths, padded prompts + slot indices, uniforms
        (False, 1.0, 1, 3),  # uniforms drawn on the device
        (False, 0.0, 1, 3),
        (True, 1.0, 3, 8),  # three prefill chunks
    ],
)
def test_a_wave_uploads_without_blocking(
    meta_model, monkeypatch, seeded, temperature, chunks, expected
):
    """A wave's start (prefill, uniforms, counters) makes only non-blocking uploads, a fixed
    number, and every tensor it fills is on the model's device."""
    prompts = [[5, 6, 7], [8, 9], [5, 6, 7], [10, 11, 12, 13]]  # three distinct
    if chunks == 3:  # one distinct prompt per chunk
        monkeypatch.setattr(static_decode, "PREFILL_TOKENS", 1)
    decoder = StaticDecoder(meta_model, sync_every=4)
    decoder.weights.refresh(meta_model)
    seeds = [1, 2, 3, 4] if seeded else None
    with torch.no_grad(), HostReads() as reads:
        bucket = decoder._start(prompts, 8, temperature, seeds, DecodeStats())
    assert reads.uploads == {"h2d:non_blocking": expected}
    assert reads.total == 0
    assert all(t.device == META for t in bucket.tensors())


def test_the_token_steps_and_a_compaction_upload_nothing_per_token(meta_model):
    decoder = StaticDecoder(meta_model, sync_every=4)
    decoder.weights.refresh(meta_model)
    prompts = [[5, 6, 7]] * 9  # a bucket of 16 rows
    with torch.no_grad():
        bucket = decoder._start(prompts, 8, 1.0, None, DecodeStats())
        with HostReads() as steps:
            for _ in range(7):
                decoder._steps.run(bucket, 64, False)
        with HostReads() as compaction:
            smaller = decoder._compact(bucket, [0, 3, 5], 8)
    assert steps.uploads == {} and steps.total == 0
    assert compaction.uploads == {"h2d:non_blocking": 1}
    assert (smaller.rows, smaller.capacity) == (8, bucket.capacity)


# --------------------------------------------------------------------------- shapes


@pytest.mark.parametrize(
    ("held", "need", "keep", "plan"),
    [
        ([], (128, 64), 2, ShapePlan((128, 64), ())),
        # a held shape that fits is used as it is: nothing freed, nothing new
        ([(128, 64), (256, 64)], (128, 64), 2, ShapePlan((128, 64), ())),
        ([(256, 64), (128, 64)], (64, 64), 2, ShapePlan((128, 64), ())),
        ([(128, 64)], (192, 64), 2, ShapePlan((192, 64), ())),  # the shorter shape stays
        # at the limit the oldest goes, and the new shape covers it
        ([(128, 128), (192, 64)], (256, 64), 2, ShapePlan((256, 128), ((128, 128),))),
        # keep=1: one shape, grown to every need (the loop's memory when graphs are off)
        ([(128, 128)], (192, 64), 1, ShapePlan((192, 128), ((128, 128),))),
        ([(192, 128)], (128, 64), 1, ShapePlan((192, 128), ())),
        (
            [(128, 64), (192, 64), (256, 64)],
            (320, 64),
            2,
            ShapePlan((320, 64), ((128, 64), (192, 64))),
        ),
    ],
)
def test_plan_shape(held, need, keep, plan):
    assert plan_shape(held, *need, keep=keep) == plan


def test_plan_shape_rejects_keep_below_one():
    with pytest.raises(ValueError, match="keep=0 must be >= 1"):
        plan_shape([], 64, 64, keep=0)


def test_a_longer_prompt_leaves_the_shorter_shape_in_place(tiny):
    """With two shapes kept, a prompt past the 64-column boundary allocates a bucket of the
    new capacity only; the next short call decodes in its old bucket again (on CUDA: its
    graphs replay), with the tokens a fresh decoder gives."""
    model, _tok = tiny
    short = [[5, 6, 7], [8, 9, 10, 11]]
    long = [list(range(3, 63)), [7, 8]]  # 60 tokens + 8 new: past 64 columns
    kwargs = {"max_new_tokens": 8, "temperature": 0.0, "eos_ids": [2]}
    assert StaticDecoder(model).keep_shapes == 1  # without graphs: one set of buffers
    decoder = StaticDecoder(model, sync_every=4, keep_shapes=2)
    first = decoder.decode(model, short, **kwargs)
    (before,) = decoder.buckets()
    long_rows = decoder.decode(model, long, **kwargs)
    assert [(b.capacity, b.uniforms.shape[1]) for b in decoder.buckets()] == [(64, 64), (128, 64)]
    assert decoder.buckets()[0] is before
    again = decoder.decode(model, short, **kwargs)
    # the short call used its old bucket again (now the most recent shape); nothing new
    assert [(b.capacity, b.uniforms.shape[1]) for b in decoder.buckets()] == [(128, 64), (64, 64)]
    assert decoder.buckets()[1] is before
    assert [r.tokens for r in again] == [r.tokens for r in first]
    fresh = StaticDecoder(model, sync_every=4).decode(model, long, **kwargs)
    assert [r.tokens for r in long_rows] == [r.tokens for r in fresh]
    for a, b in zip(long_rows, fresh):
        torch.testing.assert_close(a.logprobs, b.logprobs, rtol=0, atol=1e-6)

    one = StaticDecoder(model, sync_every=4)  # keep_shapes=1: the shape grows in place
    one.decode(model, short, **kwargs)
    one.decode(model, long, **kwargs)
    one.decode(model, short, **kwargs)
    assert [(b.capacity, b.uniforms.shape[1]) for b in one.buckets()] == [(128, 64)]
