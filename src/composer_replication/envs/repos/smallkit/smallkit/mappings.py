"""Small helpers for dictionaries."""


def invert(mapping: dict) -> dict:
    """Return a dict mapping each value of mapping to its key; on repeated values the last wins."""
    return {value: key for key, value in mapping.items()}


def merge(*mappings: dict) -> dict:
    """Return a new dict with the entries of all mappings; later mappings override earlier ones."""
    merged = {}
    for mapping in mappings:
        merged.update(mapping)
    return merged


def pick(mapping: dict, keys: list) -> dict:
    """Return the entries of mapping whose key is in keys, in keys order; missing keys skipped."""
    return {key: mapping[key] for key in keys if key in mapping}


def omit(mapping: dict, keys: list) -> dict:
    """Return a copy of mapping without the entries whose key is in keys."""
    return {key: value for key, value in mapping.items() if key not in keys}


def get_path(mapping: dict, path: str, default=None):
    """Return the value at dotted path in nested dicts ("a.b" is m["a"]["b"]), else default."""
    current = mapping
    for key in path.split("."):
        if not isinstance(current, dict) or key not in current:
            return default
        current = current[key]
    return current


def key_of_max(mapping: dict):
    """Return the key with the largest value (the first one on ties); None for an empty dict."""
    if not mapping:
        return None
    return max(mapping, key=mapping.get)


def count_items(items: list) -> dict:
    """Return a dict mapping each element of items to how many times it occurs; {} for []."""
    counts = {}
    for item in items:
        counts[item] = counts.get(item, 0) + 1
    return counts


def group_by(items: list, key) -> dict:
    """Return a dict mapping each key(item) to the list of items with that key, in order."""
    groups = {}
    for item in items:
        groups.setdefault(key(item), []).append(item)
    return groups


def sort_by_value(mapping: dict, reverse: bool = False) -> list[tuple]:
    """Return the (key, value) pairs sorted by value, ascending unless reverse is True."""
    return sorted(mapping.items(), key=lambda pair: pair[1], reverse=reverse)


def rename_keys(mapping: dict, renames: dict) -> dict:
    """Return a copy of mapping in which every key found in renames is replaced by renames[key]."""
    return {renames.get(key, key): value for key, value in mapping.items()}
