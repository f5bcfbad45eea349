"""The decode loop against Hugging Face ``generate``; its sampler; packed linear layers."""

from __future__ import annotations

import pytest
import torch

from composer_replication.inference.decoding.decode import decode_rows, sample_categorical
from composer_replication.inference.decoding.generate import SamplingSettings, generate
from composer_replication.inference.decoding.packed_linear import (
    packed_linear_available,
    packed_linears,
)


def _decode(model, tok, prompts, max_new_tokens, temperature):
    return decode_rows(
        model,
        prompts,
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
    )


def _hf_greedy(model, tok, prompts, max_new_tokens):
    """The peer: transformers' own generate, greedy, with its per-step scores."""
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = (
        torch.arange(width)[None, :] >= torch.tensor([width - len(p) for p in prompts])[:, None]
    ).long()
    with torch.no_grad():
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            return_dict_in_generate=True,
            output_logits=True,
            top_k=None,
            top_p=None,
        )
    new = out.sequences[:, width:]
    lps = torch.stack([torch.log_softmax(x.float(), -1) for x in out.logits], 1)
    picked = lps.gather(-1, new[:, :, None]).squeeze(-1)
    rows = []
    for r in range(len(prompts)):
        toks = new[r].tolist()
        n = next((i + 1 for i, t in enumerate(toks) if t == tok.eos_token_id), len(toks))
        rows.append((toks[:n], picked[r, :n].tolist()))
    return rows


def test_greedy_equals_transformers_generate(tiny):
    model, tok = tiny
    base = [
        tok("def add(a, b):")["input_ids"],
        tok("x = ")["input_ids"],
        tok("for i in")["input_ids"],
    ]
    prompts = [base[0], base[1], base[0], base[2], base[0]]  # different lengths, repeats
    ours = _decode(model, tok, prompts, 16, 0.0)
    peer = _hf_greedy(model, tok, prompts, 16)
    for row, (tokens, logprobs) in zip(ours, peer):
        assert row.tokens == tokens
        torch.testing.assert_close(
            torch.tensor(row.logprobs), torch.tensor(logprobs), atol=1e-5, rtol=1e-5
        )


class _RowRecorder:
    """Records the batch size of every forward call of the model."""

    def __init__(self, model):
        self.rows: list[int] = []
        self.handle = model.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs):
        self.rows.append(int(kwargs["input_ids"].shape[0]))

    def close(self):
        self.handle.remove()


def test_distinct_prompts_prefilled_once_and_finished_rows_leave(tiny):
    model, tok = tiny
    short, long = tok("a")["input_ids"], tok("def f(x):")["input_ids"]
    prompts = [short] * 3 + [long] * 3
    # a stop string that some rows hit early: the first decoded piece of the greedy rows
    first = decode_rows(
        model, [short], max_new_tokens=1, temperature=0.0, eos_ids=[-1], pad_id=tok.pad_token_id
    )[0]
    stop = tok.decode(first.tokens)
    recorder = _RowRecorder(model)
    try:
        rows = decode_rows(
            model,
            prompts,
            max_new_tokens=6,
            temperature=0.0,
            eos_ids=[-1],
            pad_id=tok.pad_token_id,
            tokenizer=tok,
            stop_strings=[stop],
        )
    finally:
        recorder.close()
    assert recorder.rows[0] == 2  # two distinct prompts, prefilled once each
    stopped = [i for i, r in enumerate(rows) if r.finish_reason == "stop"]
    assert {0, 1, 2} <= set(stopped)  # the short prompt's greedy rows stop at once
    assert [r.tokens for r in rows[:3]] == [first.tokens] * 3
    # after they stopped, only the remaining rows are computed
    assert recorder.rows[1] == len(prompts) - len(stopped)
    assert all(n <= len(prompts) - len(stopped) for n in recorder.rows[1:])


def test_sampled_logprobs_equal_a_full_forward(tiny):
    model, tok = tiny
    prompts = [tok("def add(a, b):")["input_ids"]] * 3 + [tok("x")["input_ids"]]
    torch.manual_seed(0)
    rows = _decode(model, tok, prompts, 10, 0.7)
    for prompt, row in zip(prompts, rows):
        ids = torch.tensor([prompt + row.tokens])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        ref = torch.log_softmax(logits / 0.7, -1).gather(-1, torch.tensor(row.tokens)[:, None])
        torch.testing.assert_close(
            torch.tensor(row.logprobs), ref.squeeze(-1), atol=1e-4, rtol=1e-4
        )
    # the same seed, the same samples
    torch.manual_seed(0)
    again = _decode(model, tok, prompts, 10, 0.7)
    assert [r.tokens for r in again] == [r.tokens for r in rows]


def test_sample_categorical_draws_the_distribution():
    probs = torch.tensor([0.5, 0.0, 0.2, 0.25, 0.05, 0.0])
    log_probs = probs.log().expand(4000, -1)  # log(0) = -inf: never drawn
    torch.manual_seed(0)
    draws = torch.cat([sample_categorical(log_probs) for _ in range(5)])
    counts = torch.bincount(draws, minlength=6).double()
    assert counts[1] == 0 and counts[5] == 0
    expected = probs.double() * draws.numel()
    keep = expected > 0
    chi2 = (((counts - expected) ** 2)[keep] / expected[keep]).sum().item()
    assert chi2 < 16.27  # chi-square, 3 degrees of freedom, p = 0.001
    # one uniform per row from the global RNG: reproducible under a seed
    torch.manual_seed(1)
    a = sample_categorical(log_probs[:10])
    torch.manual_seed(1)
    assert torch.equal(sample_categorical(log_probs[:10]), a)


def test_decode_places_its_inputs_on_the_model_device(tiny):
    from composer_replication.model.loading import tiny_model

    model = tiny_model(seed=0).to("meta").eval()
    seen: list[set[str]] = []

    class Stop(Exception):
        pass

    def hook(module, args, kwargs):
        seen.append({t.device.type for t in kwargs.values() if isinstance(t, torch.Tensor)})
        raise Stop

    handle = model.register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with pytest.raises(Stop):
            decode_rows(
                model, [[1, 2, 3], [4, 5]], max_new_tokens=2, temperature=1.0, eos_ids=[0], pad_id=0
            )
    finally:
        handle.remove()
    assert seen == [{"meta"}]
    assert packed_linear_available(model) is False


def test_packed_linears_match_and_restore(tiny):
    model, tok = tiny
    if not packed_linear_available(model):
        pytest.skip("this torch build has no oneDNN linear")
    ids = torch.tensor([tok("def add(a, b): return a + b")["input_ids"]] * 3)
    with torch.no_grad():
        plain = model(input_ids=ids).logits
        with packed_linears(model, batch_hint=3) as used:
            packed = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert used is True
    torch.testing.assert_close(packed, plain, atol=1e-4, rtol=1e-4)
    assert torch.equal(after, plain)  # exactly the plain path again
    assert not any("forward" in m.__dict__ for m in model.modules())
    # sampling through generate uses it and still reports the trainer's log-probs
    gens = generate(
        model, tok, [ids[0].tolist()], SamplingSettings(max_new_tokens=5, temperature=0)
    )
    assert len(gens[0].completion_ids) >= 1


def test_packed_linears_leave_other_models_alone(tiny):
    model, _ = tiny
    bf16 = type(model)(model.config).to(torch.bfloat16)
    assert packed_linear_available(bf16) is False
    with packed_linears(bf16) as used:
        assert used is False
        assert not any("forward" in m.__dict__ for m in bf16.modules())


def test_seeded_rows_sample_a_group_the_same_in_any_batch(tiny):
    """Inside ``seeded_rows`` a row's completion depends on the seed, its prompt and its
    place in its group only: the same in a batch of its own and among other prompts (what
    makes ranks sample exactly what one process would)."""
    from composer_replication.inference.decoding.generate import row_seeds, seeded_rows

    model, tok = tiny
    a, b = [5, 6, 7, 8], [9, 10]
    settings = SamplingSettings(max_new_tokens=12, temperature=1.0)
    with seeded_rows(123):
        together = generate(model, tok, [a, b, a, b], settings)
        alone_a = generate(model, tok, [a, a], settings)
        alone_b = generate(model, tok, [b, b], settings)
    assert [g.completion_ids for g in together] == [
        alone_a[0].completion_ids,
        alone_b[0].completion_ids,
        alone_a[1].completion_ids,
        alone_b[1].completion_ids,
    ]
    for mixed, own in zip(together, [alone_a[0], alone_b[0], alone_a[1], alone_b[1]]):
        assert mixed.logprobs == pytest.approx(own.logprobs, abs=1e-5)
    # the k-th sample of a group differs from the first; another seed samples otherwise
    assert together[0].completion_ids != together[2].completion_ids
    with seeded_rows(124):
        other = generate(model, tok, [a, a], settings)
    assert [g.completion_ids for g in other] != [g.completion_ids for g in alone_a]
    seeds = row_seeds(1, [a, b, a])
    assert len(set(seeds)) == 3 and seeds == row_seeds(1, [a, b, a])
    # outside the context the global generator draws, as before
    torch.manual_seed(0)
    first = generate(model, tok, [a], settings)
    torch.manual_seed(0)
    assert generate(model, tok, [a], settings)[0].completion_ids == first[0].completion_ids


def test_row_generators_must_match_the_rows():
    with pytest.raises(ValueError, match="2 generators for 3 rows"):
        sample_categorical(torch.zeros(3, 4), [torch.Generator(), torch.Generator()])


def test_prompt_lookup_drafts_what_followed_the_last_ngram():
    from composer_replication.inference.decoding.decode import PromptLookup

    lookup = PromptLookup([1, 2, 3, 4, 5, 1, 2], n=2)
    assert lookup.draft(3) == [3, 4, 5]  # "1 2" was followed by 3 4 5
    assert lookup.draft(0) == []
    lookup.extend([9])  # "2 9" never occurred before
    assert lookup.draft(3) == []
    lookup.extend([1, 2])  # the latest earlier "1 2" is now the one followed by 9
    assert lookup.draft(2) == [9, 1]
    assert PromptLookup([7], n=3).draft(4) == []
    with pytest.raises(ValueError, match="n=0"):
        PromptLookup([1], n=0)


@pytest.fixture(scope="module")
def sharp(tiny):
    """The tiny model with its final norm scaled up: peaked next-token distributions, so
    sampled rows fall into repetitions (as a trained model copies its prompt) and drafts
    get kept at a temperature above 0."""
    from composer_replication.model.loading import tiny_model

    # seed 5: its sharpened rows end at different steps (EOS), which the joining tests need
    sharp = tiny_model(seed=5)
    tok = tiny[1]
    with torch.no_grad():
        sharp.model.norm.weight.mul_(60.0)
    return sharp.eval(), tok


def _repetitive_prompts(tok):
    # repeated text gives the drafts something to copy, as code answers copy their prompt
    line = "def total(values):\n    return sum(values)\n"
    return [
        tok(line * 3)["input_ids"],
        tok("x = [1, 2, 3]\n" * 4)["input_ids"],
        tok("a")["input_ids"],
    ]


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_drafts_change_no_token_and_save_forwards(sharp, temperature):
    """Drafts decide how many tokens a forward yields, never which: with the same row
    seeds, decoding with drafts samples exactly what one token per forward samples."""
    from composer_replication.inference.decoding.decode import DecodeStats
    from composer_replication.inference.decoding.generate import row_seeds

    model, tok = sharp
    prompts = _repetitive_prompts(tok)
    prompts = [prompts[0], prompts[1], prompts[0], prompts[2]]
    seeds = row_seeds(7, prompts)
    runs = {}
    for budget in (0, 8, 64):
        stats = DecodeStats()
        rows = decode_rows(
            model,
            prompts,
            max_new_tokens=40,
            temperature=temperature,
            eos_ids=[tok.eos_token_id],
            pad_id=tok.pad_token_id,
            row_seeds=seeds,
            draft_token_budget=budget,
            stats=stats,
        )
        runs[budget] = (rows, stats)
    plain, plain_stats = runs[0]
    assert plain_stats.drafted == 0 and plain_stats.accepted == 0
    for budget in (8, 64):
        rows, stats = runs[budget]
        assert [r.tokens for r in rows] == [r.tokens for r in plain]
        assert [r.finish_reason for r in rows] == [r.finish_reason for r in plain]
        for row, ref in zip(rows, plain):
            assert row.logprobs == pytest.approx(ref.logprobs, abs=2e-5)
        assert stats.accepted > 0 and stats.drafted >= stats.accepted
        assert stats.forwards < plain_stats.forwards
    # a larger budget drafts more per forward
    assert runs[64][1].forwards <= runs[8][1].forwards


def test_drafted_decoding_compacts_its_cache_and_matches_the_full_forward(sharp):
    """Rejected drafts fill the cache with masked positions; compaction drops them without
    changing any later token or log-prob."""
    from composer_replication.inference.decoding.decode import DecodeStats

    model, tok = sharp
    prompts = _repetitive_prompts(tok)
    stats = DecodeStats()
    torch.manual_seed(3)
    rows = decode_rows(
        model,
        prompts,
        max_new_tokens=120,
        temperature=4.0,  # some drafted tokens are drawn otherwise
        eos_ids=[-1],
        pad_id=tok.pad_token_id,
        draft_token_budget=64,
        stats=stats,
    )
    assert stats.compactions > 0 and stats.drafted > stats.accepted
    for prompt, row in zip(prompts, rows):
        assert len(row.tokens) == 120 and row.finish_reason == "length"
        ids = torch.tensor([prompt + row.tokens])
        with torch.no_grad():
            logits = model(input_ids=ids).logits[0, len(prompt) - 1 : -1].float()
        ref = torch.log_softmax(logits / 4.0, -1).gather(-1, torch.tensor(row.tokens)[:, None])
        torch.testing.assert_close(
            torch.tensor(row.logprobs), ref.squeeze(-1), atol=1e-4, rtol=1e-4
        )


def test_draft_budget_must_not_be_negative(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="draft_token_budget=-1"):
        decode_rows(
            model,
            [[1, 2]],
            max_new_tokens=2,
            temperature=0.0,
            eos_ids=[0],
            pad_id=0,
            draft_token_budget=-1,
        )


def test_prompt_states_are_reused_and_change_no_sample(tiny):
    """Inside ``reuse_prompt_states`` a prompt is prefilled once over several calls, and
    the rows sample what they sample without it."""
    from composer_replication.inference.decoding.decode import DecodeStats
    from composer_replication.inference.decoding.generate import reuse_prompt_states, seeded_rows
    from composer_replication.inference.decoding.kv_cache import PromptStates

    model, tok = tiny
    a, b = [5, 6, 7, 8, 9], [9, 10]
    store = PromptStates()
    counts = []
    rows = []
    for prompts in ([a, b, a], [b, a]):
        stats = DecodeStats()
        rows.append(
            decode_rows(
                model,
                prompts,
                max_new_tokens=6,
                temperature=0.0,
                eos_ids=[-1],
                pad_id=tok.pad_token_id,
                prompt_states=store,
                stats=stats,
            )
        )
        counts.append(stats.prefilled)
    assert counts == [len(a) + len(b), 0] and len(store) == 2
    assert rows[1][0].tokens == rows[0][1].tokens and rows[1][1].tokens == rows[0][0].tokens
    fresh = _decode(model, tok, [b, a], 6, 0.0)
    assert [r.tokens for r in fresh] == [r.tokens for r in rows[1]]
    for cached, plain in zip(rows[1], fresh):
        assert cached.logprobs == pytest.approx(plain.logprobs, abs=1e-5)
    # through generate: the context keeps the states of every call inside it
    settings = SamplingSettings(max_new_tokens=5, temperature=1.0)
    with seeded_rows(3):
        plain = generate(model, tok, [a, a], settings)
        with reuse_prompt_states() as states:
            generate(model, tok, [a], SamplingSettings(max_new_tokens=5, temperature=0.0))
            assert len(states) == 1
            again = generate(model, tok, [a, a], settings)
    assert [g.completion_ids for g in again] == [g.completion_ids for g in plain]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_rows_join_as_others_finish_and_sample_the_same(sharp, temperature):
    """With ``max_rows`` only that many rows decode at once; the rest join as rows finish
    (their prompts' states appended to the running batch) and sample exactly what they
    sample all in one batch."""
    from composer_replication.inference.decoding.decode import DecodeStats
    from composer_replication.inference.decoding.generate import row_seeds

    model, tok = sharp
    base = _repetitive_prompts(tok)
    prompts = [base[0], base[1], base[2], base[0], tok("def f(x):")["input_ids"], base[2]]
    # rows of different lengths: some finish early on a stop string, others run to the end
    first = decode_rows(
        model, [base[2]], max_new_tokens=3, temperature=0.0, eos_ids=[-1], pad_id=0
    )[0]
    settings = dict(
        max_new_tokens=24,
        temperature=temperature,
        eos_ids=[tok.eos_token_id],
        pad_id=tok.pad_token_id,
        tokenizer=tok,
        stop_strings=[tok.decode(first.tokens[1:3])],
        row_seeds=row_seeds(11, prompts),
    )
    together = decode_rows(model, prompts, **settings)
    recorder = _RowRecorder(model)
    stats = DecodeStats()
    try:
        joined = decode_rows(model, prompts, max_rows=2, stats=stats, **settings)
    finally:
        recorder.close()
    assert [r.tokens for r in joined] == [r.tokens for r in together]
    assert [r.finish_reason for r in joined] == [r.finish_reason for r in together]
    for a, b in zip(joined, together):
        assert a.logprobs == pytest.approx(b.logprobs, abs=2e-5)
    assert len({r.finish_reason for r in together}) > 1  # rows did end at different times
    assert max(recorder.rows) <= 2  # never more than max_rows rows in a forward
    assert stats.prefilled == sum(len(p) for p in {tuple(p) for p in prompts})
    with pytest.raises(ValueError, match="max_rows=0"):
        decode_rows(model, prompts, max_rows=0, **settings)


def test_forward_cost_and_the_drafts_worth_checking():
    from composer_replication.inference.decoding.decode import (
        FORWARD_COST,
        draft_positions,
        forward_cost,
    )

    for tokens, cost in FORWARD_COST:
        assert forward_cost(tokens) == pytest.approx(cost)
    assert forward_cost(12) == pytest.approx((1.1 + 1.8) / 2)
    assert forward_cost(256) == pytest.approx(7.6 + (7.6 - 3.8) * 2)
    assert forward_cost(0) == pytest.approx(1.0)
    # a full batch pays for every drafted position: only well-accepted drafts are worth it
    assert draft_positions([[1, 2, 3]] * 8, [0.5] * 8) == 1
    assert draft_positions([[1, 2, 3]] * 8, [0.9] * 8) == 4
    # 8 x 4 positions cost 2.2 forwards of 8 x 1; at acceptance 0.9 they yield
    # 8 * (1 + 0.9 + 0.81 + 0.729) tokens: 12.5 per unit against 7.3 without drafts
    assert 8 * (1 + 0.9 + 0.81 + 0.729) / forward_cost(32) > 8 / forward_cost(8)
    # a lone row checks long drafts even at a middling acceptance; no drafts, one position
    assert draft_positions([[1] * 7], [0.5]) == 6
    assert draft_positions([[], []], [0.9, 0.9]) == 1
    assert draft_positions([[1, 2]] * 64, [0.9] * 64) == 1
