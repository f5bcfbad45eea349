from smallkit.mappings import (
    count_items,
    get_path,
    group_by,
    invert,
    key_of_max,
    merge,
    omit,
    pick,
    rename_keys,
    sort_by_value,
)


def test_invert():
    assert invert({"a": 1, "b": 2}) == {1: "a", 2: "b"}
    assert invert({}) == {}


def test_invert_repeated_value_last_key_wins():
    assert invert({"a": 1, "b": 1}) == {1: "b"}


def test_merge_later_overrides_earlier():
    assert merge({"a": 1, "b": 2}, {"b": 3}, {"c": 4}) == {"a": 1, "b": 3, "c": 4}


def test_merge_returns_new_dict():
    base = {"a": 1}
    merged = merge(base, {"b": 2})
    assert merged == {"a": 1, "b": 2}
    assert base == {"a": 1}
    assert merge() == {}


def test_pick():
    assert pick({"a": 1, "b": 2, "c": 3}, ["c", "a"]) == {"c": 3, "a": 1}


def test_pick_skips_missing_keys():
    assert pick({"a": 1}, ["a", "z"]) == {"a": 1}
    assert pick({"a": 1}, []) == {}


def test_omit():
    assert omit({"a": 1, "b": 2, "c": 3}, ["b"]) == {"a": 1, "c": 3}


def test_omit_missing_keys_and_copy():
    original = {"a": 1}
    result = omit(original, ["z"])
    assert result == {"a": 1}
    assert result is not original


def test_get_path():
    config = {"db": {"host": "localhost", "port": 5432}, "debug": True}
    assert get_path(config, "db.port") == 5432
    assert get_path(config, "debug") is True


def test_get_path_missing_returns_default():
    config = {"db": {"host": "localhost"}}
    assert get_path(config, "db.user") is None
    assert get_path(config, "db.host.name", default="?") == "?"
    assert get_path(config, "cache", default=0) == 0


def test_key_of_max():
    assert key_of_max({"a": 3, "b": 7, "c": 5}) == "b"


def test_key_of_max_tie_and_empty():
    assert key_of_max({"x": 2, "y": 2}) == "x"
    assert key_of_max({}) is None


def test_count_items():
    assert count_items(["a", "b", "a", "c", "a"]) == {"a": 3, "b": 1, "c": 1}


def test_count_items_empty():
    assert count_items([]) == {}


def test_group_by():
    words = ["apple", "avocado", "banana", "blueberry", "cherry"]
    assert group_by(words, lambda w: w[0]) == {
        "a": ["apple", "avocado"],
        "b": ["banana", "blueberry"],
        "c": ["cherry"],
    }


def test_group_by_numbers_and_empty():
    assert group_by([1, 2, 3, 4, 5], lambda n: n % 2) == {1: [1, 3, 5], 0: [2, 4]}
    assert group_by([], len) == {}


def test_sort_by_value():
    assert sort_by_value({"a": 3, "b": 1, "c": 2}) == [("b", 1), ("c", 2), ("a", 3)]


def test_sort_by_value_reverse():
    assert sort_by_value({"a": 3, "b": 1, "c": 2}, reverse=True) == [("a", 3), ("c", 2), ("b", 1)]
    assert sort_by_value({}) == []


def test_rename_keys():
    assert rename_keys({"a": 1, "b": 2}, {"a": "alpha"}) == {"alpha": 1, "b": 2}


def test_rename_keys_ignores_unknown_renames():
    assert rename_keys({"x": 1}, {"y": "why"}) == {"x": 1}
    assert rename_keys({}, {"a": "b"}) == {}
