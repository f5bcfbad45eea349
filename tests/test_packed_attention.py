"""Packed attention: the pre-order layout, its token-budget split, the block mask against
torch's own, the FlexAttention kernel against the math reference, every loss component of
the composer step (student rows, SDPO teacher contexts, DPO pairs) against the padded
forward, device placement on ``meta``, and the step's padding-fraction metric."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from composer_replication.model import packed_attention
from composer_replication.model.loading import tiny_model
from composer_replication.model.packed_attention import (
    packed_attention as packed_attention_fn,
)
from composer_replication.model.packed_attention import (
    packed_block_mask,
    packed_layout,
    sequence_ranges,
    visible,
)
from composer_replication.model.parts import last_hidden_states
from composer_replication.model.shared_prefix import prefix_sharing
from composer_replication.ops.pairs import pad_rows
from composer_replication.samples.forward_tokens import counting_forward_tokens


@pytest.fixture
def packing_here(monkeypatch):
    """Rows whose tokens the host holds run packed on this machine's devices."""
    monkeypatch.setattr(packed_attention, "PACKING_DEVICES", ("cpu", "meta"))


def test_the_layout_numbers_the_trie_in_pre_order():
    rows = [[5, 6, 7], [5, 6, 8, 9], [5, 7], [4]]
    layout = packed_layout(rows)
    # sorted: [4], [5, 6, 7], [5, 6, 8, 9], [5, 7]
    assert layout.tokens == [4, 5, 6, 7, 8, 9, 7]
    assert layout.positions == [0, 0, 1, 2, 2, 3, 1]
    assert layout.subtree_end == [1, 7, 6, 4, 6, 6, 7]
    assert layout.paths == [[1, 2, 3], [1, 2, 4, 5], [1, 6], [0]]  # the caller's row order
    unshared = packed_layout(rows, share=False)
    assert unshared.tokens == [5, 6, 7, 5, 6, 8, 9, 5, 7, 4]
    assert unshared.positions == [0, 1, 2, 0, 1, 2, 3, 0, 1, 0]
    assert unshared.subtree_end == [3, 3, 3, 7, 7, 7, 7, 9, 9, 10]


def test_the_mask_rule_is_exactly_the_ancestry_of_the_trie():
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(1, 7, (12,), generator=gen).tolist()
    rows = [torch.randint(0, 3, (n,), generator=gen).tolist() for n in lengths]
    layout = packed_layout(rows)
    n = len(layout)
    ancestry = torch.zeros(n, n, dtype=torch.bool)  # [q, k]: k on q's path, k at or before q
    for path in layout.paths:
        for i, q in enumerate(path):
            ancestry[q, path[: i + 1]] = True
    index = torch.arange(n)
    rule = visible(torch.tensor(layout.subtree_end))(None, None, index[:, None], index[None, :])
    assert torch.equal(rule, ancestry)
    assert len(layout) < sum(map(len, rows))  # the random rows do share prefixes


def test_the_budget_splits_between_whole_top_level_subtrees():
    layout = packed_layout([[1] * 3, [2] * 5, [3] * 2], share=False)
    assert sequence_ranges(layout, 6) == [(0, 3), (3, 8), (8, 10)]
    assert sequence_ranges(layout, 8) == [(0, 8), (8, 10)]
    assert sequence_ranges(layout, 100) == [(0, 10)]
    shared = packed_layout([[1, 2, 3, 4], [1, 2, 5], [7]])  # [1, 2, ...] is one subtree
    assert sequence_ranges(shared, 2) == [(0, 5), (5, 6)]  # longer than the budget: alone
    with pytest.raises(ValueError, match="budget=0"):
        sequence_ranges(layout, 0)


def _random_layout(seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 50, (70,), generator=gen).tolist()
    shared = torch.randint(0, 70, (9,), generator=gen).tolist()  # each row's prompt part
    tails = torch.randint(1, 60, (9,), generator=gen).tolist()
    rows = [
        prompt[:k] + torch.randint(0, 50, (t,), generator=gen).tolist()
        for k, t in zip(shared, tails)
    ]
    return packed_layout(rows)


@pytest.mark.parametrize("block", [4, 16, 128])
def test_the_block_mask_equals_torchs_evaluated_one(block):
    from torch.nn.attention.flex_attention import _ordered_to_dense, create_block_mask

    layout = _random_layout()
    n = len(layout)
    mine = packed_block_mask(torch.tensor(layout.subtree_end), block)
    ends = torch.zeros(-(-n // block) * block, dtype=torch.long)
    ends[:n] = torch.tensor(layout.subtree_end)
    theirs = create_block_mask(visible(ends), 1, 1, n, n, device="cpu", BLOCK_SIZE=block)
    blocks = ends.numel() // block
    for kind in ("kv", "full_kv"):  # partial blocks, then full ones
        ours = (getattr(mine, f"{kind}_num_blocks"), getattr(mine, f"{kind}_indices"))
        ref = (getattr(theirs, f"{kind}_num_blocks"), getattr(theirs, f"{kind}_indices"))
        assert torch.equal(ours[0], ref[0])
        assert torch.equal(_ordered_to_dense(*ours, blocks), _ordered_to_dense(*ref, blocks))
    if block == 4:  # all three kinds of block occur
        partial, full = mine.kv_num_blocks.sum(), mine.full_kv_num_blocks.sum()
        assert partial > 0 and full > 0 and partial + full < blocks * blocks


def test_the_block_mask_builds_nothing_quadratic():
    layout = _random_layout()
    n = len(layout)
    with _Created() as created:
        packed_block_mask(torch.tensor(layout.subtree_end), 16)
    assert created.largest < n * n // 4, (created.largest, n)


@pytest.mark.parametrize("tile", [4, 16, 256])
def test_the_cpu_tiles_equal_the_dense_attention_and_see_only_their_key_tiles(tile):
    layout = _random_layout()
    n = len(layout)
    ends = torch.tensor(layout.subtree_end)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, 4, n, 16, generator=gen, requires_grad=True)
    k, v = torch.randn(2, 1, 2, n, 16, generator=gen).unbind(0)  # GQA: 2 key/value heads
    k.requires_grad_(True)
    v.requires_grad_(True)
    up = torch.randn(1, 4, n, 16, generator=gen)

    def outputs_and_grads(attend):
        q.grad = k.grad = v.grad = None
        out = attend()
        (out * up).sum().backward()
        return [out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone()]

    index = torch.arange(n)
    dense = visible(ends)(None, None, index[:, None], index[None, :])
    reference = outputs_and_grads(
        lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=dense, scale=0.25, enable_gqa=True
        )
    )
    masks = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def recording(*args, attn_mask=None, **kwargs):
        masks.append(tuple(attn_mask.shape))
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    block_mask = packed_block_mask(ends, tile, host_ends=layout.subtree_end)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
        tiled = outputs_and_grads(
            lambda: packed_attention.tiled_attention(q, k, v, block_mask, scale=0.25)
        )
    for mine, ref in zip(tiled, reference):
        torch.testing.assert_close(mine, ref, rtol=1e-5, atol=1e-5)
    assert len(masks) == -(-n // tile) and all(rows <= tile for rows, _ in masks)
    seen = sum(rows * keys for rows, keys in masks)  # the (query, key) pairs computed
    if tile <= 16:  # key tiles no query of a tile sees (later ones, other branches) are skipped
        assert seen < n * n // 2, (seen, n)


def test_the_flex_kernel_equals_the_math_reference(monkeypatch):
    layout = _random_layout()
    n = len(layout)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, n, 16, generator=gen)
    k, v = torch.randn(2, 1, 2, n, 16, generator=gen)  # GQA: 2 key/value heads
    mask = packed_block_mask(torch.tensor(layout.subtree_end))
    reference, _ = packed_attention_fn(None, q, k, v, mask, scaling=0.25)
    monkeypatch.setattr(packed_attention, "FLEX_KERNEL_DEVICES", ("cpu",))
    kernel, _ = packed_attention_fn(None, q, k, v, mask, scaling=0.25)
    assert kernel.shape == (1, n, 4, 16)
    torch.testing.assert_close(kernel, reference, rtol=1e-5, atol=1e-5)


def test_the_model_through_the_flex_kernel_equals_the_padded_forward(monkeypatch, packing_here):
    """Forward only: torch's FlexAttention has no backward on a CPU."""
    monkeypatch.setattr(packed_attention, "FLEX_KERNEL_DEVICES", ("cpu",))
    rows = [[*range(10, 40), 41, 42], [*range(10, 40), 50], list(range(60, 67))]
    ids, mask = pad_rows(rows)
    model = tiny_model(seed=3).eval()
    with torch.no_grad():
        padded = last_hidden_states(model, ids, mask, share_prefixes=False)
        packed = last_hidden_states(model, ids, mask, row_tokens=rows)
    torch.testing.assert_close(packed[mask.bool()], padded[mask.bool()], rtol=1e-5, atol=1e-5)
    assert not packed[~mask.bool()].any()


@pytest.mark.parametrize("share", [True, False])
def test_every_loss_component_and_gradient_equals_the_padded_paths(monkeypatch, share):
    from composer_replication.training.step import train_step
    from test_shared_prefix import _composer_step_inputs, _grads_of

    model = tiny_model(seed=1).train()  # float32
    teachers, batches, cfg = _composer_step_inputs(model)
    results = {}
    for path in ("padded", "packed"):
        devices = ("cpu",) if path == "packed" else ()
        monkeypatch.setattr(packed_attention, "PACKING_DEVICES", devices)
        monkeypatch.setattr(packed_attention, "PACKED_SEQUENCE_TOKENS", 100)  # 2+ sequences
        model.zero_grad(set_to_none=True)
        with prefix_sharing(share if path == "packed" else False):
            metrics = train_step(
                model, batches, cfg, teacher=teachers.teacher(model), reference=teachers.reference
            )
        results[path] = (metrics, _grads_of(model))
    (padded, padded_g), (packed, packed_g) = results["padded"], results["packed"]
    assert padded["tokens/jsd"] == 32 and padded["tokens/dpo"] == 2
    assert padded["tokens/padding_fraction"] > 0 and packed["tokens/padding_fraction"] == 0.0
    for key in ("loss", "loss/rl", "loss/jsd", "loss/dpo", "entropy"):
        assert packed[key] == pytest.approx(padded[key], rel=1e-5, abs=1e-7), key
    assert padded_g.keys() == packed_g.keys() and padded_g
    for name, grad in padded_g.items():
        error = (packed_g[name] - grad).norm() / grad.norm()
        assert error < 1e-5, (name, float(error))


class _Created(TorchDispatchMode):
    """Records every tensor an operator returns: the largest one, overall and per device."""

    def __enter__(self):
        self.per_device: dict[str, int] = {}
        self.largest = 0
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                device = t.device.type
                self.per_device[device] = max(self.per_device.get(device, 0), t.numel())
                self.largest = max(self.largest, t.numel())
        return out


def test_on_meta_the_packed_path_builds_everything_on_the_models_device(packing_here):
    rows = [[*range(10, 40), 41, 42], [*range(10, 40), 50], list(range(60, 67))]
    ids, mask = pad_rows(rows)
    model = tiny_model(seed=3).train().to("meta")
    ids, mask = ids.to("meta"), mask.to("meta")
    with _Created() as created:
        hidden = last_hidden_states(model, ids, mask, row_tokens=rows)
    assert hidden.device.type == "meta" and hidden.shape == (3, 32, 64)
    # on the host: only the index lists, (3, N) columns and (B, T) gather rows, copied once
    n_tokens = 30 + 2 + 1 + 7
    assert created.per_device.keys() == {"cpu", "meta"}
    assert created.per_device["cpu"] == max(3 * n_tokens, 3 * 32)
    hidden.sum().backward()  # nothing in backward meets a host tensor either
    assert all(p.grad.device.type == "meta" for p in model.parameters() if p.grad is not None)


def test_the_padding_fraction_is_padded_over_computed_positions(monkeypatch):
    from composer_replication.samples.wire import TrainingSample, pack_samples
    from composer_replication.training.step import train_step

    def sample(n_prompt: int, n_completion: int, first: int) -> TrainingSample:
        ids = list(range(first, first + n_prompt + n_completion))
        mask = [0] * n_prompt + [1] * n_completion
        return TrainingSample(ids, mask, [-1.0] * len(ids), advantages=[0.5] * len(ids))

    samples = [sample(4, 6, 100), sample(3, 3, 200), sample(2, 2, 300)]  # 10, 6, 4 tokens
    batches = pack_samples(samples, max_tokens=4096, split=None)
    model = tiny_model(seed=0)
    with prefix_sharing(False):  # packed: the 20 tokens side by side, no padding
        metrics = train_step(model, batches)
    assert (metrics["tokens/forward"], metrics["tokens/padding_fraction"]) == (20.0, 0.0)
    monkeypatch.setattr(packed_attention, "PACKING_DEVICES", ())
    with prefix_sharing(False):  # padded to 10: 30 positions, 4 + 6 of them padding
        metrics = train_step(model, batches)
    assert metrics["tokens/forward"] == 30.0
    assert metrics["tokens/padding_fraction"] == pytest.approx(10 / 30)
    rows = [list(range(100, 110)), list(range(100, 106))]  # the second is the first's prefix
    ids, mask = pad_rows(rows)
    with counting_forward_tokens() as counted, torch.no_grad():
        last_hidden_states(model, ids, mask, row_tokens=rows)  # the dense-mask trie: 10
        last_hidden_states(model, ids, mask, share_prefixes=False, row_tokens=rows)  # 20, 4
    assert (counted.computed, counted.padded, counted.padding_fraction) == (30, 4, 4 / 30)
