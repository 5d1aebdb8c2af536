"""A Ctrl-C that lands inside a garbage-collector callback still interrupts (infra/interrupts.py)."""

import gc
import os
import signal
import time

import pytest

from paperline.infra import interrupts


@pytest.fixture
def on_sigint():
    previous = signal.signal(signal.SIGINT, interrupts.on_sigint)
    yield
    signal.signal(signal.SIGINT, previous)


def _interrupt_inside_a_gc_callback() -> list[bool]:
    """Run a full collection whose callback receives SIGINT (Python runs the handler inside it),
    then wait; returns whether the callback ran."""
    ran: list[bool] = []

    def callback(phase, info):
        if phase == "start" and not ran:
            ran.append(True)
            os.kill(os.getpid(), signal.SIGINT)
            for _ in range(10_000):  # bytecodes for the handler to run in, here
                pass

    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)
    time.sleep(2)  # the deferred interrupt arrives here
    return ran


def test_an_interrupt_inside_a_gc_callback_arrives_after_it(on_sigint):
    with pytest.raises(KeyboardInterrupt):
        _interrupt_inside_a_gc_callback()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the lost interrupt, reported
def test_pythons_own_handler_loses_it_there():
    """What the handler is for: with Python's default, the interrupt is "ignored" in the callback."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        assert _interrupt_inside_a_gc_callback() == [True]  # no KeyboardInterrupt: lost
    finally:
        signal.signal(signal.SIGINT, previous)


def test_elsewhere_it_is_a_keyboard_interrupt_at_once(on_sigint):
    with pytest.raises(KeyboardInterrupt):
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(2)


def test_installed_only_over_pythons_default():
    previous = signal.getsignal(signal.SIGINT)
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        assert not interrupts.install() and signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        signal.signal(signal.SIGINT, signal.default_int_handler)
        assert interrupts.install() and signal.getsignal(signal.SIGINT) is interrupts.on_sigint
    finally:
        signal.signal(signal.SIGINT, previous)
