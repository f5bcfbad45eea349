import pytest
from smallkit.sequences import (
    chunk,
    find_index,
    first,
    flatten,
    interleave,
    last,
    pairs,
    rotate_left,
    running_total,
    unique,
)


def test_first():
    assert first([3, 4, 5]) == 3


def test_first_empty_returns_default():
    assert first([]) is None
    assert first([], default="none") == "none"


def test_last():
    assert last([3, 4, 5]) == 5


def test_last_empty_returns_default():
    assert last([]) is None
    assert last([], default=0) == 0


def test_chunk():
    assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]
    assert chunk([1, 2, 3], 3) == [[1, 2, 3]]


def test_chunk_empty():
    assert chunk([], 4) == []


def test_chunk_bad_size_raises():
    with pytest.raises(ValueError):
        chunk([1, 2], 0)


def test_flatten():
    assert flatten([[1, 2], [3], [], [4, 5]]) == [1, 2, 3, 4, 5]


def test_flatten_one_level_only():
    assert flatten([[[1]], [2]]) == [[1], 2]
    assert flatten([]) == []


def test_unique_keeps_first_occurrences_in_order():
    assert unique([3, 1, 3, 2, 1]) == [3, 1, 2]


def test_unique_strings_and_empty():
    assert unique(["b", "a", "b"]) == ["b", "a"]
    assert unique([]) == []


@pytest.mark.parametrize(
    ("steps", "expected"),
    [(1, [2, 3, 4, 1]), (0, [1, 2, 3, 4]), (6, [3, 4, 1, 2]), (-1, [4, 1, 2, 3])],
)
def test_rotate_left(steps, expected):
    assert rotate_left([1, 2, 3, 4], steps) == expected


def test_rotate_left_empty_and_copy():
    assert rotate_left([], 3) == []
    items = [1, 2]
    assert rotate_left(items, 0) is not items


def test_pairs():
    assert pairs([1, 2, 3, 4]) == [(1, 2), (2, 3), (3, 4)]


def test_pairs_short_input():
    assert pairs([1]) == []
    assert pairs([]) == []


def test_interleave_equal_lengths():
    assert interleave([1, 3, 5], [2, 4, 6]) == [1, 2, 3, 4, 5, 6]


def test_interleave_different_lengths():
    assert interleave(["a"], ["x", "y", "z"]) == ["a", "x", "y", "z"]
    assert interleave([1, 2, 3], []) == [1, 2, 3]


def test_running_total():
    assert running_total([1, 2, 3, 4]) == [1, 3, 6, 10]
    assert running_total([5, -5, 2]) == [5, 0, 2]


def test_running_total_empty():
    assert running_total([]) == []


def test_find_index():
    assert find_index([1, 4, 6, 8], lambda n: n % 2 == 0) == 1
    assert find_index(["a", "bb", "ccc"], lambda s: len(s) == 3) == 2


def test_find_index_missing():
    assert find_index([1, 3, 5], lambda n: n > 10) == -1
    assert find_index([], bool) == -1
