import pytest
from smallkit.arithmetic import (
    clamp,
    digit_sum,
    factorial,
    fibonacci,
    gcd,
    is_even,
    is_prime,
    lcm,
    mean,
    median,
)


@pytest.mark.parametrize(("value", "expected"), [(5, 5), (-3, 0), (12, 10), (0, 0), (10, 10)])
def test_clamp(value, expected):
    assert clamp(value, 0, 10) == expected


def test_clamp_floats():
    assert clamp(0.5, 0.0, 1.0) == 0.5
    assert clamp(1.5, 0.0, 1.0) == 1.0


def test_is_even_true():
    assert is_even(4) is True
    assert is_even(0) is True
    assert is_even(-2) is True


def test_is_even_false():
    assert is_even(7) is False
    assert is_even(-3) is False


def test_mean():
    assert mean([1, 2, 3, 4]) == 2.5
    assert mean([7]) == 7


def test_mean_empty_raises():
    with pytest.raises(ValueError):
        mean([])


def test_median_odd_count():
    assert median([3, 1, 2]) == 2
    assert median([5]) == 5


def test_median_even_count():
    assert median([4, 1, 3, 2]) == 2.5


def test_median_empty_raises():
    with pytest.raises(ValueError):
        median([])


@pytest.mark.parametrize(("n", "expected"), [(0, 1), (1, 1), (5, 120), (10, 3628800)])
def test_factorial(n, expected):
    assert factorial(n) == expected


def test_factorial_negative_raises():
    with pytest.raises(ValueError):
        factorial(-1)


def test_gcd():
    assert gcd(12, 18) == 6
    assert gcd(17, 5) == 1


def test_gcd_zero_and_negative():
    assert gcd(0, 9) == 9
    assert gcd(0, 0) == 0
    assert gcd(-4, 6) == 2


def test_lcm():
    assert lcm(4, 6) == 12
    assert lcm(3, 5) == 15


def test_lcm_zero_and_negative():
    assert lcm(0, 7) == 0
    assert lcm(-4, 6) == 12


@pytest.mark.parametrize("n", [2, 3, 13, 97])
def test_is_prime_primes(n):
    assert is_prime(n) is True


@pytest.mark.parametrize("n", [-7, 0, 1, 4, 9, 91])
def test_is_prime_non_primes(n):
    assert is_prime(n) is False


def test_digit_sum():
    assert digit_sum(1234) == 10
    assert digit_sum(9) == 9


def test_digit_sum_negative_and_zero():
    assert digit_sum(-505) == 10
    assert digit_sum(0) == 0


def test_fibonacci():
    assert fibonacci(7) == [0, 1, 1, 2, 3, 5, 8]


def test_fibonacci_small_counts():
    assert fibonacci(1) == [0]
    assert fibonacci(0) == []
    assert fibonacci(-3) == []
