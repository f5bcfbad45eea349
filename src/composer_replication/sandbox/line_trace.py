"""Which lines of a repository its tests run: a tracer a test command runs under.

``python line_trace.py ROOT OUT -m pytest ARGS...`` runs the module (pytest) as ``python -m``
would, with every line executed in a file under ``ROOT`` recorded, and writes them as JSON
(``{file: [line, ...]}``, paths relative to ``ROOT``) to ``OUT`` when the process ends.
Threads started by the tests are traced too. On Python 3.12 and later it uses
``sys.monitoring`` (each line reported once, then switched off: nearly free); before, a
``sys.settrace`` function that stops tracing frames outside ``ROOT``.

Task generation runs it once per repository, in the sandbox, to propose changes only where
a test can notice them (``datagen.generation``). Standard library only: it runs with the
repository's own interpreter.
"""

import json
import os
import runpy
import sys
import threading

_TOOL_ID = 4  # sys.monitoring's slot for a profiler-like tool (free in test runs)


def _recorder(root):
    lines = {}
    prefix = os.path.join(os.path.realpath(root), "")

    def wanted(filename):
        if filename.startswith("<"):  # "<frozen runpy>", "<string>": no file
            return False
        return filename.startswith(prefix) or (
            not os.path.isabs(filename) and os.path.realpath(filename).startswith(prefix)
        )

    def record(filename, line):
        lines.setdefault(filename, set()).add(line)

    return lines, wanted, record


def _monitor(wanted, record):
    monitoring = sys.monitoring
    monitoring.use_tool_id(_TOOL_ID, "composer-replication line trace")
    disable = monitoring.DISABLE

    def on_line(code, line):
        if wanted(code.co_filename):
            record(code.co_filename, line)
        return disable  # each (code, line) once: the rest of the run pays nothing

    monitoring.register_callback(_TOOL_ID, monitoring.events.LINE, on_line)
    monitoring.set_events(_TOOL_ID, monitoring.events.LINE)


def _settrace(wanted, record):
    def local(frame, event, arg):
        if event == "line":
            record(frame.f_code.co_filename, frame.f_lineno)
        return local

    def call(frame, event, arg):
        if not wanted(frame.f_code.co_filename):
            return None  # not the repository's: its lines are not traced
        record(frame.f_code.co_filename, frame.f_lineno)
        return local

    sys.settrace(call)
    threading.settrace(call)


def main(argv):
    root, out, flag, module, *rest = argv
    if flag != "-m":
        raise SystemExit("usage: line_trace.py ROOT OUT -m MODULE [ARGS...]")
    lines, wanted, record = _recorder(root)
    base = os.path.realpath(root)

    def write():
        found = {}
        for filename, numbers in lines.items():
            path = os.path.realpath(filename)
            if path.startswith(os.path.join(base, "")):
                found[os.path.relpath(path, base)] = sorted(numbers)
        with open(out, "w") as fh:
            json.dump(found, fh)

    if hasattr(sys, "monitoring"):
        _monitor(wanted, record)
    else:
        _settrace(wanted, record)
    sys.argv = [module, *rest]
    sys.path[0] = os.getcwd()  # as `python -m` has it, not this script's folder
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as done:
        write()
        raise SystemExit(done.code) from None
    write()


if __name__ == "__main__":
    main(sys.argv[1:])
