"""The static decode loop: its forward against the library's, its samples against the general
loop's, its host reads per token, its compiled step against the eager one."""

from __future__ import annotations

import collections

import pytest
import torch

from composer_replication.inference.decoding.decode import DecodeStats, decode_rows
from composer_replication.inference.decoding.decode_buckets import bucket_rows
from composer_replication.inference.decoding.generate import (
    DecodeOptions,
    InProcessSampler,
    SamplingSettings,
    generate,
    seeded_rows,
)
from composer_replication.inference.decoding.llama_decoder import (
    DecoderWeights,
    decode_forward,
    prefill_forward,
    supports,
)
from composer_replication.inference.decoding.static_decode import StaticDecoder
from composer_replication.testing.host_reads import HostReads


@pytest.fixture(scope="module")
def eos_prone(tokenizer):
    """The tiny model of seed 5: sampled at 0.7 and 1.0 its rows hit the frequent-token EOS
    set at many steps (seed 0's rarely do), which the row bookkeeping tests need."""
    from composer_replication.model.loading import tiny_model

    return tiny_model(seed=5).eval(), tokenizer


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, 30, (n,), generator=gen).tolist()
    return [torch.randint(3, 40000, (k,), generator=gen).tolist() for k in lengths]


def _frequent_tokens(model, prompts, k, temperature=1.0):
    """The ``k`` tokens the model samples most often from these prompts (used as EOS so
    rows end at many different steps)."""
    rows = decode_rows(
        model, prompts, max_new_tokens=40, temperature=temperature, eos_ids=[2], pad_id=2
    )
    counts = collections.Counter(t for r in rows for t in r.tokens)
    return [t for t, _ in counts.most_common(k)]


# --------------------------------------------------------------------------- the forward


def _tiny_qwen2():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=300,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
    )
    return Qwen2ForCausalLM(config).eval()


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_forward_matches_the_library_forward(tiny, family):
    model = tiny[0] if family == "llama" else _tiny_qwen2()
    assert supports(model) is None
    w = DecoderWeights(model, torch.float32)
    prompts = [[5, 6, 7, 8, 9], [11, 12], [13, 14, 15, 16, 17, 18, 19]]
    span = max(map(len, prompts))
    ids = torch.tensor([[0] * (span - len(p)) + p for p in prompts])
    valid = torch.tensor([[False] * (span - len(p)) + [True] * len(p) for p in prompts])
    capacity = span + 4
    shape = (w.n_layers, len(prompts), w.n_kv_heads, capacity, w.head_dim)
    keys, values = torch.zeros(shape), torch.zeros(shape)
    with torch.no_grad():
        first = prefill_forward(w, ids, valid, keys[:, :, :, :span], values[:, :, :, :span])
        mask = torch.zeros((len(prompts), capacity), dtype=torch.bool)
        mask[:, :span] = valid
        nxt = torch.tensor([21, 22, 23])
        mask[:, span] = True
        second = decode_forward(w, nxt, valid.sum(-1), torch.tensor([span]), keys, values, mask)
        for i, p in enumerate(prompts):
            ref = model(input_ids=torch.tensor([[*p, int(nxt[i])]])).logits[0].float()
            torch.testing.assert_close(first[i], ref[-2], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(second[i], ref[-1], rtol=1e-5, atol=1e-5)


def test_unsupported_models_say_why():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=100))
    assert "model type 'gpt2'" in supports(gpt2)
    with pytest.raises(ValueError, match="static decoder cannot run this model: model type"):
        DecoderWeights(gpt2, torch.float32)
    with pytest.raises(ValueError, match="decode_loop = 'static' cannot decode this model"):
        generate(
            gpt2,
            _FakeTokenizer(),
            [[1, 2]],
            SamplingSettings(max_new_tokens=2),
            decode=DecodeOptions(loop="static"),
        )


class _FakeTokenizer:
    pad_token_id = 0
    eos_token_id = 1


# --------------------------------------------------------------------------- samples


@pytest.mark.parametrize("temperature", [0.0, 0.7, 1.0])
def test_seeded_rows_sample_what_the_general_loop_samples(eos_prone, temperature):
    """Same row seeds, same tokens: EOS at many steps (rows leave, buckets shrink), a stop
    string, several prompts shared by rows, waves of max_rows."""
    model, tok = eos_prone
    prompts = _prompts(37) + _prompts(5)
    seeds = list(range(100, 100 + len(prompts)))
    eos = _frequent_tokens(model, prompts, 40, temperature)[1:]
    stops = (tok.decode([eos[-1]]), "\n")
    general = decode_rows(
        model,
        prompts,
        max_new_tokens=50,
        temperature=temperature,
        eos_ids=eos[:-1],
        pad_id=2,
        tokenizer=tok,
        stop_strings=stops,
        row_seeds=seeds,
    )
    reasons = collections.Counter(r.finish_reason for r in general)
    assert reasons["eos"] >= 3 and reasons["length"] >= 1, reasons
    for sync_every, max_rows in ((1, None), (7, None), (16, 12)):
        stats = DecodeStats()
        static = StaticDecoder(model, sync_every=sync_every).decode(
            model,
            prompts,
            max_new_tokens=50,
            temperature=temperature,
            eos_ids=eos[:-1],
            tokenizer=tok,
            stop_strings=stops,
            row_seeds=seeds,
            max_rows=max_rows,
            stats=stats,
        )
        for g, s in zip(general, static):
            assert (s.tokens, s.finish_reason) == (g.tokens, g.finish_reason)
            torch.testing.assert_close(s.logprobs, g.logprobs, rtol=0, atol=1e-5)
        if reasons["length"] < len(prompts) // 4 and max_rows is None:
            assert stats.compactions >= 1  # finished rows were trimmed
        assert stats.prefilled == sum(len(p) for p in {tuple(p): 0 for p in prompts})


def test_rows_report_done_as_they_finish(tiny):
    model, _tok = tiny
    prompts = _prompts(12, seed=3)
    eos = _frequent_tokens(model, prompts, 40)
    seen: list[tuple[int, int]] = []
    decoder = StaticDecoder(model, sync_every=4)
    rows = decoder.decode(
        model,
        prompts,
        max_new_tokens=40,
        temperature=1.0,
        eos_ids=eos,
        on_row_done=lambda index, row: seen.append((index, len(row.tokens))),
    )
    assert sorted(i for i, _ in seen) == list(range(len(prompts)))
    assert dict(seen) == {i: len(r.tokens) for i, r in enumerate(rows)}
    # reported in the order the host saw them end: by the window they ended in
    windows = [(n - 1) // 4 for _, n in seen]
    assert windows == sorted(windows)


def test_generate_takes_the_static_loop_when_asked(tiny):
    model, tok = tiny
    prompts = [[1, 2, 3, 4, 5], [7, 8, 9], [1, 2, 3, 4, 5]]
    settings = SamplingSettings(max_new_tokens=20, temperature=1.0, stop_strings=("\n",))
    with seeded_rows(3):
        general = generate(model, tok, prompts, settings)
        static = generate(
            model, tok, prompts, settings, decode=DecodeOptions(loop="static", sync_every=4)
        )
    assert [g.completion_ids for g in static] == [g.completion_ids for g in general]
    assert [g.text for g in static] == [g.text for g in general]


def test_a_sampler_decodes_with_the_loop_it_carries(tiny):
    """The options travel with the sampler, not with the calling thread: a sampler built
    for the static loop takes it in a thread that set nothing, one built for the general
    loop never does."""
    import threading

    from composer_replication.inference.decoding.static_decode import decoder_for

    model, tok = tiny
    settings = SamplingSettings(max_new_tokens=6, temperature=1.0)
    static = InProcessSampler(model, decode=DecodeOptions(loop="static", sync_every=3))
    general = InProcessSampler(model, decode=DecodeOptions(loop="general"))
    worker = threading.Thread(target=static.sample_batch, args=(tok, [[1, 2, 3]], settings))
    worker.start()
    worker.join()
    general.sample_batch(tok, [[1, 2, 3]], settings)
    assert static.decode_loops == {"static": 1}
    assert general.decode_loops == {"general": 1}
    assert decoder_for(model, sync_every=3).sync_every == 3  # the kept decoder's window


def test_autocast_runs_the_products_in_its_dtype(tiny):
    """Under bf16 autocast the static loop decodes with bf16 products and cache: log-probs
    within bf16 rounding of the float32 ones, the cache in bf16."""
    model, tok = tiny
    prompts = _prompts(4, seed=1)
    settings = SamplingSettings(max_new_tokens=8, temperature=0.0)
    static = DecodeOptions(loop="static")
    full = generate(model, tok, prompts, settings, decode=static)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        half = generate(model, tok, prompts, settings, decode=static)
    from composer_replication.inference.decoding.static_decode import decoder_for

    decoder = decoder_for(model, compute_dtype=torch.bfloat16, sync_every=16)
    assert decoder.weights.layers[0].qkv.dtype == torch.bfloat16
    assert all(b.keys.dtype == torch.bfloat16 for b in decoder.buckets())
    first = [(f.logprobs[0], h.logprobs[0]) for f, h in zip(full, half)]
    assert all(abs(a - b) < 0.1 for a, b in first)


# --------------------------------------------------------------------------- host reads


@pytest.mark.parametrize("rows", [4, 40])
def test_one_host_read_per_window_whatever_the_batch(tiny, rows):
    """Inside the token loop the host reads the batch once every ``sync_every`` tokens:
    counted with a dispatch mode, the same for 4 rows and for 40."""
    model, _tok = tiny
    prompts = _prompts(rows, seed=2)
    decoder = StaticDecoder(model, sync_every=8)
    kwargs = {"max_new_tokens": 48, "temperature": 1.0, "eos_ids": [2]}
    decoder.decode(model, prompts, **kwargs)  # buffers allocated outside the count
    with HostReads() as reads:
        out = decoder.decode(model, prompts, **kwargs)
    assert max(len(r.tokens) for r in out) == 48
    assert reads.total <= 48 // 8, reads.counts


# --------------------------------------------------------------------------- compiled


@pytest.mark.slow
def test_compiled_step_matches_eager_and_recompiles_are_bounded(tiny):
    """torch.compile'd steps give the eager greedy tokens and log-probs (1e-5); varied
    batch sizes and prompt lengths compile a bounded number of graphs."""
    from torch._dynamo.utils import counters

    model, _tok = tiny
    torch._dynamo.reset()
    counters.clear()
    eager = StaticDecoder(model, sync_every=8)
    compiled = StaticDecoder(model, sync_every=8, compile=True)
    sizes = ((9, 24), (3, 30), (20, 24), (5, 40), (14, 16), (40, 20), (2, 12), (30, 44))
    cases = [(_prompts(n, seed=n), m) for n, m in sizes]
    shapes = set()
    for prompts, max_new in cases:
        kwargs = {"max_new_tokens": max_new, "temperature": 0.0, "eos_ids": [2]}
        a = eager.decode(model, prompts, **kwargs)
        b = compiled.decode(model, prompts, **kwargs)
        for x, y in zip(a, b):
            assert x.tokens == y.tokens
            torch.testing.assert_close(x.logprobs, y.logprobs, rtol=0, atol=1e-5)
        shapes |= {(b.rows, b.capacity) for b in compiled.buckets()}
    assert len(shapes) >= 3  # several batch buckets and widths were decoded
    # two compiled pieces (BlockKernels), each specialised on its first batch, then with
    # the batch size dynamic: a bounded number of graphs whatever the shapes that follow
    assert counters["stats"]["unique_graphs"] <= 6, dict(counters["stats"])


def test_bucket_rows():
    assert [bucket_rows(n) for n in (1, 8, 9, 200, 256, 257)] == [8, 8, 16, 256, 256, 512]
    assert bucket_rows(3, minimum=1) == 4
