"""The test harness's own guards (tests/conftest.py): a test stuck where pytest-timeout cannot stop it
ends its process with every thread's stack printed, rather than hanging the run; a test process
dying of a fatal signal prints its threads' native stacks as well as Python's."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

STUCK = '''
import signal, time
import pytest

@pytest.mark.timeout(1)
def test_stuck():
    # SIGALRM blocked: pytest-timeout's signal cannot interrupt this, as in a native deadlock
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGALRM})
    time.sleep(60)
'''


def test_a_test_past_its_timeout_that_sigalrm_cannot_stop_ends_the_process_with_stacks(tmp_path):
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_stuck.py").write_text(STUCK)
    env = {**os.environ, "PAPERLINE_TEST_HARD_TIMEOUT_GRACE_S": "1"}
    env.pop("PYTEST_XDIST_WORKER", None)
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "-c", os.devnull, str(tmp_path / "test_stuck.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=50)
    assert done.returncode == 70, done.stdout + done.stderr
    assert "test_stuck.py::test_stuck: still running 2 s after it started" in done.stderr
    assert "in test_stuck" in done.stderr  # the stuck test's own frame is in the dump
    if shutil.which("gdb"):  # and the native stacks, the main thread's sleeping in the kernel
        assert "Thread 1 " in done.stderr and "sleep" in done.stderr, done.stderr[-3000:]


ABORTS = '''
import ctypes, threading, time

def test_aborts_in_a_native_thread():
    # as C++'s std::terminate does in a library's own thread
    threading.Thread(target=ctypes.CDLL(None).abort, name="crasher").start()
    time.sleep(30)
'''


def test_a_fatal_signal_prints_the_native_stacks_then_pythons(tmp_path):
    if not (shutil.which("gdb") and (shutil.which("cc") or shutil.which("gcc"))):
        pytest.skip("needs gdb and a C compiler (.ci/run installs gdb)")
    shutil.copy(ROOT / "tests" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_aborts.py").write_text(ABORTS)
    env = {k: v for k, v in os.environ.items() if k != "PYTEST_XDIST_WORKER"}
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
                           "-c", os.devnull, str(tmp_path / "test_aborts.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == -6, done.stdout + done.stderr  # SIGABRT: the default action still ends it
    err = done.stderr
    assert "fatal signal in this test process" in err, err[-3000:]
    native, python = err.index("__GI_abort"), err.index("Fatal Python error: Aborted")
    assert native < python  # gdb's stacks first (the aborting thread's abort frame), then faulthandler's
    assert "in test_aborts_in_a_native_thread" in err[python:]
    assert "Thread 1 " in err[:python]  # every thread, not only the one that aborted


def test_a_stuck_command_fails_its_test_with_the_stacks_it_prints_on_sigusr1(run_cli, tmp_path):
    """``run_cli`` (what the stack tests run `paperline` with) asks a command still running at its
    timeout for its stacks and fails the test with them; a failed command with ``check`` shows its
    output."""
    stuck = ("import faulthandler, signal, sys, time\n"
             "faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)\n"
             "def waiting_for_something():\n    time.sleep(60)\n"
             "print('started', flush=True)\nwaiting_for_something()\n")
    (tmp_path / "stuck.py").write_text(stuck)
    with pytest.raises(pytest.fail.Exception) as failed:
        run_cli(dict(os.environ), "--flag", timeout=3, command=[sys.executable, str(tmp_path / "stuck.py")])
    text = str(failed.value)
    assert f"`{tmp_path / 'stuck.py'} --flag` still running after 3 s; its stacks (SIGUSR1)" in text, text
    assert "in waiting_for_something" in text and "started" in text, text
    (tmp_path / "fails.py").write_text("import sys; print('what went wrong', file=sys.stderr); sys.exit(3)\n")
    with pytest.raises(pytest.fail.Exception, match="(?s)fails.py` exited 3:.*what went wrong"):
        run_cli(dict(os.environ), command=[sys.executable, str(tmp_path / "fails.py")], check=True)
    assert run_cli(dict(os.environ), command=[sys.executable, str(tmp_path / "fails.py")]).returncode == 3
