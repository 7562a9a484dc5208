"""SIGTERM handling shared by the stages (stages/common/preemption.py)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from stages.common.preemption import EXIT_PREEMPTED, Preempted, Preemption


def test_flag_mode_records_the_signal_and_restores_the_handler():
    before = signal.getsignal(signal.SIGTERM)
    with Preemption("train") as preemption:
        assert not preemption.requested
        os.kill(os.getpid(), signal.SIGTERM)
        assert preemption.requested  # the process lives on to finish its step
    assert signal.getsignal(signal.SIGTERM) == before


def test_immediate_mode_raises_in_the_main_thread():
    with (
        pytest.raises(Preempted, match="convert: stopped by SIGTERM"),
        Preemption("convert", immediate=True),
    ):
        os.kill(os.getpid(), signal.SIGTERM)  # the handler runs before the next bytecode
        pytest.fail("the handler did not raise")
    assert EXIT_PREEMPTED == 75  # documented in the README and the deploy templates


def test_outside_the_main_thread_nothing_is_installed():
    seen = []

    def body():
        with Preemption("generate") as preemption:
            seen.append(preemption._installed)

    thread = threading.Thread(target=body)
    thread.start()
    thread.join()
    assert seen == [False]
