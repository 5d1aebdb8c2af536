"""Local Dask workers start with glibc's default malloc behaviour (see infra/cluster.py): no
malloc threshold variable, in particular not the nanny's MALLOC_TRIM_THRESHOLD_."""

import asyncio
import contextlib
import os
import re
import sys
import time

import dask
import pytest
from distributed import Client, LocalCluster

from paperline.infra.cluster import DROPPED_WORKER_ENV, configure_local_workers


def test_local_workers_start_without_malloc_thresholds(monkeypatch):
    for key in DROPPED_WORKER_ENV:  # left in os.environ by any plain LocalCluster started earlier in this process
        monkeypatch.delenv(key, raising=False)
    nanny_default = {"MALLOC_TRIM_THRESHOLD_": 65536, "OMP_NUM_THREADS": 1}  # what Dask ships
    with dask.config.set({"distributed.nanny.pre-spawn-environ": nanny_default}):  # local to this test
        configure_local_workers()
        assert dask.config.get("distributed.nanny.pre-spawn-environ") == {"OMP_NUM_THREADS": 1}
        with LocalCluster(n_workers=1, threads_per_worker=1, processes=True, dashboard_address=None) as c, \
                Client(c) as client:
            keys = DROPPED_WORKER_ENV  # a lambda pickles by value (this module is not importable on workers)
            env = client.run(lambda: {k: __import__("os").environ.get(k) for k in keys})
    assert list(env.values()) == [dict.fromkeys(DROPPED_WORKER_ENV)]


def test_importing_a_flow_changes_no_dask_config():
    import subprocess
    import sys

    code = ("import dask, distributed; before = dict(dask.config.get('distributed.nanny.pre-spawn-environ')); "
            "import paperline.flows.gemm, paperline.flows.tensor_factorization; "
            "assert dict(dask.config.get('distributed.nanny.pre-spawn-environ')) == before, 'changed'")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_local_workers_preload_the_task_engine_before_any_task():
    from paperline.infra.cluster import _local_cpu_kwargs
    from paperline.infra.settings import Settings

    kwargs = {**_local_cpu_kwargs(Settings(n_workers=1)), "dashboard_address": None}
    with LocalCluster(**kwargs) as c, Client(c) as client:
        client.wait_for_workers(1)
        loaded = client.run(lambda: [m in __import__("sys").modules for m in ("prefect.task_engine", "paperline.tasks")])
        # the preloads' imports frozen (infra/worker_heap.py), and the collector on again for the tasks
        heap = client.run(lambda: (__import__("gc").isenabled(), __import__("gc").get_freeze_count() > 100_000))
    assert list(loaded.values()) == [[True, True]]
    assert list(heap.values()) == [(True, True)]


def test_configured_before_distributed_is_imported_stays_configured():
    """`paperline run` configures its cluster before anything imported `distributed`, whose import
    merges Dask's defaults (MALLOC_TRIM_THRESHOLD_ included) back: a run then took twice as long."""
    import subprocess
    import sys

    code = ("import sys, dask; from paperline.infra.cluster import configure_local_workers, DROPPED_WORKER_ENV; "
            "assert 'distributed' not in sys.modules; configure_local_workers(); import distributed; "
            "env = dask.config.get('distributed.nanny.pre-spawn-environ'); "
            "assert not set(env) & set(DROPPED_WORKER_ENV), env; assert env.get('OMP_NUM_THREADS') == 1, env")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_background_cluster_is_the_local_cluster_task_runner_would_start(monkeypatch):
    from paperline.infra.cluster import BackgroundCluster, task_runner
    from paperline.infra.settings import Settings

    for key in DROPPED_WORKER_ENV:  # a nanny started with Dask's defaults (another test) exports them
        monkeypatch.delenv(key, raising=False)

    settings = Settings(n_workers=1)
    with BackgroundCluster(settings) as early:
        runner = task_runner(settings, started=early)
        import cloudpickle  # noqa: PLC0415 - Prefect pickles the flow, and its runner, into every task's context

        assert cloudpickle.loads(cloudpickle.dumps(runner)).cluster_kwargs == {"token": early.token}
        with runner:  # the runner takes the cluster over: its client knows the cluster and its workers
            client = runner.client
            assert client.cluster is early.cluster()
            client.wait_for_workers(1, timeout=60)
            env = client.run(lambda: {k: __import__("os").environ.get(k) for k in ("MALLOC_TRIM_THRESHOLD_",
                                                                                  "OMP_NUM_THREADS")})
            loaded = client.run(lambda: "prefect.task_engine" in __import__("sys").modules)
        assert early.cluster().status.name == "closed"  # closed with the runner
    assert list(env.values()) == [{"MALLOC_TRIM_THRESHOLD_": None, "OMP_NUM_THREADS": "1"}]
    assert list(loaded.values()) == [True]
    early.close()  # idempotent
    try:
        early.cluster()
    except RuntimeError as exc:
        assert "closed" in str(exc)
    else:
        raise AssertionError("a closed BackgroundCluster gave its cluster")


def test_a_worker_closed_on_request_still_runs_the_exit_hooks_its_tasks_registered(tmp_path):
    """infra/worker_exit.py ends a cleanly closed worker with os._exit, after the atexit hooks
    registered once it started (Prefect's log and event drains are such hooks): they must run."""
    from paperline.infra.cluster import _local_cpu_kwargs
    from paperline.infra.settings import Settings

    marker = tmp_path / "drained"

    def register_drain(path: str) -> bool:
        import atexit
        import pathlib

        atexit.register(pathlib.Path(path).write_text, "drained")
        return "paperline.infra.worker_exit" in __import__("sys").modules

    kwargs = {**_local_cpu_kwargs(Settings(n_workers=1)), "dashboard_address": None}
    with LocalCluster(**kwargs) as c, Client(c) as client:
        client.wait_for_workers(1)
        assert client.submit(register_drain, str(marker), pure=False).result() is True
        nanny = next(iter(c.workers.values()))
        process = nanny.process.process  # the worker's multiprocessing process
    assert marker.read_text() == "drained"
    assert process.exitcode == 0


def test_a_local_worker_process_leaves_ctrl_c_to_the_process_that_owns_the_cluster():
    """A terminal's Ctrl-C reached the local worker processes too, and each printed two
    KeyboardInterrupt tracebacks while its nanny was already closing it (a fresh-user trial): under
    a nanny a worker process now drops SIGINT, and is stopped by the nanny as before."""
    import os
    import signal
    import time

    from paperline.infra.cluster import _local_cpu_kwargs
    from paperline.infra.settings import Settings

    def handler_name() -> str:
        import signal

        return getattr(signal.getsignal(signal.SIGINT), "__name__", "")

    kwargs = {**_local_cpu_kwargs(Settings(n_workers=1)), "dashboard_address": None}
    with LocalCluster(**kwargs) as c, Client(c) as client:
        client.wait_for_workers(1)
        (pid,) = client.run(os.getpid).values()
        assert list(client.run(handler_name).values()) == ["_ignore_interrupt"]
        os.kill(pid, signal.SIGINT)
        time.sleep(1.0)
        assert list(client.run(os.getpid).values()) == [pid]  # the same process, still serving
        process = next(iter(c.workers.values())).process.process
    assert process.exitcode == 0  # closed by its nanny, cleanly
    assert handler_name() != "_ignore_interrupt"  # this process keeps its own


_HEARTBEAT_IN_FLIGHT_AT_CLOSE = r'''
import asyncio, socket, sys
from distributed import Client, LocalCluster
from paperline.infra.cluster import _local_cpu_kwargs
from paperline.infra.settings import Settings

silent = socket.create_server(("127.0.0.1", 0))  # accepts (backlog) and never answers
address = "tcp://127.0.0.1:%d" % silent.getsockname()[1]

async def heartbeat_hangs(dask_worker):
    """The worker's next heartbeat goes to a peer that never replies: in flight when it closes."""
    dask_worker.scheduler = dask_worker.rpc(address)
    asyncio.ensure_future(dask_worker.heartbeat())
    await asyncio.sleep(0.5)

kwargs = {**_local_cpu_kwargs(Settings(n_workers=1)), "dashboard_address": None}
if sys.argv[1] == "without":
    kwargs["preload"] = [p for p in kwargs["preload"] if p != "paperline.infra.worker_exit"]
with LocalCluster(**kwargs) as c, Client(c) as client:
    client.wait_for_workers(1)
    client.run(heartbeat_hangs)
'''


def test_a_heartbeat_cut_by_the_workers_own_close_prints_no_traceback():
    """A worker closing on request aborts its in-flight heartbeat (``Worker.close`` closes its RPC
    pool); distributed logs that at ERROR with the tcp read's traceback, on the terminal of
    ``paperline run`` (it made `test_missing_s3_data_is_one_clear_line` fail at random). The
    worker preload drops it. Without the preload the same script prints it: the check can fail."""
    import subprocess
    import sys

    def run(mode: str) -> str:
        proc = subprocess.run([sys.executable, "-c", _HEARTBEAT_IN_FLIGHT_AT_CLOSE, mode],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        return proc.stdout + proc.stderr

    assert "Failed to communicate with scheduler during heartbeat" in run("without")
    out = run("with")
    assert "Failed to communicate" not in out and "Traceback" not in out, out


def test_a_heartbeat_failing_while_the_worker_runs_is_still_logged():
    import logging

    from distributed.core import Status

    from paperline.infra.worker_exit import ClosingCommErrorFilter

    class FakeWorker:  # only .status is read
        status = Status.running

    def record(exc: BaseException | None) -> logging.LogRecord:
        info = (type(exc), exc, None) if exc is not None else None
        return logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1,
                                 "Failed to communicate with scheduler during heartbeat.", (), info)

    worker = FakeWorker()
    quiet = ClosingCommErrorFilter(worker)
    assert quiet.filter(record(OSError("in: read")))  # running: kept
    worker.status = Status.closing
    assert not quiet.filter(record(OSError("in: read")))  # closing: dropped
    assert quiet.filter(record(ValueError("a bug")))  # not a comm error: kept
    assert quiet.filter(record(None))


def test_tasks_cancelled_by_a_closing_worker_are_not_logged_one_long_line_each():
    import logging

    from distributed.core import Status

    from paperline.infra.worker_exit import CancelledOnCloseFilter

    class FakeWorker:  # only .status is read
        status = Status.running

    def record(message: str) -> logging.LogRecord:
        return logging.LogRecord("distributed.worker.state_machine", logging.WARNING, __file__, 1, message, (), None)

    cancelled = ("Async instruction for <Task cancelled name=\"execute('rank-0-fft-0-1')\" coro=<Worker.execute() "
                 "done, defined at worker_state_machine.py:3606>> ended with CancelledError")
    worker = FakeWorker()
    quiet = CancelledOnCloseFilter(worker)
    assert quiet.filter(record(cancelled))  # running: kept (Dask says it should not happen then)
    worker.status = Status.closing
    assert not quiet.filter(record(cancelled))
    assert quiet.filter(record("Unhandled exception in async instruction for <Task ...>"))


def test_starting_a_local_cluster_leaves_this_process_single_threaded_blas_free():
    """Dask's nanny writes OMP/MKL/OPENBLAS_NUM_THREADS=1 into the starting process's environment
    (a native library loaded after that ran on one core: the GEMM flow's SciPy peer did).
    ``start_local_cluster`` puts this process's values back; its workers still get 1 thread."""
    import os
    import subprocess
    import sys

    code = """
import os
os.environ["MKL_NUM_THREADS"] = "3"  # a user's own value is kept as it was
from paperline.infra.cluster import _local_cpu_kwargs, configure_local_workers, start_local_cluster
from paperline.infra.settings import Settings
from distributed import Client
configure_local_workers()
kwargs = {**_local_cpu_kwargs(Settings(n_workers=1)), "dashboard_address": None}
with start_local_cluster("distributed.LocalCluster", **kwargs) as c, Client(c) as client:
    keys = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    here = [os.environ.get(k) for k in keys]
    there = list(client.run(lambda: [os.environ.get(k) for k in keys]).values())[0]
print(here, there)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if "NUM_THREADS" not in k})
    assert out.returncode == 0, out.stderr
    # here: as before the start; there: Dask's 1, except where this process had set a value (Dask keeps it)
    assert out.stdout.split("\n")[-2] == "[None, '3', None] ['1', '3', '1']"


def test_a_failed_task_is_one_line_on_the_workers_terminal(monkeypatch):
    """The worker's "Compute Failed" record (task repr and traceback in one escaped blob) becomes
    one line: the key and the exception; the caller still gets the traceback."""
    import logging

    from paperline.infra.worker_exit import TaskFailureOneLine

    record = logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1,
                               "Compute Failed\nKey:       %s\nState:     %s\nTask:  %s\nException: %r\nTraceback: %r\n",
                               ("rank-1-fft-0", "executing", "<Task ...>", "RuntimeError('peer died')",
                                '  File "x.py", line 1\n'), None)
    assert TaskFailureOneLine().filter(record)
    assert record.getMessage() == "task rank-1-fft-0 failed on this worker: RuntimeError('peer died')"
    other = logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1, "something else %s", ("x",), None)
    assert TaskFailureOneLine().filter(other) and other.getMessage() == "something else x"
    # an error raised on purpose is said once by its caller (a diverged training's ranks each
    # printed it again before the one-line error: a trial)
    from paperline.kernels.train.ddp import TrainingDiverged  # noqa: F401 - loaded, as in the rank's worker

    monkeypatch.delenv("PAPERLINE_DEBUG", raising=False)  # (an in-process `--debug` test leaves it set)
    import os

    import paperline

    home = os.path.dirname(os.path.abspath(paperline.__file__))
    ours = f'  File "{home}/tasks/training.py", line 9, in train\n    raise TrainingDiverged(...)\n'
    theirs = f'  File "{home}/tasks/y.py", line 1, in f\n  File "/usr/lib/site-packages/lib/api.py", line 5, in g\n'

    def failed(text, traceback):
        return logging.LogRecord("distributed.worker", logging.ERROR, __file__, 1,
                                 "Compute Failed\nKey: %s\nState: %s\nTask: %s\nException: %r\nTraceback: %r\n",
                                 ("rank-0-none-0", "executing", "<Task ...>", text, traceback), None)

    for text in ("TrainingDiverged(\"lr=1000000.0: training diverged\")", "InputError('x')"):
        assert not TaskFailureOneLine().filter(failed(text, ours)), text
    # another library's error of a like name (raised in its code) is kept, and so is all under --debug
    assert TaskFailureOneLine().filter(failed("ServiceError('down')", theirs))
    monkeypatch.setenv("PAPERLINE_DEBUG", "1")
    assert TaskFailureOneLine().filter(failed("InputError('x')", ours))


def test_the_dask_profilers_frame_race_is_not_a_traceback_on_the_terminal():
    """tornado logged "Exception in callback <bound method Worker.trigger_profile ...>" with
    "AttributeError: 'code' object has no attribute 'f_code'" from distributed/profile.py on a
    trial's terminal (an upstream race, harmless): dropped; other callback errors are kept."""
    import logging
    import sys

    from distributed import profile

    from paperline.infra.worker_exit import no_profiler_race

    def record(callback: str, exc_info) -> logging.LogRecord:
        return logging.LogRecord("tornado.application", logging.ERROR, __file__, 1, "Exception in callback %r",
                                 (callback,), exc_info)

    try:
        profile.identifier(compile("1", "x", "eval"))  # a code object where a frame was: the race's error
    except AttributeError:
        race = sys.exc_info()
    try:
        {}.missing  # noqa: B018 - an AttributeError of another origin
    except AttributeError:
        ours = sys.exc_info()
    profiler = "<bound method Worker.trigger_profile of <Worker 'tcp://127.0.0.1:4'>>"
    assert not no_profiler_race(record(profiler, race))
    assert no_profiler_race(record(profiler, ours))
    assert no_profiler_race(record("<bound method Worker.heartbeat of <Worker>>", race))
    assert no_profiler_race(record(profiler, None))


def test_daks_sync_cancel_race_on_ctrl_c_is_kept_off_the_terminal():
    """Ctrl-C before Dask's sync() made its future: tornado logged the NameError of its cancel
    callback after the run's "interrupted" line (a trial). Dropped; other callback errors kept."""
    import functools
    import logging
    import sys

    from paperline.flows.cli import _no_sync_cancel_race

    def sync():  # the shape of distributed.utils.sync: cancel reads `future` before it is bound
        def cancel():
            if future is not None:
                return None

        try:
            cancel()
        except NameError:
            return sys.exc_info(), functools.partial(cancel)
        future = None  # noqa: F841

    race, callback = sync()

    def record(exc_info, callback=callback) -> logging.LogRecord:
        return logging.LogRecord("tornado.application", logging.ERROR, __file__, 1, "Exception in callback %r",
                                 (callback,), exc_info)

    assert "sync.<locals>.cancel" in record(race).getMessage() and "'future'" in str(race[1])
    assert not _no_sync_cancel_race(record(race))
    try:
        undefined_name  # noqa: B018, F821 - a NameError of another origin
    except NameError:
        other = sys.exc_info()
    assert _no_sync_cancel_race(record(other)) and _no_sync_cancel_race(record(None))
    assert _no_sync_cancel_race(record(race, callback="<bound method Worker.heartbeat>"))


def test_a_tasks_record_of_a_server_gone_is_one_line_on_the_workers_terminal():
    """With the stack stopped under a run, each task finishing in a worker logged Prefect's "An error
    was encountered while committing transaction" with botocore's three chained tracebacks (a
    trial's nas run printed 327 lines). Now one line with the error; other errors keep theirs."""
    import io
    import logging

    from botocore.exceptions import EndpointConnectionError

    from paperline.infra.worker_exit import ServerGoneOneLine

    logger = logging.getLogger("paperline-test.task_runs")
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    logger.addHandler(handler)
    logger.addFilter(ServerGoneOneLine())
    logger.propagate = False
    try:
        try:
            try:
                raise ConnectionRefusedError(111, "Connection refused")
            except ConnectionRefusedError as exc:
                raise EndpointConnectionError(endpoint_url="http://127.0.0.1:8333/paperline-results/5cbc") from exc
        except EndpointConnectionError:
            logger.exception("An error was encountered while committing transaction %r", "5cbc")
        gone = out.getvalue()
        assert gone == ("An error was encountered while committing transaction '5cbc': EndpointConnectionError: Could "
                        "not connect to the endpoint URL: \"http://127.0.0.1:8333/paperline-results/5cbc\"\n"), gone
        try:
            raise ValueError("a real bug")
        except ValueError:
            logger.exception("An error was encountered while committing transaction %r", "6dd")
        assert "Traceback (most recent call last)" in out.getvalue()[len(gone):]
        seen = len(out.getvalue())
        try:  # a bug in the handling of a connection error is not the connection error: its traceback stays
            try:
                raise EndpointConnectionError(endpoint_url="http://127.0.0.1:8333/x")
            except EndpointConnectionError:
                raise KeyError("a bug while handling it")  # noqa: B904
        except KeyError:
            logger.exception("An error was encountered while committing transaction %r", "7ee")
        assert "Traceback (most recent call last)" in out.getvalue()[seen:]
        assert "KeyError: 'a bug while handling it'" in out.getvalue()[seen:]
    finally:
        logger.removeHandler(handler)


def test_a_dead_scheduler_address_is_one_clear_error_before_any_run(settings_factory, free_port, tmp_path):
    """`PAPERLINE_DASK_SCHEDULER_ADDRESS` pointing nowhere failed inside the run after 65 s (Dask's
    connect timeouts); `paperline run` and `serve` now check it first."""
    import socket
    import time

    from paperline.infra.cluster import require_scheduler
    from paperline.infra.errors import ServiceError

    dead = f"tcp://127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(ServiceError, match=rf"^dask scheduler is not available at {dead}: cannot connect"):
        require_scheduler(settings_factory(tmp_path, dask_scheduler_address=dead))
    assert time.monotonic() - started < 5
    assert require_scheduler(settings_factory(tmp_path)) is None  # a local cluster: nothing to check


def test_a_scheduler_address_without_a_port_says_daks_default(settings_factory, tmp_path):
    """`tcp://host` connects to 8786, which went unsaid (an infra trial)."""
    from paperline.infra.cluster import default_port_note, describe_cluster

    said = describe_cluster(settings_factory(tmp_path, dask_scheduler_address="tcp://10.0.0.5"))
    assert said == "existing Dask scheduler at tcp://10.0.0.5 (port 8786, Dask's default: the address names none)"
    assert default_port_note("10.0.0.5") == default_port_note("tls://h") != ""
    assert default_port_note("tcp://10.0.0.5:8786") == default_port_note("10.0.0.5:40123") == ""
    assert default_port_note("inproc://x") == default_port_note("tcp://h:port") == ""


def test_a_scheduler_address_is_checked_with_daks_own_comms_and_its_workers_counted(settings_factory, tmp_path):
    """A `tls://` address to a plain scheduler, or an `http://` one (its dashboard), passed the bare
    socket check and failed in the run with Dask's TypeError/ValueError naming no setting; a
    scheduler without workers let tensor and nas runs wait silently (a trial)."""
    import asyncio
    import gc
    import warnings

    from distributed import Scheduler, Worker

    from paperline.infra.cluster import require_scheduler
    from paperline.infra.errors import ServiceError

    def check(address):
        return require_scheduler(settings_factory(tmp_path, dask_scheduler_address=address))

    async def scheduler_then(body):
        async with Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as s:
            return await asyncio.to_thread(body, s)

    def probes(s):
        port = s.address.rsplit(":", 1)[1]
        counts = [check(s.address), check(f"127.0.0.1:{port}")]  # (no scheme: tcp)
        for bad, says in ((f"tls://127.0.0.1:{port}", "TypeError: TLS expects a `ssl_context`"),
                          (f"tls://127.0.0.1:{port}", "a tls:// address needs Dask's TLS settings for its client, and "
                                                      "none are set: distributed.comm.tls.ca-file, .client.cert"),
                          (f"http://127.0.0.1:{port}", "ValueError: unknown address scheme 'http'")):
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                with pytest.raises(ServiceError, match="check PAPERLINE_DASK_SCHEDULER_ADDRESS") as refused:
                    check(bad)
                gc.collect()
            assert says in str(refused.value), refused.value
            # the client that failed to connect is closed (collected, it printed "RuntimeWarning:
            # coroutine 'wait_for' was never awaited" under the refusal)
            assert not [str(w.message) for w in caught if "never awaited" in str(w.message)]
        return counts

    assert asyncio.run(scheduler_then(probes)) == [0, 0]

    async def one_worker(s):
        async with Worker(s.address, nthreads=1):
            return await asyncio.to_thread(check, s.address)

    async def with_worker():
        async with Scheduler(host="127.0.0.1", port=0, dashboard_address=":0") as s:
            return await one_worker(s)

    assert asyncio.run(with_worker()) == 1


def test_the_local_cluster_takes_only_its_own_clients():
    """A plain tcp:// scheduler on 127.0.0.1 took clients from every local user, who ran code as
    this one through it (Client.run) and read the stack's logins from the workers' environment
    (a trial). The local cluster speaks TLS with certificates of its own: a client made from the
    cluster works; plain TCP and TLS with other certificates are refused."""
    from distributed.security import Security

    from paperline.infra.cluster import start_local_cluster

    with start_local_cluster("distributed.LocalCluster", n_workers=1, threads_per_worker=1, processes=False,
                             host="127.0.0.1", dashboard_address=None) as cluster:
        assert cluster.scheduler_address.startswith("tls://127.0.0.1:")
        with Client(cluster) as client:
            assert client.submit(sum, [40, 2]).result() == 42
        plain = cluster.scheduler_address.replace("tls://", "tcp://")

        async def connect(address: str, security: Security | None) -> None:
            async with Client(address, security=security, timeout=5, asynchronous=True):
                pass

        # asynchronous, in a loop asyncio.run closes: a refused synchronous Client leaves its IO-loop
        # thread running in this process for the rest of the session (two per run of this test)
        for address, security in ((plain, None), (cluster.scheduler_address, Security.temporary())):
            with pytest.raises(Exception):  # noqa: B017 - CommClosedError, OSError, ssl.SSLError: any refusal
                asyncio.run(connect(address, security))


def test_a_nanny_with_paperlines_preload_starts_its_worker_without_malloc_trim(tmp_path):
    """Workers of one's own cluster: `DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON` is merged into
    Dask's defaults, so MALLOC_TRIM_THRESHOLD_ stayed (an external-cluster trial: a fit twice as
    slow); the nanny preload removes it, the variable's thread settings stay."""
    import json
    import os
    import subprocess
    import sys

    code = ("import asyncio, json, os\n"
            "from distributed import Client, Nanny, Scheduler\n"
            "async def main():\n"
            "    async with Scheduler(host='127.0.0.1', port=0, dashboard_address=None) as s, "
            "Nanny(s.address, nthreads=1, preload_nanny=PRELOAD), "
            "Client(s.address, asynchronous=True) as c:\n"
            "        env = await c.run(lambda: {k: os.environ.get(k) for k in ('MALLOC_TRIM_THRESHOLD_', 'OMP_NUM_THREADS')})\n"
            "        print(json.dumps(list(env.values())[0]))\n"
            "asyncio.run(main())\n")
    from paperline.infra.cluster import DROPPED_WORKER_ENV

    # (a shell's environment: this process's held MALLOC_TRIM_THRESHOLD_ after earlier tests of the module)
    env = {k: v for k, v in os.environ.items() if k not in DROPPED_WORKER_ENV}
    env["DASK_DISTRIBUTED__NANNY__PRE_SPAWN_ENVIRON"] = '{"OMP_NUM_THREADS": 1}'
    seen = {}
    for preload in ([], ["paperline.infra.nanny_env"]):
        out = subprocess.run([sys.executable, "-c", code.replace("PRELOAD", repr(preload))], env=env, cwd=tmp_path,
                             capture_output=True, text=True, timeout=180)
        assert out.returncode == 0, out.stderr[-3000:]
        seen[bool(preload)] = json.loads(out.stdout.strip().splitlines()[-1])
    # the check can fail: Dask's default is there without the preload
    assert seen[False] == {"MALLOC_TRIM_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}, seen
    assert seen[True] == {"MALLOC_TRIM_THRESHOLD_": None, "OMP_NUM_THREADS": "1"}, seen


def test_workers_that_cannot_import_paperline_are_named_before_the_run(settings_factory, tmp_path, free_port):
    """Workers started from an environment without paperline: `status` said healthy, and each run
    failed at its first task with "ModuleNotFoundError" or "Error during deserialization of the
    task graph ... the Scheduler and Client have different environments" (a trial)."""
    import contextlib
    import os
    import subprocess
    import sys
    import time

    from distributed import Client

    from paperline.infra.cluster import require_scheduler
    from paperline.infra.errors import ServiceError

    blocked = tmp_path / "without-paperline"
    blocked.mkdir()
    (blocked / "sitecustomize.py").write_text(  # this interpreter, as if paperline were not installed
        "import sys\n"
        "class _NoPaperline:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'paperline' or name.startswith('paperline.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "sys.meta_path.insert(0, _NoPaperline())\n")
    port = free_port()
    address = f"tcp://127.0.0.1:{port}"
    env = {**os.environ, "PYTHONPATH": str(blocked)}
    scheduler = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                                  "--port", str(port), "--dashboard-address", ":0"],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    worker = subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1",
                               "--no-nanny", "--no-dashboard"], env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError, TimeoutError):
                with Client(address, timeout=5) as client:
                    if client.scheduler_info(n_workers=-1).get("workers"):
                        break
            assert time.monotonic() < deadline and worker.poll() is None and scheduler.poll() is None
            time.sleep(0.5)
        with pytest.raises(ServiceError, match=rf"^1 of the 1 Dask worker\(s\) of the scheduler at {address} "
                                               r"cannot import paperline \(tcp://127\.0\.0\.1:\d+\): "
                                               r"install paperline in the workers' environment"):
            require_scheduler(settings_factory(tmp_path, dask_scheduler_address=address))
    finally:
        for proc in (worker, scheduler):
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()


def _unshare_works() -> bool:
    """Whether a user and mount namespace can mount a tmpfs here (some hosts allow the namespace
    but not the mount: a review)."""
    import shutil
    import subprocess
    import tempfile

    if not shutil.which("unshare"):
        return False
    with tempfile.TemporaryDirectory() as where:
        return subprocess.run(["unshare", "-Urm", "sh", "-c", f"mount -t tmpfs tmpfs '{where}'"],
                              capture_output=True).returncode == 0


@contextlib.contextmanager
def _scheduler_and_workers(port: int, workers: list[tuple[list[str], dict[str, str]]]):
    """A Dask scheduler on 127.0.0.1:``port`` and one ``--no-nanny`` worker per ``(prefix, env)``:
    its command run under ``prefix`` (an ``sh -c`` taking the command as ``$@``, or none), with
    ``env`` over this environment (less Dask's malloc variables); yields ``(address, worker
    processes)`` once every worker has joined."""
    import subprocess
    import sys
    import time

    from distributed import Client

    address = f"tcp://127.0.0.1:{port}"
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
    procs = [subprocess.Popen([sys.executable, "-m", "distributed.cli.dask_scheduler", "--host", "127.0.0.1",
                               "--port", str(port), "--dashboard-address", ":0"], **quiet)]
    try:
        for i, (prefix, env) in enumerate(workers):
            command = [sys.executable, "-m", "distributed.cli.dask_worker", address, "--nthreads", "1",
                       "--no-nanny", "--no-dashboard", "--name", f"w{i}"]
            base = {k: v for k, v in os.environ.items() if k not in DROPPED_WORKER_ENV}  # (earlier tests' LocalClusters
            procs.append(subprocess.Popen([*prefix, *command], env={**base, **env}, **quiet))  # leave them here)
        deadline = time.monotonic() + 120
        while True:
            with contextlib.suppress(OSError, TimeoutError):
                with Client(address, timeout=5) as client:
                    if len(client.scheduler_info(n_workers=-1).get("workers", {})) == len(workers):
                        break
            assert time.monotonic() < deadline and all(p.poll() is None for p in procs)
            time.sleep(0.5)
        yield address, procs[1:]
    finally:
        for proc in reversed(procs):
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(30)
            if proc.poll() is None:
                proc.kill()


@pytest.mark.skipif(not _unshare_works(), reason="needs unshare (util-linux) and user namespaces")
def test_workers_that_do_not_see_a_runs_local_paths_are_named_before_the_run(settings_factory, tmp_path, free_port,
                                                                             monkeypatch):
    """A trial's workers in a mount namespace of their own (as on another machine) failed gemm at
    its first task with `FileNotFoundError: .../gemm/operands/<digest>.npy`; a worker with another
    file of the same name would have read it. Here worker w1 sees `shared/` as an empty tmpfs
    holding only a different `a.npy`: every local path is named, with that worker and what it saw."""
    from paperline.infra.cluster import WorkerPath, require_shared_paths
    from paperline.infra.errors import InputError

    shared, seen_by_all, locked = tmp_path / "shared", tmp_path / "both.npy", tmp_path / "locked"
    (shared / "out").mkdir(parents=True)
    locked.mkdir()
    (shared / "a.npy").write_bytes(b"x" * 100)
    (shared / "b.npy").write_bytes(b"y" * 10)
    (shared / "c.npy").write_bytes(b"c" * (3 << 16))
    seen_by_all.write_bytes(b"z" * 10)
    # w1: shared/ an empty tmpfs but for an a.npy of another size and a c.npy of the same size (its
    # last bytes differ); locked/ read-only
    elsewhere = ["unshare", "-Urm", "sh", "-c",
                 f"mount -t tmpfs tmpfs '{shared}' && printf xx > '{shared}/a.npy' && "
                 f"{sys.executable} -c \"open('{shared}/c.npy', 'wb').write(b'c' * ((3 << 16) - 1) + b'd')\" && "
                 f"mount --bind '{locked}' '{locked}' && mount -o remount,ro,bind '{locked}' && exec \"$@\"", "sh"]
    with _scheduler_and_workers(free_port(), [([], {}), (elsewhere, {})]) as (address, _):
        settings = settings_factory(tmp_path, dask_scheduler_address=address)
        # the run's to reject, not asked: missing here too, a FIFO (its open blocked for good) and a link to a
        # directory (it raised IsADirectoryError: a review)
        (tmp_path / "broken.mp4").symlink_to(tmp_path / "gone.mp4")
        os.mkfifo(tmp_path / "fifo.mp4")
        (tmp_path / "dir.mp4").symlink_to(shared)
        require_shared_paths(settings, [WorkerPath("a", "both.npy", str(seen_by_all)),
                                        *(WorkerPath("source", "v", str(tmp_path / f"{n}.mp4"))
                                          for n in ("broken", "fifo", "dir")),
                                        WorkerPath("PAPERLINE_STATE_DIR", str(tmp_path), str(tmp_path / "gemm"),
                                                   writes=True)])
        with pytest.raises(InputError, match=r"^a='shared/a\.npy': 1 of the 2 Dask worker\(s\) of the scheduler at "
                                             rf"{address} do not see {shared}/a\.npy \(w1 at tcp://127\.0\.0\.1:"
                                             r"\d+ \(another file of that name: 2 bytes, not 100\)\) \(2 more of this "
                                             r"run's paths likewise\): workers use local paths as this machine names "
                                             r"them; share it with them at the same path \(NFS, a cluster file system\), "
                                             r"or give a as an s3:// URI$"):
            require_shared_paths(settings, [WorkerPath("a", "shared/a.npy", str(shared / "a.npy"),
                                                       instead="give a as an s3:// URI"),
                                            WorkerPath("b", "shared/b.npy", str(shared / "b.npy")),
                                            WorkerPath("output", "shared/out/c.npy", str(shared / "out"), writes=True)])
        with pytest.raises(InputError, match=r"^b=.* do not see .*/b\.npy \(w1 at .* \(no such file\)\) "
                                             r"\(1 more"):
            require_shared_paths(settings, [WorkerPath("b", "shared/b.npy", str(shared / "b.npy")),
                                            WorkerPath("output", "shared/out/c.npy", str(shared / "out"), writes=True)])
        # the same size and (here) time: a trial's other B.npy was caught only by gemm's verification
        with pytest.raises(InputError, match=r"^c=.* \(another file of that name: the same size, other contents\)"):
            require_shared_paths(settings, [WorkerPath("c", "shared/c.npy", str(shared / "c.npy"))])
        with pytest.raises(InputError, match=r"^output='shared/out/c\.npy': 1 of the 2 .* cannot write in .*/out "
                                             r"\(w1 at .* \(another directory of that name, or none\)\): "):
            require_shared_paths(settings, [WorkerPath("output", "shared/out/c.npy", str(shared / "out"), writes=True)])
        with pytest.raises(InputError, match=r"^output=.* cannot write in .*/locked \(w1 at .* \(not writable "
                                             r"there\)\): let the workers' user write in it$"):  # (not "share it")
            require_shared_paths(settings, [WorkerPath("output", "locked/c.npy", str(locked), writes=True)])
        assert not [p.name for p in (shared / "out").iterdir()], "the marker files are removed"
        assert not [p.name for p in (tmp_path / "gemm").iterdir()]
        # `paperline run` asks before the stack and the flow run (a refusal in the flow was a Failed
        # flow run each: a trial); gemm's staged operands and S3 result need the state directory
        from typer.testing import CliRunner

        from paperline.flows.cli import app
        from paperline.infra.settings import get_settings

        get_settings.cache_clear()
        try:
            res = CliRunner().invoke(app, ["run", "gemm", "--set", "m=64", "--set", "n=64", "--set", "k=64", "--set",
                                           "tile=32"], env={"PAPERLINE_STATE_DIR": str(shared),
                                                            "PAPERLINE_DASK_SCHEDULER_ADDRESS": address})
        finally:
            get_settings.cache_clear()
        said = " ".join(res.output.split())
        assert res.exit_code == 1 and f"error: PAPERLINE_STATE_DIR='{shared}': 1 of the 2 Dask worker(s)" in said, said
        assert f"cannot write in {shared}/gemm (w1 at" in said and "this run stages the random operands and stages " \
               "the result for S3 and writes the scaling sweep's results there" in said, said
        assert not (shared / "stack.json").exists()  # nothing started

        # a folder of many videos: at most SHARED_CHECK_FILES files asked of each worker (spread, the
        # first and last kept), the first SAMPLED_FILES by content; paths that passed are not asked
        # again within SHARED_CHECK_TTL_S (`run` checks, then its flow)
        import paperline.infra.cluster as cluster

        asked: list[list] = []
        real = cluster._run_on_each

        async def counted(client, fn, expected, *, timeout_s):
            asked.append(expected)
            return await real(client, fn, expected, timeout_s=timeout_s)

        monkeypatch.setattr(cluster, "_run_on_each", counted)
        monkeypatch.setattr(cluster, "_CHECKED", {})  # (aged below: the process's own memory left alone)
        many = tmp_path / "many"
        many.mkdir()
        for i in range(300):
            (many / f"{i:03d}.mp4").write_bytes(b"v" * (i + 1))
        needs = [WorkerPath("source", "many/", str(many / f"{i:03d}.mp4")) for i in range(300)]
        require_shared_paths(settings, needs)
        (files,) = asked
        assert len(files) == cluster.SHARED_CHECK_FILES == 256
        assert (files[0][1], files[-1][1]) == (str(many / "000.mp4"), str(many / "299.mp4"))
        assert [want[1] is not None for _, _, want in files] == [True] * cluster.SAMPLED_FILES + [False] * 224
        require_shared_paths(settings, needs)
        assert len(asked) == 1  # remembered
        for key in cluster._CHECKED:  # ... for two minutes
            cluster._CHECKED[key] -= cluster.SHARED_CHECK_TTL_S
        require_shared_paths(settings, needs)
        assert len(asked) == 2
        # the local cluster's workers share this machine's files: nothing is asked
        require_shared_paths(settings_factory(tmp_path), [WorkerPath("b", "x", str(tmp_path / "nowhere.npy"))])


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="BLAS on every CPU oversubscribes only with 2 or more")
def test_workers_oversubscribing_blas_or_trimming_malloc_or_not_answering_are_noted(settings_factory, tmp_path,
                                                                                   free_port):
    """Workers started without a nanny run OpenBLAS with a thread per core in every task, and
    Dask's nanny sets MALLOC_TRIM_THRESHOLD_ (tensor fits 2-3x slower): neither was checked (an
    infra trial). Two single-threaded workers with BLAS on every CPU oversubscribe this host. A
    stopped worker timed the whole check out, said as "did not answer as a Dask scheduler" (a
    trial): it is named, and the others are still checked."""
    import signal

    from paperline.infra.cluster import WorkerPath, require_scheduler, require_shared_paths, worker_setup_notes

    import paperline

    cpus = str(len(os.sched_getaffinity(0)))
    blas_all = {"OMP_NUM_THREADS": cpus, "OPENBLAS_NUM_THREADS": cpus, "MKL_NUM_THREADS": cpus}
    one = {"OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    # w3 imports another checkout (this one's files linked, deployments/ changed): it passed every
    # check (a trial)
    root, other = os.path.dirname(paperline.__file__), tmp_path / "other" / "paperline"
    other.mkdir(parents=True)
    for entry in os.listdir(root):
        if entry not in (".git", ".venv", "deployments"):
            (other / entry).symlink_to(os.path.join(root, entry))
    (other / "deployments").mkdir()
    for name in os.listdir(os.path.join(root, "deployments")):
        if name.endswith(".py"):
            text = open(os.path.join(root, "deployments", name)).read()
            (other / "deployments" / name).write_text(text + ("\n# another checkout\n" if name == "__init__.py" else ""))
    workers = [([], blas_all), ([], {**blas_all, "MALLOC_TRIM_THRESHOLD_": "65536"}), ([], one),
               ([], {**one, "PYTHONPATH": str(tmp_path / "other")})]
    with _scheduler_and_workers(free_port(), workers) as (address, procs):
        settings = settings_factory(tmp_path, dask_scheduler_address=address)
        require_scheduler(settings, notes=[])  # warm: numpy, threadpoolctl and the code digest loaded (2 s below)
        procs[2].send_signal(signal.SIGSTOP)
        try:
            notes: list[str] = []
            assert require_scheduler(settings, timeout_s=2, notes=notes) == 4
            (tmp_path / "x.npy").write_bytes(b"x")
            require_shared_paths(settings, [WorkerPath("a", "x.npy", str(tmp_path / "x.npy"))], timeout_s=2)
        finally:
            procs[2].send_signal(signal.SIGCONT)
    w = r"w{} at tcp://127\.0\.0\.1:\d+"
    expected = [
        rf"Dask workers on 127\.0\.0\.1: BLAS calls use up to {cpus} threads each in 2 of its 3 worker\(s\) "
        rf"\({w.format(0)}; {w.format(1)}\), {2 * int(cpus) + 1} threads on {cpus} CPU\(s\) in all: start them with "
        r"one BLAS thread per task \(a nanny sets OMP_NUM_THREADS=1; without one, set OMP_NUM_THREADS=1 "
        r"OPENBLAS_NUM_THREADS=1 MKL_NUM_THREADS=1 in their environment\)",
        rf"Dask workers on 127\.0\.0\.1: 1 of 3 run with Dask's MALLOC_TRIM_THRESHOLD_ \({w.format(1)}; NumPy-heavy "
        r"tasks ran 2-3x slower with it\): start them with --preload-nanny paperline\.infra\.nanny_env",
        rf"1 of the 4 Dask worker\(s\) run other paperline code than this process \({w.format(3)}: "
        rf"{re.escape(str(other))}; here: {re.escape(root)}\): install the same paperline there, or results may "
        r"differ from this checkout's",
        rf"1 of the 4 Dask worker\(s\) did not answer within 2 s \({w.format(2)}\): stopped, stuck or busy; tasks "
        r"sent to them wait until they answer"]
    assert len(notes) == 4 and all(re.fullmatch(e, n) for e, n in zip(expected, notes)), notes
    # an older paperline on a worker lacks the check's function: other code, not "cannot import paperline" (a review)
    from paperline.infra.cluster import _cannot_import

    assert _cannot_import(ModuleNotFoundError("No module named 'paperline'"))
    assert not _cannot_import(AttributeError("Can't get attribute '_worker_setup' on <module 'paperline.infra.cluster'>"))
    assert not _cannot_import({"cpus": 2})
    # one BLAS thread per task on each host, no trimming: nothing to say; hosts are counted apart
    fine = {"cpus": 4, "blas_threads": 1, "nthreads": 2, "malloc_trim": False}
    assert worker_setup_notes({"tcp://10.0.0.1:1": fine, "tcp://10.0.0.1:2": fine,
                               "tls://10.0.0.2:1": {**fine, "blas_threads": 4, "nthreads": 1}}) == []
    # more task threads than CPUs, each single-threaded: said as that, not as BLAS (a trial)
    assert worker_setup_notes({f"tcp://10.0.0.1:{i}": fine for i in range(3)}) == [
        "Dask workers on 10.0.0.1: 3 worker(s) run 6 task threads on 4 CPU(s) (tcp://10.0.0.1:0; tcp://10.0.0.1:1; "
        "tcp://10.0.0.1:2): tasks share CPUs, and timings come out lower than the CPUs allow; start at most 4 "
        "single-threaded workers there (dask worker --nworkers 4 --nthreads 1)"]


def test_an_address_that_is_no_scheduler_is_said_to_be_one(settings_factory, tmp_path):
    """The dashboard's port as the scheduler address said only "cannot connect (TimeoutError:
    TimeoutError)" (a trial): a port that takes the connection and does not answer as a scheduler
    is said to be something else."""
    import socket

    from paperline.infra.cluster import require_scheduler
    from paperline.infra.errors import ServiceError

    silent = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        address = f"tcp://127.0.0.1:{silent.getsockname()[1]}"
        t0 = time.monotonic()
        with pytest.raises(ServiceError, match=r"cannot connect \(TimeoutError: no answer within 1 s\); something "
                                               "accepts connections there but did not answer as a Dask scheduler "
                                               r"\(the dashboard's port, or another server\?\)"):
            require_scheduler(settings_factory(tmp_path, dask_scheduler_address=address), timeout_s=1.0)
        # in about its timeout (a trial's 5-s check of such a port took 20 s: Dask's handshake
        # waited out the caller's whole deadline)
        assert time.monotonic() - t0 < 6
    finally:
        silent.close()
