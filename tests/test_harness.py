"""The test harness's own guard (tests/conftest.py): a test stuck where pytest-timeout cannot stop it
ends its process with every thread's stack printed, rather than hanging the run."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

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
