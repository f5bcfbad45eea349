import pytest
from smallkit.text import (
    camel_to_snake,
    capitalize_words,
    count_vowels,
    count_words,
    initials,
    is_palindrome,
    most_common_char,
    reverse_words,
    snake_to_camel,
    truncate,
)


def test_capitalize_words_upper_cases_each_word():
    assert capitalize_words("hello big world") == "Hello Big World"


def test_capitalize_words_keeps_the_rest_and_the_spacing():
    assert capitalize_words("mcDonald  farm") == "McDonald  Farm"


def test_capitalize_words_empty():
    assert capitalize_words("") == ""


def test_reverse_words():
    assert reverse_words("one two three") == "three two one"


def test_reverse_words_collapses_whitespace():
    assert reverse_words("  a \t b  ") == "b a"
    assert reverse_words("") == ""


@pytest.mark.parametrize(
    ("text", "expected"),
    [("hello", 2), ("AEIOU", 5), ("rhythm", 0), ("", 0)],
)
def test_count_vowels(text, expected):
    assert count_vowels(text) == expected


@pytest.mark.parametrize("text", ["racecar", "A man, a plan, a canal: Panama!", "", "x"])
def test_is_palindrome_true(text):
    assert is_palindrome(text) is True


def test_is_palindrome_false():
    assert is_palindrome("python") is False
    assert is_palindrome("ab") is False


def test_truncate_short_text_unchanged():
    assert truncate("short", 10) == "short"
    assert truncate("exact", 5) == "exact"


def test_truncate_long_text():
    assert truncate("hello world", 8) == "hello..."
    assert len(truncate("abcdefghijkl", 6)) == 6


def test_truncate_custom_suffix():
    assert truncate("abcdefgh", 5, suffix="!") == "abcd!"


def test_snake_to_camel():
    assert snake_to_camel("max_line_length") == "maxLineLength"


def test_snake_to_camel_single_word():
    assert snake_to_camel("name") == "name"
    assert snake_to_camel("") == ""


def test_camel_to_snake():
    assert camel_to_snake("maxLineLength") == "max_line_length"


def test_camel_to_snake_leading_capital_and_plain():
    assert camel_to_snake("HttpServer") == "http_server"
    assert camel_to_snake("name") == "name"


def test_initials():
    assert initials("ada lovelace") == "AL"
    assert initials("Grace Brewster Murray Hopper") == "GBMH"


def test_initials_empty_and_extra_spaces():
    assert initials("") == ""
    assert initials("  alan   turing ") == "AT"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("one two three", 3), ("  spaced\tout\nwords ", 3), ("", 0), ("   ", 0)],
)
def test_count_words(text, expected):
    assert count_words(text) == expected


def test_most_common_char():
    assert most_common_char("banana") == "a"
    assert most_common_char("mississippi") == "i"


def test_most_common_char_tie_takes_earliest():
    assert most_common_char("abab") == "a"
    assert most_common_char("xyz") == "x"


def test_most_common_char_empty():
    assert most_common_char("") == ""
