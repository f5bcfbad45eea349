"""Shipped task data for the built-in environments (``python_functions.jsonl``)."""
