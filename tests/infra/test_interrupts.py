"""A Ctrl-C that lands where Python cannot raise it (a gc callback, a finalizer) still interrupts
(infra/interrupts.py)."""

import gc
import os
import signal
import sys
import time

import pytest

from paperline.infra import interrupts


@pytest.fixture
def default_sigint():
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture
def redelivering(monkeypatch):
    # from a plain hook (`paperline run` called in this process by the CLI tests installed ours);
    # the previous one is restored after the test
    monkeypatch.setattr(sys, "unraisablehook", lambda unraisable: None)
    assert interrupts.install() and not interrupts.install()


def _sigint_here() -> None:
    os.kill(os.getpid(), signal.SIGINT)
    for _ in range(10_000):  # bytecodes for Python to run the handler in, here
        pass


def _in_a_gc_callback() -> None:
    ran: list[bool] = []

    def callback(phase, info):
        if phase == "start" and not ran:
            ran.append(True)
            _sigint_here()

    gc.callbacks.append(callback)
    try:
        gc.collect()
    finally:
        gc.callbacks.remove(callback)
    assert ran


def _in_a_finalizer() -> None:
    class Transport:
        def __del__(self):
            _sigint_here()

    Transport()  # finalized at once (reference count 0)


@pytest.mark.parametrize("where", [_in_a_gc_callback, _in_a_finalizer])
def test_an_interrupt_python_cannot_raise_arrives_just_after(where, default_sigint, redelivering):
    with pytest.raises(KeyboardInterrupt):
        where()
        time.sleep(2)  # the interrupt arrives here


@pytest.mark.parametrize("where", [_in_a_gc_callback, _in_a_finalizer])
def test_without_it_the_interrupt_is_lost(where, default_sigint, monkeypatch):
    """What it is for: Python only reports such an interrupt ("Exception ignored in ..."). (A
    plain hook here: `paperline run` called in this process, as the CLI tests do, installs ours.)"""
    reported = []
    monkeypatch.setattr(sys, "unraisablehook", reported.append)
    where()
    time.sleep(0.5)
    assert [u.exc_type for u in reported] == [KeyboardInterrupt]


def test_other_unraisable_errors_still_reach_the_previous_hook(redelivering, monkeypatch):
    seen = []
    monkeypatch.setattr(sys, "unraisablehook", seen.append)
    interrupts.install()

    class Broken:
        def __del__(self):
            raise ValueError("in a finalizer")

    Broken()
    assert [u.exc_type for u in seen] == [ValueError]
