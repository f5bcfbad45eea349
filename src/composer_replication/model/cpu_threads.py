"""How torch's CPU worker threads wait between parallel regions: briefly, then asleep.

torch's CPU kernels run on an OpenMP team (GNU libgomp in the Linux wheels). By default a
libgomp worker that finishes a parallel region keeps spinning, about 300,000 iterations,
before it sleeps, and every region waits for its slowest worker. On a machine whose cores
something else also needs (the sandbox's test runs beside the agent loop's decode, task
generation beside a run, two runs at once) the spinning workers take the cores from that
work, and a region waits for a worker the scheduler has set aside: measured on 2 cores with
two other busy processes, a (16 x 576) @ (576 x 1536) matmul took 20 ms with the default
spin and 0.7 ms with a short one; beside one busy core a decode is 1.67x and a training step
1.33x faster with it, alone they are 5-9% slower (``benchmarks/cpu_threads.py``).

The spin is read once, when libgomp loads (the first ``import torch``), so the commands set
it before that; a value the user set (``GOMP_SPINCOUNT`` or ``OMP_WAIT_POLICY``) wins.
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

__all__ = ["SPIN_COUNT", "limit_thread_spinning"]

#: iterations a worker spins before it sleeps (libgomp's own default is 300,000)
SPIN_COUNT = 1000


def limit_thread_spinning(environ: MutableMapping[str, str] | None = None) -> bool:
    """Set ``GOMP_SPINCOUNT`` to :data:`SPIN_COUNT` in ``environ`` (default: this process's,
    which the ranks and workers it starts inherit); True when it did. Nothing changes when
    the user chose a wait policy, or (for this process) once torch is imported: its
    OpenMP runtime has read its settings by then."""
    if environ is None:
        if "torch" in sys.modules:
            return False
        environ = os.environ
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)
    return True
