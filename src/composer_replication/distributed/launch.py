"""``composer-replication train --nproc N``: the same command on N local ranks, started by
``torch.distributed.run`` (torchrun) in a subprocess, exactly as

    torchrun --standalone --nproc-per-node N -m composer_replication train ARGS...

For several nodes run torchrun yourself with a rendezvous (see the README's Scaling)."""

from __future__ import annotations

import subprocess
import sys

__all__ = ["launch_torchrun", "torchrun_command"]


def torchrun_command(nproc: int, train_args: list[str]) -> list[str]:
    """The torchrun command line that runs ``train train_args...`` on ``nproc`` ranks."""
    if nproc < 1:
        raise ValueError(f"nproc={nproc} must be >= 1")
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "-m",
        "composer_replication",
        *train_args,
    ]


def launch_torchrun(nproc: int, train_args: list[str]) -> int:
    """Run :func:`torchrun_command` and return torchrun's exit code (0 when every rank
    finished; non-zero when one failed or the kill switch stopped the run)."""
    return subprocess.call(torchrun_command(nproc, train_args))
