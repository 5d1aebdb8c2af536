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


class _CtrlCHere:
    """A descriptor whose ``__set_name__`` is where a Ctrl-C lands (a pydantic model's class body
    runs them as Prefect's modules are imported)."""

    def __set_name__(self, owner, name):
        _sigint_here()


def _in_set_name_of_a_module_a_library_imports() -> None:
    try:  # Python 3.11 re-raises what __set_name__ raised as a RuntimeError ...
        type("Model", (), {"field": _CtrlCHere()})
    except Exception:  # ... and Prefect logs and drops any error of its plugin start-up (a CI run)
        pass


def _caught_by_a_library() -> None:
    try:
        _sigint_here()
    except BaseException:  # noqa: BLE001 - what some libraries do around a call into user code
        pass


@pytest.mark.parametrize("where", [
    pytest.param(_in_set_name_of_a_module_a_library_imports, marks=pytest.mark.skipif(
        sys.version_info >= (3, 12), reason="Python 3.12 raises __set_name__'s errors as they are")),
    _caught_by_a_library])
def test_an_interrupt_a_library_dropped_is_raised_at_the_next_check(where, default_sigint, redelivering):
    """`paperline run` calls raise_if_interrupted before its flow run: it went on to the end (exit 0)."""
    interrupts.raise_if_interrupted()  # none yet
    where()  # no KeyboardInterrupt came out
    assert interrupts.interrupts_received() == 1
    with pytest.raises(KeyboardInterrupt):
        interrupts.raise_if_interrupted()
    interrupts.install()  # the next command (in-process tests run several): counted from there
    interrupts.raise_if_interrupted()


def test_a_hangup_is_counted_as_an_interrupt(default_sigint, redelivering):
    previous = {sig: signal.signal(sig, signal.SIG_DFL) for sig in (signal.SIGHUP, signal.SIGTERM)}
    try:
        assert interrupts.hangup_as_interrupt()
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(2)
        assert interrupts.interrupts_received() == 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def test_an_import_lock_left_held_by_an_interrupt_is_released(tmp_path, monkeypatch):
    """A Ctrl-C between importlib's taking of the global import lock and its ``try`` leaves the lock
    held by the main thread; every other thread's next import then waits for good (a `paperline
    run` interrupted as it started hung joining its cluster's start)."""
    import _imp
    import threading

    (tmp_path / "paperline_lock_probe.py").write_text("VALUE = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert interrupts.release_leaked_import_lock() == 0  # none held
    _imp.acquire_lock()  # as the interrupted bookkeeping leaves it
    imported: list[int] = []
    other = threading.Thread(target=lambda: imported.append(__import__("paperline_lock_probe").VALUE), daemon=True)
    other.start()
    other.join(timeout=1.0)
    assert other.is_alive() and imported == []  # waiting on the lock
    assert interrupts.release_leaked_import_lock() == 1
    other.join(timeout=10.0)
    assert imported == [1]
