"""Shared helpers for the benchmarks: run a case in a fresh process, read its peak memory.

Peak extra memory is measured as the process's peak resident set size (``ru_maxrss``) during
the measured call minus its resident size right before it, in a fresh interpreter per case,
so that allocations of earlier cases (and allocator caches) cannot hide or inflate it.
"""

from __future__ import annotations

import json
import math
import os
import resource
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def measure(fn: Callable[[], dict[str, Any]], *, cold: bool = True) -> dict[str, Any]:
    """Run ``fn`` once; return its result plus seconds and peak extra bytes.

    ``cold=False`` for repeated timing calls, whose memory reading is meaningless.
    """
    import gc

    gc.collect()
    before = current_rss_bytes()
    if cold and peak_rss_bytes() > before + (64 << 20):
        # The set-up itself peaked above the current size: the reading would be hidden.
        raise RuntimeError("set-up left a higher peak RSS than the baseline; restructure it")
    start = time.perf_counter()
    result = fn()
    result["seconds"] = time.perf_counter() - start
    result["peak_extra_bytes"] = max(0, peak_rss_bytes() - before)
    return result


def run_case(script: str, case: str, args: dict[str, Any]) -> dict[str, Any]:
    """Run ``script --worker CASE --args JSON`` in a fresh interpreter, parse its JSON line."""
    cmd = [sys.executable, script, "--worker", case, "--args", json.dumps(args)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def gib(n_bytes: float) -> str:
    return f"{n_bytes / (1 << 30):.2f} GiB"


def machine_line() -> str:
    import platform

    import torch

    cpu = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return (
        f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads), Python {platform.python_version()}"
    )


def rl_samples(n_seq: int, seq_len: int, vocab: int, *, n_prompt: int) -> list:
    """``n_seq`` synthetic grpo-style training samples of ``seq_len`` random tokens: a
    prompt of ``n_prompt``, then trainable tokens with sampler log-probs and advantages of
    alternating sign (seeded: the same batch in every process)."""
    import torch

    from composer_replication.samples.wire import TrainingSample

    gen = torch.Generator().manual_seed(0)
    samples = []
    for i in range(n_seq):
        ids = torch.randint(100, vocab, (seq_len,), generator=gen).tolist()
        mask = [0] * n_prompt + [1] * (seq_len - n_prompt)
        inf = [0.0] * n_prompt + (-torch.rand(seq_len - n_prompt, generator=gen) * 8).tolist()
        adv = 1.0 if i % 2 else -1.0
        samples.append(TrainingSample(ids, mask, inf, advantages=[adv * m for m in mask]))
    return samples


def checked_output(path: Any, option: str, *, directory: bool = False) -> Any:
    """The project's output policy for a benchmark's output option, before any work: a file
    (never an input, a source, a cache or a run's record; not a directory, device or link)
    or, with ``directory``, a folder that is absent or writable. Exits with one line
    naming the option and the fix otherwise."""
    from composer_replication.common.outputs import OutputError, check_output, check_output_dir

    if path is None:
        return None
    try:
        if directory:
            return check_output_dir(path, option=option)
        return check_output(path, option=option, inputs=[sys.argv[0]])
    except OutputError as err:
        usage_exit(str(err))


def write_json(path: Any, data: Any) -> None:
    """``data`` as JSON at ``path``, atomically (the old file or the new one, never half)."""
    from composer_replication.common.atomic_io import write_text_atomic

    write_text_atomic(path, json.dumps(data, indent=1, default=str))


# ------------------------------------------------------------------ bad command-line input
# What the project's commands do with bad input, for the benchmarks' options: before any
# work, one line on stderr naming the option, the value and the fix, and exit code 2
# (composer_replication.common.errors.EXIT_USAGE, argparse's own), no traceback.

EXIT_USAGE = 2


def script_name() -> str:
    return f"benchmarks/{os.path.basename(sys.argv[0])}"


def usage_exit(message: str) -> NoReturn:
    """``message`` as one line on stderr, prefixed with the script's name; exit 2."""
    print(f"{script_name()}: {' '.join(message.split())}", file=sys.stderr)
    sys.exit(EXIT_USAGE)


def refuse(option: str, value: Any, fix: str) -> NoReturn:
    """Exit with one line naming ``option``, its ``value`` and the ``fix``."""
    usage_exit(f"{option} {value}: {fix}")


def check_count(
    value: int, option: str, *, minimum: int = 1, what: str = "a whole number", why: str = ""
) -> int:
    """``value`` (an int option) is at least ``minimum`` (``why``: the reason, said after)."""
    if value < minimum:
        refuse(option, value, f"give {what} >= {minimum}{f' ({why})' if why else ''}")
    return value


def check_number(
    value: float,
    option: str,
    *,
    minimum: float = 0.0,
    maximum: float | None = None,
    above: bool = False,
    what: str = "a number",
    why: str = "",
) -> float:
    """``value`` (a float option) is finite (never nan or inf) and ``>= minimum`` (``>``
    with ``above``) and, with ``maximum``, ``<= maximum``."""
    low_ok = value > minimum if above else value >= minimum
    high_ok = maximum is None or value <= maximum
    if not (math.isfinite(value) and low_ok and high_ok):
        bound = f"{'>' if above else '>='} {minimum:g}"
        if maximum is not None:
            bound = f"between {minimum:g} and {maximum:g}"
        refuse(option, value, f"give {what}, finite and {bound}{f' ({why})' if why else ''}")
    return value


def check_seconds(value: float, option: str, *, zero: bool = False) -> float:
    """A time in seconds: finite and > 0 (``>= 0`` with ``zero``)."""
    return check_number(value, option, above=not zero, what="seconds")


def check_choices(text: str, option: str, valid: Sequence[str]) -> list[str]:
    """The items of a comma-separated ``text``, each one of ``valid``, at least one."""
    items = [item.strip() for item in text.split(",") if item.strip()]
    unknown = [item for item in items if item not in valid]
    if unknown or not items:
        what = f"unknown {', '.join(map(repr, unknown))}" if unknown else "names nothing"
        refuse(option, repr(text), f"{what}; use some of {','.join(valid)} (comma-separated)")
    return items


def check_input(path: Any, option: str, *, directory: bool = False) -> Path:
    """An input the script reads: an existing file (a folder with ``directory``)."""
    given = Path(path).expanduser()
    kind = "folder" if directory else "file"
    if not given.exists():
        refuse(option, repr(str(path)), f"no such {kind}; pass an existing {kind}")
    if directory and not given.is_dir():
        refuse(option, repr(str(path)), "is not a folder; pass a folder")
    if not directory and not given.is_file():
        refuse(option, repr(str(path)), "is not a regular file; pass a file")
    return given
