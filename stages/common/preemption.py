"""SIGTERM (preemption) for every stage: stop cleanly, keep what is finished, exit non-zero.

Kubernetes, JobSet and Argo stop a pod with SIGTERM (node preemption, spot reclaim, a
cancelled workflow). A stage stopped that way must not look successful: the next step of a
chain would then find no manifest. So each stage, once what it finished is durable, raises
:class:`Preempted`, and the ``difforge`` command exits with :data:`EXIT_PREEMPTED` (75,
``EX_TEMPFAIL`` in sysexits.h: "try again later"). The deploy templates retry that code
(``pipelines/deploy.py``); a rerun resumes:

- train: saves a checkpoint at the step it is in, then stops (resumes from it);
- generate: finishes the batch in flight and its files, then stops (renders the rest);
- convert: stops at once; its work folders are never a finished artifact (a rerun redoes them).
"""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger(__name__)

EXIT_PREEMPTED = 75


class Preempted(Exception):
    """The stage stopped on SIGTERM after making what it finished durable; rerun to resume."""


class Preemption:
    """A context that turns SIGTERM into ``requested`` (checked by the stage between units of
    work), or with ``immediate=True`` into :class:`Preempted` raised in the main thread.

    Outside the main thread (no signal handlers there) it installs nothing."""

    def __init__(self, stage: str, *, immediate: bool = False):
        self.stage = stage
        self.immediate = immediate
        self.requested = False
        self._previous = None
        self._installed = False

    def __enter__(self) -> Preemption:
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
            self._installed = True
        return self

    def _handle(self, signum, frame) -> None:
        del signum, frame
        self.requested = True
        if self.immediate:
            log.warning("%s: SIGTERM: stopping now", self.stage)
            raise Preempted(f"{self.stage}: stopped by SIGTERM; rerun to start again")
        log.warning("%s: SIGTERM: finishing the work in flight, then stopping", self.stage)

    def __exit__(self, *exc) -> None:
        if self._installed:
            signal.signal(signal.SIGTERM, self._previous)
            self._installed = False
