"""One trainer step: the chunked hidden-state path (ours) vs the same step on full logits.

Run: ``python benchmarks/train_step.py`` (a few minutes). SmolLM2-135M-Instruct, a packed
batch of 8 sequences x 512 tokens (64 prompt + 448 completion tokens each), grpo-style rl
weights and advantages, full fine-tune. Each implementation runs in a fresh process on the
same batch; the naive step computes ``model(...).logits -> log_softmax -> gather`` and then
the very same rl component. Printed: time and peak extra memory (RSS) ratios, and the
loss values (they must agree). ``--checkpointing`` turns on activation checkpointing in both
(what a CPU run with long sequences would use), which leaves the LM head as the largest
memory consumer. Both workers fix glibc's mmap threshold at 256 KiB
(:mod:`composer_replication.model.cpu_allocator`; a run turns it on with
``malloc_mmap_threshold``) so that peak RSS counts live tensors rather than freed blocks the
heap kept; ``--glibc-defaults`` measures with glibc's dynamic threshold.

``--composer`` measures the composer step instead: the samples of one real step of the
embedded default recipe (2 tasks x 4 rollouts on ``python_functions``: rl, the SDPO jsd at
error sites with the hinted teacher contexts, and the trace-replay DPO pairs), timed
through ``train_step`` once as the recipe trains them and once as plain grpo (the same
rollouts with the jsd weights, teacher contexts and pairs taken out), in one process, each
four ways: row by row, a forward per shared-prefix tree node, one packed forward of
the rows' token trie under a dense mask, and packed under the block mask in query tiles
(the default).
Printed: seconds per step and per rollout token of each, their ratio, and where the
composer step's extra tokens come from (teacher contexts, pair sequences).

``--episodes ROWS LENGTH PREFIX`` measures the CPU's ways of sharing a prefix on rows shaped
like agent episodes (ROWS rows of about LENGTH tokens, the first PREFIX shared): the
embedded model with the recipes' LoRA (r 16) under the run's autocast, forward and backward
of the rows' last hidden states, each way in a fresh process: packed without padding under
the block mask, attention in query tiles over the key tiles each sees (the default,
``model.packed_attention.tiled_attention``); one packed forward with a dense (N, N) mask;
a forward per prefix-tree node. Printed: seconds, peak extra memory, their ratios, and the
summed magnitudes of the ways' hidden states (equal up to rounding).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import check_count, gib, machine_line, measure, rl_samples, run_case


def _batch(n_seq: int, seq_len: int, vocab: int):
    from composer_replication.samples.wire import pack_samples

    samples = rl_samples(n_seq, seq_len, vocab, n_prompt=64)
    (mb,) = pack_samples(samples, max_tokens=n_seq * seq_len)
    return mb


def naive_step(model, mb, cfg) -> dict:
    """The same rl component, from full logits (the peer)."""
    import torch

    from composer_replication.ops.token_losses import rl_loss

    logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1]
    logprobs = torch.log_softmax(logits / cfg.log_temperature, dim=-1)
    logprobs = logprobs.gather(-1, mb.input_ids[:, 1:, None]).squeeze(-1)
    loss_sum, count = rl_loss(
        logprobs,
        mb.inference_logprobs[:, 1:],
        mb.advantages[:, 1:],
        mb.loss_mask[:, 1:],
        mb.rl_weights[:, 1:],
        mask_low=cfg.mask_low,
        mask_high=cfg.mask_high,
        adv_tau=cfg.adv_tau,
        kl_tau=cfg.kl_tau,
    )
    loss = loss_sum / count
    loss.backward()
    return {"loss": float(loss.detach())}


def worker(
    impl: str, n_seq: int, seq_len: int, checkpointing: bool, repeats: int, mmap_threshold: int
) -> dict:
    import torch

    from composer_replication.model.cpu_allocator import set_mmap_threshold
    from composer_replication.model.loading import load_policy
    from composer_replication.training.step import LossConfig, train_step

    if mmap_threshold:
        set_mmap_threshold(mmap_threshold)
    torch.manual_seed(0)
    model, _ = load_policy()
    model.train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mb = _batch(n_seq, seq_len, model.config.vocab_size)
    cfg = LossConfig()

    def step() -> dict:
        model.zero_grad(set_to_none=True)
        if impl == "naive":
            return naive_step(model, mb, cfg)
        return {"loss": train_step(model, [mb], cfg)["loss"]}

    first = measured_median(step, repeats)
    first["tokens"] = n_seq * seq_len
    return first


def measured_median(step, repeats: int) -> dict:
    """The first (cold) run's result and memory, with the median seconds of ``repeats``."""
    first = measure(step)
    times = [first["seconds"]]
    for _ in range(repeats - 1):
        times.append(measure(step, cold=False)["seconds"])
    first["seconds"] = sorted(times)[len(times) // 2]
    return first


def episode_rows(rows: int, length: int, prefix: int) -> list[list[int]]:
    """``rows`` token rows of about ``length`` tokens whose first ``prefix`` are shared."""
    import random

    rng = random.Random(0)
    shared = [rng.randrange(1000, 40000) for _ in range(prefix)]
    # lengths differ a little, as episodes' do (7 tokens a row)
    return [
        shared + [rng.randrange(1000, 40000) for _ in range(length - prefix - 7 * r)]
        for r in range(rows)
    ]


def episodes_worker(rows: int, length: int, prefix: int, way: str, repeats: int) -> dict:
    import torch

    from composer_replication.config.run import ModelConfig
    from composer_replication.model import packed_attention, shared_prefix
    from composer_replication.model.devices import resolve_precision
    from composer_replication.model.parts import last_hidden_states
    from composer_replication.training.setup import setup_policy

    if way != "tiled":  # the dense-mask packed forward at any size, or never
        packed_attention.PACKING_DEVICES = ()
        shared_prefix.PACKED_MAX_TOKENS = shared_prefix.PACKED_MAX_TOKENS_CPU = (
            1 << 30 if way == "packed" else 0
        )
    policy, _ = setup_policy(ModelConfig(source="embedded", lora={"r": 16, "alpha": 32}))
    autocast = resolve_precision("auto", torch.device("cpu")).compute_dtype
    token_rows = episode_rows(rows, length, prefix)
    width = max(map(len, token_rows))
    ids = torch.zeros(len(token_rows), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(token_rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    kept: dict[str, Any] = {}

    def step() -> dict:
        policy.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=autocast, enabled=autocast is not None):
            hidden = last_hidden_states(policy, ids, mask, row_tokens=token_rows)
            loss = hidden.float()[mask.bool()].pow(2).mean()  # the real positions
        loss.backward()
        kept["hidden"] = hidden.detach().float()[mask.bool()]
        return {"loss": float(loss.detach())}

    first = measured_median(step, repeats)
    trie = shared_prefix.token_trie_of_rows(token_rows)
    first.update(distinct=len(trie), tokens=sum(map(len, token_rows)))
    first["hidden_sum"] = float(kept["hidden"].abs().sum())
    return first


def episodes_case(rows: int, length: int, prefix: int, repeats: int) -> None:
    script = os.path.abspath(__file__)
    args = {"rows": rows, "length": length, "prefix": prefix, "repeats": repeats}
    print(f"machine: {machine_line()}")
    results = {
        way: run_case(script, "episodes", {**args, "way": way})
        for way in ("tiled", "packed", "tree")
    }
    tiled = results["tiled"]
    print(
        f"{rows} rows of about {length} tokens, {prefix} shared: {tiled['tokens']} tokens, "
        f"{tiled['distinct']} distinct (the packed forward's N)"
    )
    for way, r in results.items():
        print(
            f"  {way:6s}: {r['seconds']:5.1f} s forward + backward, peak extra "
            f"{gib(r['peak_extra_bytes'])}, loss {r['loss']:.6f}, |hidden| sum "
            f"{r['hidden_sum']:.1f}"
        )
    for way in ("packed", "tree"):
        r = results[way]
        print(
            f"  {way} / tiled: time {r['seconds'] / tiled['seconds']:.2f}x, peak memory "
            f"{r['peak_extra_bytes'] / max(1, tiled['peak_extra_bytes']):.2f}x"
        )


def composer_case(repeats: int) -> None:
    """Time one real composer step against the same rollouts trained as plain grpo."""
    import dataclasses
    import statistics
    import tempfile
    import time

    import torch

    from composer_replication.config import RunConfig
    from composer_replication.model.shared_prefix import prefix_sharing
    from composer_replication.samples.wire import pack_samples
    from composer_replication.training.loop import Trainer
    from composer_replication.training.step import train_step

    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(RunConfig.default([f"output_dir={tmp}/run"]))
        samples, _ = trainer.collect()
    policy, cfg = trainer.policy, trainer.learner.losses.current()
    pad_id = trainer.tokenizer.pad_token_id or 0

    def plain_grpo(sample):
        return dataclasses.replace(
            sample, jsd_weights=None, teacher_input_ids=None, teacher_index=None, dpo=None
        )

    grpo_samples = [plain_grpo(s) for s in samples if s.input_ids]
    rollout_tokens = sum(sum(s.loss_mask) for s in grpo_samples)
    teacher_tokens = sum(len(s.teacher_input_ids or ()) for s in samples)
    pair_tokens = sum(
        len(s.dpo.chosen_ids) + len(s.dpo.rejected_ids) for s in samples if s.dpo is not None
    )
    student_tokens = sum(len(s.input_ids) for s in grpo_samples)

    def timed(batch_samples, teacher):
        batches = pack_samples(
            batch_samples, max_tokens=trainer.config.micro_batch_tokens, pad_id=pad_id, split=None
        )
        times = []
        for _ in range(repeats):
            policy.zero_grad(set_to_none=True)
            start = time.perf_counter()
            metrics = train_step(
                policy, batches, cfg, teacher=teacher, reference=trainer.learner.teachers.reference
            )
            times.append(time.perf_counter() - start)
        policy.zero_grad(set_to_none=True)
        return statistics.median(times), metrics

    torch.manual_seed(0)
    teacher = trainer.learner.teachers.teacher(policy)
    results = {}
    # row by row; a forward per prefix-tree node; one packed forward of the token trie under
    # a dense mask; packed under the block mask, attention in query tiles (the default)
    ways = {
        "row by row": (False, 0, False),
        "tree nodes": (True, 0, False),
        "dense trie": (True, None, False),
        "packed": (True, None, True),
    }
    for way, (sharing, packed_limit, packing) in ways.items():
        with prefix_sharing(sharing), _packed_limit(packed_limit), _packing(packing):
            results["composer", way] = timed(samples, teacher)
            results["grpo", way] = timed(grpo_samples, None)
    print(f"machine: {machine_line()}")
    print(
        f"one step of the embedded default recipe: {len(grpo_samples)} rollouts, "
        f"{rollout_tokens} rollout tokens ({student_tokens} tokens in the student rows), "
        f"{teacher_tokens} teacher-context tokens, {pair_tokens} pair tokens"
    )
    for (name, way), (seconds, m) in results.items():
        label = f"{name} ({way})"
        print(
            f"  {label:25s}: {seconds:5.1f} s/step, {rollout_tokens / seconds:5.1f} rollout "
            f"tokens/s  (loss {m['loss']:.6f}; loss/jsd {m['loss/jsd']:.6f}, loss/dpo "
            f"{m['loss/dpo']:.6f}; tokens rl {m['tokens/rl']:.0f}, jsd {m['tokens/jsd']:.0f}, "
            f"dpo pairs {m['tokens/dpo']:.0f})"
        )
    row_by_row = results["composer", "row by row"][0]
    print(
        f"  composer / grpo time per rollout token (row by row): "
        f"{row_by_row / results['grpo', 'row by row'][0]:.2f}x"
    )
    for way in ("tree nodes", "dense trie", "packed"):
        seconds = results["composer", way][0]
        print(f"  composer, {way} vs row by row: {row_by_row / seconds:.2f}x faster")
    print(
        f"  composer (packed) / grpo (row by row): "
        f"{results['composer', 'packed'][0] / results['grpo', 'row by row'][0]:.2f}x"
    )


@contextlib.contextmanager
def _packed_limit(limit: int | None):
    """Within the block, the packed forward takes at most ``limit`` tokens (None: as is)."""
    from composer_replication.model import shared_prefix

    saved = shared_prefix.PACKED_MAX_TOKENS
    if limit is not None:
        shared_prefix.PACKED_MAX_TOKENS = limit
    try:
        yield
    finally:
        shared_prefix.PACKED_MAX_TOKENS = saved


@contextlib.contextmanager
def _packing(on: bool):
    """Within the block, rows go packed under the block mask on this CPU (True) or never."""
    from composer_replication.model import packed_attention

    saved = packed_attention.PACKING_DEVICES
    packed_attention.PACKING_DEVICES = saved if on else ()
    try:
        yield
    finally:
        packed_attention.PACKING_DEVICES = saved


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--n-seq", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=2, help="timed steps per case (median)")
    parser.add_argument(
        "--checkpointing", action="store_true", help="activation checkpointing in both"
    )
    parser.add_argument(
        "--glibc-defaults",
        action="store_true",
        help="keep glibc's dynamic mmap threshold (RSS then includes freed heap blocks)",
    )
    parser.add_argument(
        "--composer", action="store_true", help="time the composer step against plain grpo"
    )
    parser.add_argument(
        "--episodes",
        type=int,
        nargs=3,
        metavar=("ROWS", "LENGTH", "PREFIX"),
        help="the packed forward against a forward per tree node on episode-shaped rows",
    )
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--args", help=argparse.SUPPRESS)
    ns = parser.parse_args()
    if not ns.worker:
        check_count(ns.n_seq, "--n-seq", what="sequences")
        # each sequence: 64 prompt tokens, then the completion the step trains on
        check_count(ns.seq_len, "--seq-len", minimum=65, what="tokens", why="64 of them the prompt")
        check_count(ns.repeats, "--repeats", what="timed steps")
    if ns.composer:
        composer_case(ns.repeats)
        return
    if ns.worker == "episodes":
        print(json.dumps(episodes_worker(**json.loads(ns.args))))
        return
    if ns.worker:
        print(json.dumps(worker(**json.loads(ns.args))))
        return
    if ns.episodes:
        rows, length, prefix = ns.episodes
        check_count(rows, "--episodes ROWS", what="rows")
        check_count(prefix, "--episodes PREFIX", what="shared tokens")
        check_count(
            length,
            "--episodes LENGTH",
            minimum=prefix + 7 * rows + 1,
            what="tokens",
            why="each row keeps tokens of its own past the shared prefix",
        )
        episodes_case(rows, length, prefix, ns.repeats)
        return
    from composer_replication.model.cpu_allocator import DEFAULT_MMAP_THRESHOLD

    script = os.path.abspath(__file__)
    threshold = 0 if ns.glibc_defaults else DEFAULT_MMAP_THRESHOLD
    print(f"machine: {machine_line()}")
    print(
        f"SmolLM2-135M, {ns.n_seq} x {ns.seq_len} tokens, rl (grpo) step, full fine-tune, "
        f"activation checkpointing {'on' if ns.checkpointing else 'off'}, glibc mmap threshold "
        f"{'dynamic (glibc default)' if not threshold else f'{threshold >> 10} KiB'}"
    )
    args = {
        "n_seq": ns.n_seq,
        "seq_len": ns.seq_len,
        "checkpointing": ns.checkpointing,
        "repeats": ns.repeats,
        "mmap_threshold": threshold,
    }
    naive = run_case(script, "step", {"impl": "naive", **args})
    ours = run_case(script, "step", {"impl": "ours", **args})
    for name, r in (("naive", naive), ("ours", ours)):
        print(
            f"  {name:5s}: {r['seconds']:.1f} s/step ({r['tokens'] / r['seconds']:.0f} tokens/s)  "
            f"peak extra {gib(r['peak_extra_bytes'])}  loss {r['loss']:.6f}"
        )
    print(
        f"  ratio ours/naive: time {ours['seconds'] / naive['seconds']:.3f}x (goal <= 1.05x)  "
        f"peak memory {ours['peak_extra_bytes'] / naive['peak_extra_bytes']:.3f}x (goal <= 0.5x)  "
        f"loss |diff| {abs(ours['loss'] - naive['loss']):.1e}"
    )


if __name__ == "__main__":
    main()
