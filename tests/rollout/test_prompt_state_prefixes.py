"""Prompt states reused across an agent's turns: a prompt that extends a kept one forwards
only its new tokens, with the state a whole prefill gives; the store keeps a byte budget."""

from __future__ import annotations

import pytest
import torch

from composer_replication.inference.decoding.kv_cache import (
    PromptStates,
    extend_state,
    prompt_states,
)


def test_extending_a_state_equals_prefilling_the_whole_prompt(tiny):
    model, _ = tiny
    first = tuple(range(5, 40))
    longer = (*first, 101, 102, 103, 7)
    store = PromptStates()
    states, forwarded = prompt_states(model, [first], 0, store)
    assert forwarded == len(first)
    extended, forwarded = prompt_states(model, [longer], 0, store)
    assert forwarded == 4  # only the new tokens
    whole, _ = prompt_states(model, [longer], 0, PromptStates())
    got, want = extended[longer], whole[longer]
    assert got.length == want.length == len(longer)
    for a, b in zip([*got.keys, *got.values], [*want.keys, *want.values]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    # the turn the shorter prompt served is over: only the newest state is kept
    assert store.get(model, first) is None and store.get(model, longer) is not None
    direct = extend_state(model, states[first], [101, 102, 103, 7])
    torch.testing.assert_close(direct.logits, want.logits, atol=1e-4, rtol=1e-4)


def test_the_store_keeps_its_byte_budget_dropping_the_least_recent(tiny):
    model, _ = tiny
    prompts = [tuple(range(k, k + 20)) for k in (1, 100, 200)]
    probe = PromptStates()
    prompt_states(model, prompts[:1], 0, probe)
    one = probe.bytes
    store = PromptStates(max_bytes=2 * one)
    prompt_states(model, prompts[:2], 0, store)
    assert store.get(model, prompts[0]) is not None  # used: now the newest
    prompt_states(model, prompts[2:], 0, store)
    assert len(store) == 2 and store.bytes == 2 * one
    assert store.get(model, prompts[1]) is None  # the least recently used went
    assert store.longest_prefix(model, (*prompts[0], 9)) == (
        prompts[0],
        store.get(model, prompts[0]),
    )
    assert store.longest_prefix(model, prompts[0]) is None  # strictly longer prompts only


def test_two_prompts_that_extend_one_kept_prompt_both_extend_it(tiny):
    """The kept state goes only once the last prompt extending it is extended (sampled rows
    of one group share their first turn)."""
    model, _ = tiny
    first = tuple(range(5, 30))
    a, b = (*first, 11, 12), (*first, 13)
    store = PromptStates()
    prompt_states(model, [first], 0, store)
    states, forwarded = prompt_states(model, [a, b], 0, store)
    assert forwarded == 3  # both from the kept state
    assert store.get(model, first) is None and len(store) == 2
    whole, _ = prompt_states(model, [a, b], 0, PromptStates())
    for prompt in (a, b):
        torch.testing.assert_close(
            states[prompt].logits, whole[prompt].logits, atol=1e-4, rtol=1e-4
        )


def test_relayout_consumes_the_old_cache_and_keeps_every_row(tiny):
    """Rows of a running cache and rows joining from prompt states, right-aligned in a new
    cache; the old cache's layers are let go as they are copied."""
    from composer_replication.inference.decoding.kv_cache import relayout

    model, _ = tiny
    prompts = [tuple(range(3, 3 + n)) for n in (6, 9, 4)]
    states, _ = prompt_states(model, prompts, 0, PromptStates())
    cache, mask = relayout(model, None, None, [states[p] for p in prompts[:2]], room=4)
    assert mask.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9]
    old_layers = list(cache.layers)
    grown, grown_mask = relayout(model, cache, mask, [states[prompts[2]]], room=4)
    assert all(layer.keys.numel() == 0 for layer in old_layers)  # consumed
    assert grown_mask.tolist() == [[0, 0, 0, 1, 1, 1, 1, 1, 1], [1] * 9, [0] * 5 + [1] * 4]
    for layer_index, layer in enumerate(grown.layers):
        for row, prompt in enumerate(prompts):
            n = len(prompt)
            torch.testing.assert_close(
                layer.keys[row, :, 9 - n :], states[prompt].keys[layer_index]
            )
            torch.testing.assert_close(
                layer.values[row, :, 9 - n :], states[prompt].values[layer_index]
            )


def test_relayout_writes_into_the_new_caches_own_buffers(tiny):
    """The rows go straight into buffers of the whole capacity (no second copy of the
    cache), the filler before a row's positions is zero."""
    from composer_replication.inference.decoding.kv_cache import cache_capacity, relayout

    model, _ = tiny
    prompts = [tuple(range(3, 3 + n)) for n in (6, 9)]
    states, _ = prompt_states(model, prompts, 0, PromptStates())
    cache, _mask = relayout(model, None, None, [states[p] for p in prompts], room=5)
    assert cache_capacity(cache) == 14 and cache.get_seq_length() == 9
    for layer in cache.layers:
        assert layer._key_buffer.shape[2] == 14
        assert layer.keys.data_ptr() == layer._key_buffer.data_ptr()  # a view, not a copy
        assert not layer.keys[0, :, :3].any() and not layer.values[0, :, :3].any()


def test_compacting_rows_in_place_equals_selecting_them(tiny):
    """Rows that stay move down inside the same buffers (no new allocation), with what
    selecting them gives; the next forward writes after them as before."""
    from composer_replication.inference.decoding.kv_cache import compact_rows, relayout

    model, _ = tiny
    prompts = [tuple(range(3, 3 + n)) for n in (6, 9, 4, 7, 8)]
    states, _ = prompt_states(model, prompts, 0, PromptStates())
    cache, _mask = relayout(model, None, None, [states[p] for p in prompts], room=3)
    keep = [1, 3, 4]
    want = [(layer.keys[keep].clone(), layer.values[keep].clone()) for layer in cache.layers]
    buffers = [layer._key_buffer.data_ptr() for layer in cache.layers]
    compact_rows(cache, keep)
    assert [layer._key_buffer.data_ptr() for layer in cache.layers] == buffers
    for layer, (keys, values) in zip(cache.layers, want):
        assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    step = torch.randn(3, *cache.layers[0].keys.shape[1:2], 1, cache.layers[0].keys.shape[3])
    keys, _ = cache.layers[0].update(step, step)
    assert keys.shape[0] == 3 and torch.equal(keys[:, :, -1:], step)
    with pytest.raises(ValueError, match="ascending"):
        compact_rows(cache, [2, 0])


def test_prefill_chunks_bound_rows_and_padded_tokens(monkeypatch):
    """Long prompts (an agent's late turns) prefill in fewer rows a forward; one prompt over
    the token bound still goes, alone."""
    from composer_replication.inference.decoding import kv_cache

    monkeypatch.setattr(kv_cache, "PREFILL_TOKENS", 100)
    monkeypatch.setattr(kv_cache, "PREFILL_ROWS", 3)
    prompts = [tuple(range(n)) for n in (10, 10, 20, 20, 30, 40, 120)]
    chunks = kv_cache._prefill_chunks(prompts)
    assert [[len(p) for p in chunk] for chunk in chunks] == [[10, 10, 20], [20, 30], [40], [120]]
    assert all(len(c) * max(map(len, c)) <= 100 for c in chunks[:-1])


def test_states_prefilled_in_token_bounded_chunks_equal_one_forward_each(tiny, monkeypatch):
    from composer_replication.inference.decoding import kv_cache

    model, _ = tiny
    prompts = [tuple(range(2, 2 + n)) for n in (7, 12, 30)]
    alone = {p: prompt_states(model, [p], 0, PromptStates())[0][p] for p in prompts}
    monkeypatch.setattr(kv_cache, "PREFILL_TOKENS", 40)  # chunks [7, 12], [30]
    states, forwarded = prompt_states(model, prompts, 0, PromptStates())
    assert forwarded == sum(map(len, prompts))
    for p in prompts:
        assert states[p].length == len(p)
        for a, b in zip([*states[p].keys, *states[p].values], [*alone[p].keys, *alone[p].values]):
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(states[p].logits, alone[p].logits, atol=1e-4, rtol=1e-4)


def test_an_episode_keeps_one_copy_of_its_state_and_its_next_turn_extends_the_finished_row(
    tiny,
):
    """With ``keep_finished`` (agent episodes) a prompt's kept state goes once its row is in
    the batch, a finished row's state (prompt and tokens but the last) is kept instead, and
    the next turn forwards only the last token and what follows it; every turn samples what
    it samples without that."""
    from composer_replication.inference.decoding.decode import DecodeStats, decode_rows

    model, _ = tiny
    first_turn = [tuple(range(3, 3 + n)) for n in (9, 14, 6)]
    observation = (401, 402, 403)

    def two_turns(store: PromptStates) -> tuple[list, DecodeStats, list]:
        def turn(prompts: list) -> tuple[list, DecodeStats]:
            stats = DecodeStats()
            rows = decode_rows(
                model,
                prompts,
                max_new_tokens=6,
                temperature=1.0,
                eos_ids=[],
                pad_id=0,
                row_seeds=[11, 12, 13],
                max_rows=2,  # the third row joins as one finishes
                prompt_states=store,
                stats=stats,
            )
            return rows, stats

        rows, _ = turn(first_turn)
        kept = sorted(len(prompt) for _, prompt in store._states)
        second_turn = [(*p, *r.tokens, *observation) for p, r in zip(first_turn, rows)]
        later, stats = turn(second_turn)
        return [r.tokens for r in (*rows, *later)], stats, kept

    plain, plain_stats, _ = two_turns(PromptStates())
    one_copy = PromptStates(keep_finished=True)
    tokens, stats, kept = two_turns(one_copy)
    assert tokens == plain
    # after the first turn: only the finished rows' states, each its prompt + 5 tokens
    assert kept == sorted(len(p) + 5 for p in first_turn)
    # the second turn forwards the last sampled token and the observation of each row
    assert stats.prefilled == 3 * (1 + len(observation))
    assert plain_stats.prefilled == 3 * (6 + len(observation))
    assert all(state.logits is None for state in one_copy._states.values())


def test_relayout_consumes_the_states_it_is_told_nothing_else_reads(tiny):
    from composer_replication.inference.decoding.kv_cache import relayout

    model, _ = tiny
    prompts = [tuple(range(3, 3 + n)) for n in (6, 9)]
    states, _ = prompt_states(model, prompts, 0, PromptStates())
    copies = {p: [t.clone() for t in states[p].keys] for p in prompts}
    cache, _ = relayout(
        model, None, None, [states[p] for p in prompts], room=2, consumed=[True, False]
    )
    assert all(t.numel() == 0 for t in [*states[prompts[0]].keys, *states[prompts[0]].values])
    assert all(t.numel() for t in states[prompts[1]].keys)  # not consumed: intact
    for layer_index, layer in enumerate(cache.layers):
        for row, prompt in enumerate(prompts):
            n = len(prompt)
            torch.testing.assert_close(layer.keys[row, :, 9 - n :], copies[prompt][layer_index])


def test_an_ended_episode_drops_every_state_its_tokens_begin_with(tiny):
    model, _ = tiny
    store = PromptStates()
    kept = [(1, 2, 3), (1, 2, 3, 4, 5), (1, 9)]
    states, _ = prompt_states(model, kept, 0, PromptStates())
    for prompt in kept:
        store.put(model, prompt, states[prompt])
    assert store.drop_prefixes([1, 2, 3, 4, 5, 6]) == 2
    assert len(store) == 1 and store.get(model, (1, 9)) is not None
    assert store.bytes == sum(t.numel() * 4 for t in [*states[(1, 9)].keys, *states[(1, 9)].values])


def test_compacting_rows_off_the_host_follows_the_cache_device():
    """On an accelerator the rows that stay are gathered on the cache's device (the meta
    device here: shapes and devices only, no host tensor mixed in)."""
    from composer_replication.inference.decoding.kv_cache import _PreallocatedLayer

    layer = _PreallocatedLayer.make(10)
    states = torch.empty(5, 3, 4, 8, device="meta")
    layer.update(states, states)
    layer.keep_rows([1, 3, 4])
    assert layer.keys.shape == (3, 3, 4, 8) and layer.keys.device.type == "meta"
    assert layer._key_buffer.shape == (3, 3, 10, 8)
    keys, _ = layer.update(states[:3, :, :1], states[:3, :, :1])
    assert keys.shape == (3, 3, 5, 8)
