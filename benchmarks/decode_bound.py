"""How far a small-batch decode forward is from this machine's memory bound.

Run: ``python benchmarks/decode_bound.py`` (about a minute). A decode forward of a few rows
multiplies them by every weight matrix of the model once, so no kernel can make it faster
than reading those weights from memory. This measures, side by side in one process:

- the machine's read bandwidth: the median time of summing a float32 tensor as large as the
  model's weights (the same bytes a forward reads; far larger than any cache);
- every distinct linear-layer shape of the model at ``--rows`` rows, with the default
  float32 kernel and with oneDNN on pre-packed weights (what ``rollout.packed_linear``
  uses), each over 30 distinct copies so no weight stays in cache: microseconds per product
  and the bandwidth it reaches;
- one whole decode forward (``--rows`` rows, one new token each after a 150-token cache)
  as the decode loop runs it (packed linear layers, preallocated cache).

Printed: the lower bound of a forward (weight bytes / read bandwidth), our forward and its
ratio to the bound: the most any faster kernel could still gain for the same number of
forwards, and the share of the forward spent outside the products.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from _measure import check_count, machine_line


def median_seconds(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def read_bandwidth(n_bytes: int, repeats: int) -> float:
    """Bytes per second of a sum over a fresh float32 tensor of ``n_bytes``."""
    import torch

    data = torch.rand(n_bytes // 4)
    seconds = median_seconds(lambda: data.sum(), repeats)
    return n_bytes / seconds


def product_seconds(out_features: int, in_features: int, rows: int, packed: bool) -> float:
    """Median seconds of one ``rows x in -> out`` product over 30 distinct weights."""
    import torch

    weights = [torch.randn(out_features, in_features) for _ in range(30)]
    x = torch.randn(rows, in_features)
    if packed:
        weights = [torch.ops.mkldnn._reorder_linear_weight(w, rows) for w in weights]

        def run(w):
            return torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
    else:

        def run(w):
            return torch.nn.functional.linear(x, w)

    def all_weights():
        for w in weights:
            run(w)

    return median_seconds(all_weights, 5) / len(weights)


def decode_forward_seconds(model, rows: int, cached: int, repeats: int) -> float:
    """Median seconds of a decode forward of ``rows`` rows, one new token each, run back to
    back after a ``cached``-token prefill as the decode loop runs them (preallocated cache,
    attention mask, position ids, logits of the new position only)."""
    import torch

    from composer_replication.inference.decoding.kv_cache import new_cache
    from composer_replication.inference.decoding.packed_linear import packed_linears

    steps = repeats + 1  # the first is a warm-up
    prompt = torch.randint(0, model.config.vocab_size, (rows, cached))
    tokens = torch.randint(0, model.config.vocab_size, (rows, steps))
    mask = torch.ones(rows, cached + steps, dtype=torch.long)
    times = []
    with torch.no_grad(), packed_linears(model, batch_hint=rows):
        cache = new_cache(model, cached + steps)
        model(input_ids=prompt, attention_mask=mask[:, :cached], use_cache=True, cache=cache)
        for i in range(steps):
            start = time.perf_counter()
            model(
                input_ids=tokens[:, i : i + 1],
                attention_mask=mask[:, : cached + i + 1],
                position_ids=torch.full((rows, 1), cached + i),
                use_cache=True,
                cache=cache,
                logits_to_keep=1,
            )
            times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=8, help="rows per decode forward")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--threads", type=int, default=2)
    ns = parser.parse_args()
    check_count(ns.rows, "--rows", what="rows")
    check_count(ns.repeats, "--repeats", what="timed repeats")
    check_count(ns.threads, "--threads", what="threads")

    import torch

    from composer_replication.model.loading import load_policy

    torch.set_num_threads(ns.threads)
    model, _ = load_policy(None)
    model.eval()
    print(f"machine: {machine_line()}; torch threads {ns.threads}; rows {ns.rows}")

    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    shapes = Counter(tuple(m.weight.shape) for m in linears)
    weight_bytes = sum(4 * m.weight.numel() for m in linears)
    bandwidth = read_bandwidth(weight_bytes, ns.repeats)
    print(
        f"linear weights read per forward: {weight_bytes / 1e6:.0f} MB in {len(linears)} "
        f"products; read bandwidth {bandwidth / 1e9:.1f} GB/s"
    )

    print("\n| shape (out x in) | count | default | packed | packed GB/s | of the bandwidth |")
    print("|---|---|---|---|---|---|")
    products = 0.0
    for (out_f, in_f), count in sorted(shapes.items()):
        default = product_seconds(out_f, in_f, ns.rows, packed=False)
        packed = product_seconds(out_f, in_f, ns.rows, packed=True)
        rate = 4 * out_f * in_f / packed
        products += count * packed
        print(
            f"| {out_f} x {in_f} | {count} | {default * 1e6:.0f} us | {packed * 1e6:.0f} us "
            f"| {rate / 1e9:.1f} | {rate / bandwidth:.0%} |"
        )

    forward = decode_forward_seconds(model, ns.rows, 150, ns.repeats)
    bound = weight_bytes / bandwidth
    print(
        f"\nmemory bound of a forward: {bound * 1e3:.1f} ms; the products alone (packed, "
        f"isolated): {products * 1e3:.1f} ms; our whole decode forward: {forward * 1e3:.1f} ms"
    )
    print(
        f"our forward / bound: {forward / bound:.2f}x (the most a faster kernel could gain "
        f"at this number of forwards); outside the products: "
        f"{max(0.0, forward - products) * 1e3:.1f} ms ({max(0.0, 1 - products / forward):.0%})"
    )


if __name__ == "__main__":
    main()
