"""Small helpers for lists and other sequences."""


def first(items: list, default=None):
    """Return the first element of items, or default when items is empty."""
    return items[0] if items else default


def last(items: list, default=None):
    """Return the last element of items, or default when items is empty."""
    return items[-1] if items else default


def chunk(items: list, size: int) -> list[list]:
    """Return items cut into consecutive lists of size elements, the last one possibly shorter."""
    if size < 1:
        raise ValueError("size must be at least 1")
    return [items[start : start + size] for start in range(0, len(items), size)]


def flatten(nested: list[list]) -> list:
    """Return the elements of the inner lists of nested in one flat list (one level deep only)."""
    return [item for inner in nested for item in inner]


def unique(items: list) -> list:
    """Return items without repeats, keeping the first occurrence of each in the original order."""
    return list(dict.fromkeys(items))


def rotate_left(items: list, steps: int) -> list:
    """Return a new list with items shifted steps places to the left, wrapping around; [] for []."""
    if not items:
        return []
    steps %= len(items)
    return items[steps:] + items[:steps]


def pairs(items: list) -> list[tuple]:
    """Return the adjacent pairs [(items[0], items[1]), (items[1], items[2]), ...]; [] if < 2."""
    return [(items[i], items[i + 1]) for i in range(len(items) - 1)]


def interleave(left: list, right: list) -> list:
    """Return left[0], right[0], left[1], right[1], ... followed by the rest of the longer list."""
    result = []
    for a, b in zip(left, right):
        result.extend((a, b))
    shorter = min(len(left), len(right))
    return result + left[shorter:] + right[shorter:]


def running_total(numbers: list[float]) -> list[float]:
    """Return the cumulative sums of numbers, e.g. [1, 2, 3] -> [1, 3, 6]; [] for []."""
    totals = []
    total = 0
    for number in numbers:
        total += number
        totals.append(total)
    return totals


def find_index(items: list, predicate) -> int:
    """Return the index of the first element for which predicate is true, or -1 if there is none."""
    for index, item in enumerate(items):
        if predicate(item):
            return index
    return -1
