"""Child processes (ffmpeg, through imageio-ffmpeg) from a process that runs JAX.

On Python 3.12 JAX's at-fork hook warns on every fork, including ``subprocess``'s fork-and-exec
("os.fork() was called ... JAX is multithreaded, so this will likely lead to a deadlock"): one
RuntimeWarning per video a stage writes or reads. The deadlock it warns of needs Python code in
the child before ``exec``. ``subprocess`` runs none unless given a ``preexec_fn``, and
imageio-ffmpeg's writer passes one (``os.setpgrp``, to keep Ctrl-C from ffmpeg) unless
``IMAGEIO_FFMPEG_NO_PREVENT_SIGINT`` is set: a forked child then hung for good in a futex
(seen once in the LTX-2 tests, after PyAV's threads had run in the process). So the variable
is set here, every child execs at once, and the warning, attributed to the ``subprocess``
module, is ignored. A fork from anywhere else still warns. (ffmpeg then shares the stage's
process group: a Ctrl-C stops both, which a stage being interrupted wants anyway.)
"""

from __future__ import annotations

import functools
import os
import warnings


@functools.cache
def allow_fork_exec_under_jax() -> None:
    """Ignore JAX's fork warning where ``subprocess`` forks to exec, and keep imageio-ffmpeg's
    children free of Python code before their ``exec`` (once per process)."""
    os.environ.setdefault("IMAGEIO_FFMPEG_NO_PREVENT_SIGINT", "1")
    warnings.filterwarnings(
        "ignore", message=r"os\.fork\(\) was called", category=RuntimeWarning, module="subprocess"
    )
