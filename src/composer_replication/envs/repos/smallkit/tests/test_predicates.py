import pytest
from smallkit.predicates import (
    has_duplicates,
    is_anagram,
    is_blank,
    is_email,
    is_hex_color,
    is_power_of_two,
    is_sorted,
    is_subset,
    is_valid_username,
)


@pytest.mark.parametrize("text", ["", "   ", "\t\n"])
def test_is_blank_true(text):
    assert is_blank(text) is True


def test_is_blank_false():
    assert is_blank(" x ") is False


def test_is_sorted_true():
    assert is_sorted([1, 2, 2, 5]) is True
    assert is_sorted([]) is True
    assert is_sorted([4]) is True


def test_is_sorted_false():
    assert is_sorted([1, 3, 2]) is False
    assert is_sorted(["b", "a"]) is False


def test_has_duplicates():
    assert has_duplicates([1, 2, 3, 2]) is True
    assert has_duplicates(["a", "a"]) is True


def test_has_duplicates_none():
    assert has_duplicates([1, 2, 3]) is False
    assert has_duplicates([]) is False


@pytest.mark.parametrize("text", ["ada@example.com", "a.b@mail.co.uk", "x@y.z"])
def test_is_email_valid(text):
    assert is_email(text) is True


@pytest.mark.parametrize(
    "text",
    ["", "ada.example.com", "a@@b.com", "@example.com", "ada@localhost", "a b@c.com", "a@.com"],
)
def test_is_email_invalid(text):
    assert is_email(text) is False


@pytest.mark.parametrize("text", ["#fff", "#A0b1C2", "#000000"])
def test_is_hex_color_valid(text):
    assert is_hex_color(text) is True


@pytest.mark.parametrize("text", ["fff", "#ffff", "#ggg", "#", "", "#12345"])
def test_is_hex_color_invalid(text):
    assert is_hex_color(text) is False


@pytest.mark.parametrize("n", [1, 2, 8, 1024])
def test_is_power_of_two_true(n):
    assert is_power_of_two(n) is True


@pytest.mark.parametrize("n", [0, -4, 3, 12])
def test_is_power_of_two_false(n):
    assert is_power_of_two(n) is False


@pytest.mark.parametrize("name", ["bob", "alice_99", "a" * 16])
def test_is_valid_username_valid(name):
    assert is_valid_username(name) is True


@pytest.mark.parametrize("name", ["", "ab", "a" * 17, "9lives", "_bob", "Bob", "bob!"])
def test_is_valid_username_invalid(name):
    assert is_valid_username(name) is False


def test_is_anagram_true():
    assert is_anagram("listen", "silent") is True
    assert is_anagram("Dormitory", "dirty room") is True


def test_is_anagram_false():
    assert is_anagram("hello", "world") is False
    assert is_anagram("aab", "abb") is False


def test_is_subset_true():
    assert is_subset([1, 2], [3, 2, 1]) is True
    assert is_subset([], [1]) is True


def test_is_subset_false():
    assert is_subset([1, 4], [1, 2, 3]) is False
    assert is_subset(["a"], []) is False
