"""ffmpeg children of a JAX process: no fork warning per video (Python 3.12); the filter is
scoped to forks from ``subprocess``."""

import warnings

import jax
import numpy as np

from stages.common import subprocesses
from stages.generate import outputs


def test_writing_a_video_does_not_warn_of_forking(recwarn):
    jax.devices()  # JAX is up: its at-fork hook warns on every fork
    subprocesses.allow_fork_exec_under_jax.cache_clear()
    data = outputs.encode_mp4(np.zeros((3, 16, 16, 3), np.uint8), fps=8)
    assert data[4:8] == b"ftyp"
    assert not [w for w in recwarn if "os.fork()" in str(w.message)]


def test_the_filter_is_for_subprocess_alone():
    subprocesses.allow_fork_exec_under_jax.cache_clear()
    subprocesses.allow_fork_exec_under_jax()
    fork_filters = [f for f in warnings.filters if f[1] and f[1].pattern.startswith("os")]
    assert fork_filters and all(f[0] == "ignore" for f in fork_filters)
    assert all(f[3].pattern == "subprocess" for f in fork_filters)


def test_imageio_ffmpeg_children_run_no_python_before_exec(monkeypatch):
    """imageio-ffmpeg's writer passes ``preexec_fn=os.setpgrp`` by default: Python code in the
    forked child, which can hang on a lock another thread held at the fork; the helper turns it
    off (imageio-ffmpeg's own switch)."""
    import os

    from imageio_ffmpeg import _utils

    monkeypatch.delenv("IMAGEIO_FFMPEG_NO_PREVENT_SIGINT", raising=False)
    assert _utils._popen_kwargs(prevent_sigint=True)["preexec_fn"] is os.setpgrp  # the default
    subprocesses.allow_fork_exec_under_jax.__wrapped__()
    assert _utils._popen_kwargs(prevent_sigint=True)["preexec_fn"] is None
