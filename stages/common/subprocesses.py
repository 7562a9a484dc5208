"""Child processes (ffmpeg, through imageio-ffmpeg) from a process that runs JAX.

On Python 3.12 JAX's at-fork hook warns on every fork, including ``subprocess``'s fork-and-exec
("os.fork() was called ... JAX is multithreaded, so this will likely lead to a deadlock"): one
RuntimeWarning per video a stage writes or reads. The deadlock it warns of needs Python code in
the child before ``exec``; ``subprocess`` runs none, so that warning, attributed to the
``subprocess`` module, is ignored. A fork from anywhere else still warns.
"""

from __future__ import annotations

import functools
import warnings


@functools.cache
def allow_fork_exec_under_jax() -> None:
    """Ignore JAX's fork warning where ``subprocess`` forks to exec (once per process)."""
    warnings.filterwarnings(
        "ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning, module="subprocess"
    )
