"""What every layer uses and that knows nothing of training: atomic writes, output and
cache directories, process ids, user callables by import path, the usage error, progress
lines, per-step metric rows and interpreter compatibility."""
