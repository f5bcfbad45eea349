"""Small helpers for integer and floating-point arithmetic."""


def clamp(value: float, low: float, high: float) -> float:
    """Return value limited to the range low..high: low if it is below, high if it is above."""
    return max(low, min(value, high))


def is_even(n: int) -> bool:
    """Return True if the integer n is divisible by 2 (0 and negative even numbers included)."""
    return n % 2 == 0


def mean(values: list[float]) -> float:
    """Return the arithmetic mean of values; raises ValueError for an empty list."""
    if not values:
        raise ValueError("mean of an empty list")
    return sum(values) / len(values)


def median(values: list[float]) -> float:
    """Return the middle sorted value (mean of the middle two if even); ValueError if empty."""
    if not values:
        raise ValueError("median of an empty list")
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def factorial(n: int) -> int:
    """Return n! = 1 * 2 * ... * n with factorial(0) == 1; raises ValueError for negative n."""
    if n < 0:
        raise ValueError("factorial of a negative number")
    result = 1
    for k in range(2, n + 1):
        result *= k
    return result


def gcd(a: int, b: int) -> int:
    """Return the greatest common divisor of a and b, never negative; gcd(0, 0) == 0."""
    while b:
        a, b = b, a % b
    return abs(a)


def lcm(a: int, b: int) -> int:
    """Return the least common multiple of a and b, never negative; 0 if either is 0."""
    if a == 0 or b == 0:
        return 0
    return abs(a * b) // gcd(a, b)


def is_prime(n: int) -> bool:
    """Return True if n is a prime number; False for every n below 2."""
    if n < 2:
        return False
    return all(n % divisor != 0 for divisor in range(2, int(n**0.5) + 1))


def digit_sum(n: int) -> int:
    """Return the sum of the decimal digits of n, ignoring its sign; 0 for 0."""
    return sum(int(digit) for digit in str(abs(n)))


def fibonacci(count: int) -> list[int]:
    """Return the first count Fibonacci numbers 0, 1, 1, 2, 3, ...; [] when count <= 0."""
    numbers = []
    a, b = 0, 1
    for _ in range(count):
        numbers.append(a)
        a, b = b, a + b
    return numbers
