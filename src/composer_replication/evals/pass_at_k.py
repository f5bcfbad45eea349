"""The unbiased pass@k estimator of Chen et al. 2021 (arXiv 2107.03374, section 2.1).

With ``n`` samples of a problem of which ``c`` pass, the probability that at least one of
``k`` samples drawn without replacement from them passes is ``1 - C(n-c, k) / C(n, k)``;
its mean over problems is an unbiased estimate of pass@k (whereas ``1 - (1 - c/n)^k`` is
biased low). Pure functions, standard library only.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["STANDARD_KS", "mean_pass_at_k", "pass_at_k", "reported_ks"]

#: The k values HumanEval results are usually given for (arXiv 2107.03374).
STANDARD_KS = (1, 5, 10)


def pass_at_k(n: int, c: int, k: int) -> float:
    """``1 - C(n-c, k) / C(n, k)``: chance that some of ``k`` of the ``n`` samples passes.

    Exact: the binomials are Python integers and the ratio is rounded once.
    """
    for label, value in (("n", n), ("c", c), ("k", k)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{label}={value!r} must be an int")
    if n < 1:
        raise ValueError(f"n={n} samples: pass@k needs at least one sample per problem")
    if not 0 <= c <= n:
        raise ValueError(f"c={c} passing samples must be between 0 and n={n}")
    if not 1 <= k <= n:
        raise ValueError(f"k={k} must be between 1 and n={n} (draw more samples for a larger k)")
    if n - c < k:  # every k-subset holds a passing sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def mean_pass_at_k(counts: Iterable[tuple[int, int]], k: int) -> float | None:
    """Mean :func:`pass_at_k` over problems given as ``(n, c)`` pairs.

    Problems with fewer than ``k`` samples (e.g. some lost to infrastructure errors) are
    left out rather than guessed; ``None`` when no problem has ``k`` samples.
    """
    values = [pass_at_k(n, c, k) for n, c in counts if n >= k]
    return sum(values) / len(values) if values else None


def reported_ks(n: int, standard: Sequence[int] = STANDARD_KS) -> tuple[int, ...]:
    """The k values to report for ``n`` samples per problem: the standard ones up to ``n``,
    plus ``n`` itself (pass@n: any sample passes)."""
    if n < 1:
        raise ValueError(f"n={n} samples per problem must be >= 1")
    return tuple(sorted({k for k in standard if k <= n} | {n}))
