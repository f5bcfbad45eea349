"""composer-replication."""
__version__ = "0.1.0"
