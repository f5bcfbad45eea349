"""Small helpers for working with strings."""


def capitalize_words(text: str) -> str:
    """Return text with the first letter of every space-separated word upper-cased; "" for ""."""
    return " ".join(word[:1].upper() + word[1:] for word in text.split(" "))


def reverse_words(text: str) -> str:
    """Return the whitespace-separated words of text in reverse order joined by single spaces."""
    return " ".join(reversed(text.split()))


def count_vowels(text: str) -> int:
    """Return how many characters of text are vowels (a, e, i, o, u in either case); 0 for ""."""
    return sum(1 for char in text.lower() if char in "aeiou")


def is_palindrome(text: str) -> bool:
    """Return True if text reads the same backwards ignoring case and non-alphanumerics ("" too)."""
    cleaned = [char.lower() for char in text if char.isalnum()]
    return cleaned == cleaned[::-1]


def truncate(text: str, limit: int, suffix: str = "...") -> str:
    """Return text if len(text) <= limit, else text cut to limit - len(suffix) chars plus suffix."""
    if len(text) <= limit:
        return text
    return text[: limit - len(suffix)] + suffix


def snake_to_camel(name: str) -> str:
    """Return a snake_case name in camelCase, e.g. "max_line_length" -> "maxLineLength"."""
    first, *rest = name.split("_")
    return first + "".join(part.capitalize() for part in rest)


def camel_to_snake(name: str) -> str:
    """Return a camelCase name in snake_case, e.g. "maxLineLength" -> "max_line_length"."""
    return "".join("_" + c.lower() if c.isupper() and i else c.lower() for i, c in enumerate(name))


def initials(name: str) -> str:
    """Return the upper-cased first letters of the words of name, e.g. "ada lovelace" -> "AL"."""
    return "".join(word[0].upper() for word in name.split())


def count_words(text: str) -> int:
    """Return the number of whitespace-separated words in text; 0 for "" or only whitespace."""
    return len(text.split())


def most_common_char(text: str) -> str:
    """Return the character that occurs most often in text (the earliest on ties); "" for ""."""
    if not text:
        return ""
    return max(text, key=text.count)
