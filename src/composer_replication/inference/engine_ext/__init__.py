"""Modules the inference engine imports inside its own virtualenv (no dependency on this
package: the server puts this folder on the engine's ``PYTHONPATH``)."""
