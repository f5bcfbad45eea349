"""The unbiased pass@k estimator (arXiv 2107.03374) against hand-computed values and a
brute-force count over every k-subset of the samples."""

from __future__ import annotations

import itertools
import math

import pytest

from composer_replication.evals.pass_at_k import mean_pass_at_k, pass_at_k, reported_ks


@pytest.mark.parametrize(
    ("n", "c", "k", "expected"),
    [
        (5, 2, 1, 2 / 5),  # 1 - C(3,1)/C(5,1) = 1 - 3/5
        (5, 2, 2, 7 / 10),  # 1 - C(3,2)/C(5,2) = 1 - 3/10
        (5, 2, 3, 9 / 10),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (5, 2, 5, 1.0),  # any 5 of 5 holds a pass
        (5, 0, 5, 0.0),
        (5, 5, 1, 1.0),
        (10, 1, 5, 1 / 2),  # 1 - C(9,5)/C(10,5) = 1 - 126/252
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
    ],
)
def test_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-15)


def _brute_force(n: int, c: int, k: int) -> float:
    """Share of the k-subsets of n samples (the first c pass) holding a passing sample."""
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(i < c for i in s) for s in subsets) / len(subsets)


def test_matches_enumeration_over_all_subsets():
    checked = 0
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(_brute_force(n, c, k), abs=1e-12), (
                    n,
                    c,
                    k,
                )
                checked += 1
    assert checked == sum(n * (n + 1) for n in range(1, 9))


def test_pass_at_1_is_the_success_share_and_exact_for_large_n():
    assert pass_at_k(200, 37, 1) == pytest.approx(37 / 200)
    # the naive 1 - (1 - c/n)^k is biased low; the estimator is not
    assert pass_at_k(20, 4, 10) > 1 - (1 - 4 / 20) ** 10
    assert pass_at_k(200, 3, 100) == 1 - math.comb(197, 100) / math.comb(200, 100)


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((5, 2, 6), "k=6 must be between 1 and n=5"),
        ((5, 2, 0), "k=0"),
        ((5, 6, 1), "c=6"),
        ((5, -1, 1), "c=-1"),
        ((0, 0, 1), "n=0"),
    ],
)
def test_bad_input_is_refused_with_the_value(args, match):
    with pytest.raises(ValueError, match=match):
        pass_at_k(*args)
    with pytest.raises(TypeError, match="must be an int"):
        pass_at_k(5.0, 2, 1)  # type: ignore[arg-type]


def test_mean_over_problems_leaves_out_those_with_too_few_samples():
    counts = [(5, 2), (5, 0), (5, 5), (3, 3)]  # the last has only 3 samples
    assert mean_pass_at_k(counts, 1) == pytest.approx((0.4 + 0 + 1 + 1) / 4)
    assert mean_pass_at_k(counts, 5) == pytest.approx((1 + 0 + 1) / 3)
    assert mean_pass_at_k([(3, 1)], 5) is None
    assert mean_pass_at_k([], 1) is None


def test_reported_ks():
    assert reported_ks(1) == (1,)
    assert reported_ks(4) == (1, 4)
    assert reported_ks(5) == (1, 5)
    assert reported_ks(10) == (1, 5, 10)
    assert reported_ks(20) == (1, 5, 10, 20)
    with pytest.raises(ValueError, match="n=0"):
        reported_ks(0)
