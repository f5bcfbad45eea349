"""Shared-prefix forward: the prefix tree and token trie of a batch's rows, and hidden states
and gradients equal to the row-by-row forward on every way of sharing (one packed forward
with a dense mask, a forward per tree node, packed sequences under a block-sparse mask) for
full fine-tune, LoRA, adapters disabled, checkpointing."""

from __future__ import annotations

import pytest
import torch

from composer_replication.model import packed_attention, shared_prefix
from composer_replication.model.loading import tiny_model
from composer_replication.model.parts import AdapterDisabled, last_hidden_states
from composer_replication.model.shared_prefix import prefix_tree, token_trie, tree_forward_tokens
from composer_replication.ops.pairs import pad_rows
from composer_replication.samples.forward_tokens import counting_forward_tokens

SYSTEM = list(range(100, 140))  # 40 tokens every row starts with
TASK_A = list(range(200, 230))
TASK_B = list(range(300, 325))


def _rows() -> list[list[int]]:
    return [
        SYSTEM + TASK_A + [7, 8, 9, 10],  # 0: task A
        SYSTEM + TASK_B + [11, 12],  # 1: task B
        SYSTEM + TASK_A + [13],  # 2: task A, shortest
        list(range(500, 530)),  # 3: shares nothing
        SYSTEM + TASK_A + [14, 15, 16, 17, 18, 19],  # 4: task A, longest
        SYSTEM + TASK_B + [20, 21, 22],  # 5: task B
    ]


def _layout(tree):
    def walk(node):
        return (node.rows, node.start, node.end, node.leaves, [walk(c) for c in node.children])

    nodes, unshared = tree
    return [walk(n) for n in nodes], unshared


def test_the_tree_nests_a_system_prompt_and_task_prompts():
    ids, mask = pad_rows(_rows())
    nodes, unshared = prefix_tree(ids, mask, min_prefix=16)
    assert _layout((nodes, unshared)) == (
        [
            (
                [0, 1, 2, 4, 5],
                0,
                40,
                [],
                [([0, 2, 4], 40, 70, [0, 2, 4], []), ([1, 5], 40, 65, [1, 5], [])],
            )
        ],
        [3],
    )
    # 4 extra rows reuse the 40 system tokens, 2 more the 30 of task A, 1 the 25 of task B
    assert nodes[0].shared_tokens() == 4 * 40 + 2 * 30 + 25


def test_every_row_keeps_a_token_of_its_own():
    ids, mask = pad_rows([SYSTEM, [*SYSTEM, 1, 2]])
    (node,), unshared = prefix_tree(ids, mask, min_prefix=16)
    assert (node.start, node.end, node.leaves, unshared) == (0, 39, [0, 1], [])


def test_rows_that_are_not_right_padded_or_too_short_share_nothing():
    ids, mask = pad_rows(_rows(), left=True)
    assert prefix_tree(ids, mask) == ([], list(range(6)))
    ids, mask = pad_rows(_rows())
    assert prefix_tree(ids, mask, min_prefix=71) == ([], list(range(6)))
    with pytest.raises(ValueError, match="min_prefix=0"):
        prefix_tree(ids, mask, min_prefix=0)


def _model(lora: bool = False, checkpointing: bool = False):
    torch.manual_seed(0)
    model = tiny_model(seed=3)
    if checkpointing:
        model.gradient_checkpointing_enable()
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(
            model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"])
        )
        for name, param in model.named_parameters():
            if "lora_B" in name:  # B = 0 at init would hide the adapters' part
                torch.nn.init.normal_(param, std=0.05)
    model.train()
    return model


def _row_tokens(ids, mask) -> list[list[int]]:
    return [row[: int(n)] for row, n in zip(ids.tolist(), mask.sum(1))]


def _hidden_and_grads(model, ids, mask, share: bool):
    model.zero_grad(set_to_none=True)
    rows = _row_tokens(ids, mask) if share else None  # unshared: the padded reference
    hidden = last_hidden_states(model, ids, mask, share_prefixes=share, row_tokens=rows)
    weights = torch.linspace(0.5, 1.5, hidden.shape[-1])
    loss = ((hidden * weights).sin() * mask[..., None]).sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return hidden.detach(), grads


@pytest.fixture(params=["packed", "tree", "flex", "tiled"])
def sharing_path(request, monkeypatch):
    """Run the test on the dense-mask packed forward (rows the host does not hold), on a
    forward per tree node, on packed sequences of at most 64 tokens under a block mask
    (``share=False`` packs the rows unshared), and on one packed sequence whose attention
    runs in tiles of 16 queries (the CPU kernel: many tiles, gathered key runs)."""
    if request.param in ("packed", "tree"):
        monkeypatch.setattr(packed_attention, "PACKING_DEVICES", ())
    if request.param == "tree":
        monkeypatch.setattr(shared_prefix, "PACKED_MAX_TOKENS", 0)
    if request.param == "flex":
        monkeypatch.setattr(packed_attention, "PACKED_SEQUENCE_TOKENS", 64)
    if request.param == "tiled":
        monkeypatch.setattr(packed_attention, "CPU_BLOCK_SIZE", 16)
    return request.param


@pytest.mark.parametrize(("lora", "checkpointing"), [(False, False), (True, False), (False, True)])
def test_hidden_states_and_gradients_equal_the_row_by_row_forward(
    lora, checkpointing, sharing_path
):
    model = _model(lora=lora, checkpointing=checkpointing)
    ids, mask = pad_rows(_rows())
    plain_h, plain_g = _hidden_and_grads(model, ids, mask, share=False)
    shared_h, shared_g = _hidden_and_grads(model, ids, mask, share=True)
    real = mask.bool()
    torch.testing.assert_close(shared_h[real], plain_h[real], rtol=1e-5, atol=1e-5)
    assert plain_g.keys() == shared_g.keys() and plain_g
    for name, grad in plain_g.items():  # sums in another order: compare whole tensors
        error = (shared_g[name] - grad).norm() / grad.norm()
        assert error < 1e-5, (name, float(error))


def test_adapters_disabled_shares_prefixes_of_the_base_model(sharing_path):
    model = _model(lora=True)
    ids, mask = pad_rows(_rows())
    rows = _row_tokens(ids, mask)
    with torch.no_grad():  # (without row_tokens: the padded forward on every path)
        base = last_hidden_states(AdapterDisabled(model), ids, mask, share_prefixes=False)
        shared = last_hidden_states(AdapterDisabled(model), ids, mask, row_tokens=rows)
        adapted = last_hidden_states(model, ids, mask, row_tokens=rows)
    real = mask.bool()
    torch.testing.assert_close(shared[real], base[real], rtol=1e-5, atol=1e-5)
    assert not torch.allclose(adapted[real], base[real], atol=1e-3)  # the adapters matter


def _embedded_tokens(model, ids, mask, **kwargs) -> list[int]:
    """Tokens each forward of ``last_hidden_states`` embeds."""
    seen: list[int] = []
    hook = model.model.embed_tokens.register_forward_hook(
        lambda _m, args, _out: seen.append(args[0].numel())
    )
    try:
        with torch.no_grad():
            last_hidden_states(model, ids, mask, **kwargs)
    finally:
        hook.remove()
    return seen


def test_the_shared_forward_computes_fewer_tokens(monkeypatch):
    monkeypatch.setattr(packed_attention, "PACKING_DEVICES", ())  # the paths packing replaces
    model = _model()
    ids, mask = pad_rows(_rows())
    width = ids.shape[1]
    assert _embedded_tokens(model, ids, mask, share_prefixes=False) == [6 * width]
    # one packed forward of the distinct tokens: the unshared row (30), the system prompt
    # (40), task A's and B's prompts (30, 25) once, every row's own tail (4+2+1+6+3)
    assert _embedded_tokens(model, ids, mask) == [30 + 40 + 30 + 25 + 4 + 2 + 1 + 6 + 3]
    # a forward per tree node: the unshared row in full, the system prompt once, task A's
    # and B's prompts once, then each row's own tail up to its group's longest (6 for A,
    # 3 for B)
    monkeypatch.setattr(shared_prefix, "PACKED_MAX_TOKENS", 0)
    tree = _embedded_tokens(model, ids, mask)
    assert len(tree) > 1 and sum(tree) == width + 40 + 30 + 25 + 3 * 6 + 2 * 3
    # padding: row 3 (30 of 76), task A's tails padded to 6 (lengths 74, 71, 76), task B's
    # to 3 (67, 68)
    lengths = mask.sum(1).tolist()
    assert tree_forward_tokens(prefix_tree(ids, mask), lengths, width) == (
        sum(tree),
        46 + (2 + 5 + 0) + (1 + 0),
    )
    with counting_forward_tokens() as counted:
        _embedded_tokens(model, ids, mask, row_tokens=_row_tokens(ids, mask))
    assert (counted.computed, counted.padded) == (sum(tree), 54)


def test_a_gpu_takes_one_forward_where_the_packed_one_does_not_apply(monkeypatch):
    """Off the devices where a forward per segment pays (a GPU), rows the packed forward
    cannot take run in one padded forward: one launch of the layers, not one per segment."""
    import composer_replication.model.parts as model_parts

    monkeypatch.setattr(packed_attention, "PACKING_DEVICES", ())  # rows the host does not hold
    model = _model()
    ids, mask = pad_rows(_rows())
    monkeypatch.setattr(shared_prefix, "PACKED_MAX_TOKENS", 0)
    assert len(_embedded_tokens(model, ids, mask)) > 1  # on a CPU: a forward per segment
    monkeypatch.setattr(model_parts, "SEGMENT_SHARING_DEVICES", ())
    assert _embedded_tokens(model, ids, mask) == [6 * ids.shape[1]]
    plain_h, plain_g = _hidden_and_grads(model, ids, mask, share=False)
    gpu_h, gpu_g = _hidden_and_grads(model, ids, mask, share=True)
    assert torch.equal(gpu_h, plain_h)
    assert all(torch.equal(gpu_g[n], g) for n, g in plain_g.items())


def test_the_token_trie_shares_exactly_the_common_prefixes():
    ids, mask = pad_rows([[5, 6, 7], [5, 6, 8, 9], [5, 7], [4]])
    trie = token_trie(ids, mask)
    assert trie.tokens == [5, 6, 7, 8, 9, 7, 4]
    assert trie.positions == [0, 1, 2, 2, 3, 1, 0]
    assert trie.paths == [[0, 1, 2], [0, 1, 3, 4], [0, 5], [6]]
    assert token_trie(*pad_rows([[5, 6], [5]], left=True)) is None  # not right-padded


def test_the_packed_forward_holds_for_eager_attention_and_gives_way_where_it_cannot():
    rows = _rows()
    ids, mask = pad_rows(rows)
    model = _model()
    model.config._attn_implementation = "eager"  # an additive mask instead of a boolean one
    plain_h, plain_g = _hidden_and_grads(model, ids, mask, share=False)
    assert len(_embedded_tokens(model, ids, mask)) == 1
    shared_h, shared_g = _hidden_and_grads(model, ids, mask, share=True)
    torch.testing.assert_close(shared_h[mask.bool()], plain_h[mask.bool()], rtol=1e-5, atol=1e-5)
    for name, grad in plain_g.items():
        assert (shared_g[name] - grad).norm() / grad.norm() < 1e-5, name
    # a sliding window shorter than the rows: the (N, N) mask would bypass it
    model.config.sliding_window = 32
    assert len(_embedded_tokens(model, ids, mask)) > 1
    model.config.sliding_window = None
    # an attention that takes no explicit mask
    model.config._attn_implementation = "flash_attention_2"
    assert shared_prefix.packed_prefix_trie(model.config, ids, mask) is None


def test_a_cpu_takes_the_dense_mask_only_up_to_its_own_bound(monkeypatch):
    # the rows' trie has 141 distinct tokens (of 6 x 80 padded positions)
    ids, mask = pad_rows(_rows())
    config = _model().config
    trie = shared_prefix.packed_prefix_trie(config, ids, mask)
    assert trie is not None and len(trie) == 141
    monkeypatch.setattr(shared_prefix, "PACKED_MAX_TOKENS_CPU", 140)
    assert shared_prefix.packed_max_tokens("cpu") == 140
    assert shared_prefix.packed_prefix_trie(config, ids, mask) is None  # a forward per node
    assert shared_prefix.packed_max_tokens("cuda") == shared_prefix.PACKED_MAX_TOKENS
    monkeypatch.setattr(shared_prefix, "PACKED_MAX_TOKENS", 100)  # the general bound holds too
    assert shared_prefix.packed_max_tokens("cpu") == 100


def _composer_samples():
    """A group of four rollouts of one prompt with hinted teacher contexts, and two trace
    pairs of one agent prompt: every stream of the composer step over shared prefixes."""
    from composer_replication.samples.wire import DPOPairTokens, TrainingSample

    gen = torch.Generator().manual_seed(5)

    def ids(n):
        return torch.randint(10, 2000, (n,), generator=gen).tolist()

    prompt, samples = ids(40), []
    for k, n in enumerate((7, 9, 4, 12)):
        completion, hint = ids(n), ids(6 + k)
        mask = [0] * 40 + [1] * n
        sample = TrainingSample(
            [*prompt, *completion],
            mask,
            [0.0] * 40 + (-torch.rand(n, generator=gen) * 3 - 5).tolist(),
            advantages=[(k - 1.5) * m for m in mask],
        )
        sample.teacher_input_ids = [*prompt, *hint, *completion]
        sample.teacher_index = [-1] * 40 + [40 + len(hint) + i for i in range(n)]
        sample.jsd_weights = [0.0] * 40 + [0.2] * n
        samples.append(sample)
    agent = ids(50)
    for weight in (1.0, 0.5):
        chosen, rejected = ids(6), ids(4)
        pair = DPOPairTokens(
            [*agent, *chosen], [0] * 50 + [1] * 6, [*agent, *rejected], [0] * 50 + [1] * 4,
            weight=weight,
        )  # fmt: skip
        samples.append(TrainingSample([], [], [], dpo=pair))
    return samples


def _composer_step_inputs(model):
    """A composer step's inputs for ``model``: its frozen initial teacher (the policy is then
    moved away from it and from its reference), the composer samples packed into one
    micro-batch, and the loss settings."""
    from composer_replication.samples.wire import pack_samples
    from composer_replication.training.step import LossConfig
    from composer_replication.training.teachers import TeacherModels

    teachers = TeacherModels(model, mode="initial")
    with torch.no_grad():
        for param in model.parameters():
            param.add_(0.01 * torch.randn_like(param))
    batches = pack_samples(_composer_samples(), max_tokens=4096, split=None)
    return teachers, batches, LossConfig(replay_dpo_beta=0.1, sdpo_jsd_beta=0.5)


def test_the_composer_step_is_the_same_with_shared_prefixes(sharing_path):
    from composer_replication.model.shared_prefix import prefix_sharing, prefix_sharing_enabled
    from composer_replication.training.step import train_step

    model = tiny_model(seed=1).double().train()
    teachers, batches, cfg = _composer_step_inputs(model)
    results = {}
    for sharing in (False, True):
        with prefix_sharing(sharing):
            assert prefix_sharing_enabled() is sharing
            model.zero_grad(set_to_none=True)
            metrics = train_step(
                model, batches, cfg, teacher=teachers.teacher(model), reference=teachers.reference
            )
            results[sharing] = (metrics, _grads_of(model))
    assert prefix_sharing_enabled() is True  # restored
    (plain, plain_g), (shared, shared_g) = results[False], results[True]
    assert plain["tokens/jsd"] == 32 and plain["tokens/dpo"] == 2 and plain["loss/dpo"] > 0
    assert shared["tokens/forward"] < plain["tokens/forward"]  # what sharing changes
    for key, value in plain.items():
        if key not in ("tokens/forward", "tokens/padding_fraction"):
            assert shared[key] == pytest.approx(value, rel=1e-9, abs=1e-12), key
    # Llama's RMSNorm computes in float32 even in a float64 model: gradients summed over
    # the rows before (shared) or after (row by row) that norm differ at float32 rounding
    for name, grad in plain_g.items():
        error = (shared_g[name] - grad).norm() / grad.norm()
        assert error < 1e-6, (name, float(error))


def _grads_of(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_leaves_of_very_different_lengths_take_separate_batches():
    from composer_replication.model.shared_prefix import BATCH_OVERHEAD_TOKENS, length_batches

    lengths = [45, 140, 44, 45, 139]  # from start 40: tails 5, 100, 4, 5, 99
    # one batch: 5 x 100 padded tokens; two: 3 x 5 + 2 x 100 and one more forward
    assert length_batches([0, 1, 2, 3, 4], lengths, 40) == [([0, 2, 3], 45), ([1, 4], 140)]
    # tails this close are not worth a forward of their own
    assert length_batches([0, 2, 3], lengths, 40) == [([0, 2, 3], 45)]
    assert length_batches([], lengths, 40) == []
    assert BATCH_OVERHEAD_TOKENS > 0


def test_a_node_with_long_and_short_leaves_still_matches_the_row_by_row_forward(monkeypatch):
    monkeypatch.setattr(shared_prefix, "PACKED_MAX_TOKENS", 0)  # the tree path's leaf batches
    model = _model()
    rows = [SYSTEM + list(range(600, 700)), [*SYSTEM, 1, 2], SYSTEM + list(range(700, 790))]
    ids, mask = pad_rows(rows)
    (node,), _ = prefix_tree(ids, mask)
    assert node.leaf_batches == [([1], 42), ([0, 2], 140)]
    plain_h, plain_g = _hidden_and_grads(model, ids, mask, share=False)
    shared_h, shared_g = _hidden_and_grads(model, ids, mask, share=True)
    torch.testing.assert_close(shared_h[mask.bool()], plain_h[mask.bool()], rtol=1e-5, atol=1e-5)
    for name, grad in plain_g.items():
        assert (shared_g[name] - grad).norm() / grad.norm() < 1e-5, name
