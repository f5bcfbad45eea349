"""Training backends other than the native loop."""
