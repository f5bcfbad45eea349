"""Adapters to other projects' conventions (importing this package imports nothing else)."""
