"""Small yes-or-no checks on strings, numbers and lists."""


def is_blank(text: str) -> bool:
    """Return True if text is empty or contains only whitespace."""
    return not text.strip()


def is_sorted(items: list) -> bool:
    """Return True if items is in non-decreasing order; True for [] and for a single element."""
    return items == sorted(items)


def has_duplicates(items: list) -> bool:
    """Return True if some (hashable) element occurs more than once in items; False for []."""
    return len(set(items)) != len(items)


def is_email(text: str) -> bool:
    """Return True if text has one "@", no spaces, a non-empty name and a dot inside the domain."""
    if text.count("@") != 1 or " " in text:
        return False
    name, domain = text.split("@")
    return bool(name) and "." in domain.strip(".")


def is_hex_color(text: str) -> bool:
    """Return True if text is "#" followed by exactly 3 or 6 hexadecimal digits (either case)."""
    digits = text[1:]
    hex_digits = "0123456789abcdefABCDEF"
    return text.startswith("#") and len(digits) in (3, 6) and all(c in hex_digits for c in digits)


def is_power_of_two(n: int) -> bool:
    """Return True if n is 1, 2, 4, 8, ...; False for 0 and for negative numbers."""
    return n > 0 and n & (n - 1) == 0


def is_valid_username(name: str) -> bool:
    """Return True if name is 3-16 chars of a-z, 0-9 or "_" and starts with a letter."""
    allowed = "abcdefghijklmnopqrstuvwxyz0123456789_"
    return 3 <= len(name) <= 16 and name[0].isalpha() and all(c in allowed for c in name)


def is_anagram(a: str, b: str) -> bool:
    """Return True if a and b use the same letters equally often, ignoring case and spaces."""
    return sorted(a.replace(" ", "").lower()) == sorted(b.replace(" ", "").lower())


def is_subset(small: list, big: list) -> bool:
    """Return True if every element of small also occurs in big; True when small is empty."""
    return all(item in big for item in small)
