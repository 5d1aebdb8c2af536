"""A run's watch on its stack's server processes (``infra/watch.py``) and the clients that fail at
once on a server it found gone. The "servers" here are real processes (``sleep``) recorded in a
``stack.json`` as `paperline up` records its servers, then killed."""

import http.server
import math
import os
import subprocess
import sys
import threading
import time

import pytest

from paperline.infra import watch
from paperline.infra.errors import ServiceError
from paperline.infra.stack import _record, _write_state, dead_servers


@pytest.fixture
def recorded(settings_factory, tmp_path):
    """``(settings, start)``: ``start(name)`` runs a process recorded as the stack's server ``name``."""
    settings = settings_factory(tmp_path / "state")
    settings.state_dir.mkdir(parents=True)
    procs: list[subprocess.Popen] = []
    services: dict[str, dict] = {}

    def start(name: str) -> subprocess.Popen:
        proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
        procs.append(proc)
        services[name] = _record(proc, "http://127.0.0.1:1", tmp_path / f"{name}.log")
        _write_state(settings, {"version": 1, "services": services})
        return proc

    yield settings, start
    for proc in procs:
        proc.kill()
        proc.wait()


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait()  # reaped: gone, not a zombie


def test_dead_servers_are_the_recorded_processes_that_are_gone(recorded):
    settings, start = recorded
    start("s3")
    mlflow = start("mlflow")
    assert dead_servers(settings) == {}
    _kill(mlflow)
    dead = dead_servers(settings)
    assert list(dead) == ["mlflow"] and dead["mlflow"]["pid"] == mlflow.pid
    (settings.state_dir / "stack.json").unlink()  # `paperline down` deletes it: nothing is "dead"
    assert dead_servers(settings) == {}


def test_a_server_gone_for_the_grace_stops_the_run_once_and_clients_fail_at_once(recorded):
    settings, start = recorded
    start("s3")
    mlflow = start("mlflow")
    called: list[dict] = []
    first: list[bool] = []
    with watch.ServerWatch(settings, called.append, grace_s=1.0, poll_s=0.1, on_gone=lambda: first.append(True)) as w:
        time.sleep(0.5)
        assert not called and watch.down_reason("mlflow") is None
        _kill(mlflow)
        deadline = time.monotonic() + 10
        while not called and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(called) == 1 and list(called[0]) == ["mlflow"] and w.dead == called[0]
        assert watch.down_reason("mlflow") == f"its server (pid {mlflow.pid}) died during the run; `paperline up` " \
                                              "starts it again"
        assert watch.down_reason("s3") is None
        # a client of the dead server fails without a request (MLflow's retries held a run ~30 s a call)
        from paperline.infra.tracking import Tracker

        with pytest.raises(ServiceError, match=r"mlflow is not available at http://127.0.0.1:1: its server \(pid \d+\) died"):
            Tracker("http://127.0.0.1:1").end_run("0" * 32, "KILLED")
        time.sleep(0.3)
        assert len(called) == 1 and first == [True]  # once
    assert watch.down_reason("mlflow") is None  # unmarked as the run's watch ends


def test_a_server_restarted_within_the_grace_does_not_stop_the_run(recorded):
    """`paperline up` during the grace records a new process: the run goes on against it."""
    settings, start = recorded
    prefect = start("prefect")
    called: list[dict] = []
    with watch.ServerWatch(settings, called.append, grace_s=1.5, poll_s=0.1):
        _kill(prefect)
        deadline = time.monotonic() + 5
        while watch.down_reason("prefect") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert watch.down_reason("prefect") is not None  # failing fast while it is gone
        start("prefect")  # (as `paperline up` records the server it restarted)
        time.sleep(2.5)
        assert not called and watch.down_reason("prefect") is None


def test_what_is_not_a_death(recorded, tmp_path):
    """Not dead: a service left out of the watched ones (a configured endpoint shadowing a stale
    local record), a record whose URL still accepts connections (MLflow's uvicorn child serving on
    after its recorded parent was killed), and anything while an `up` or `down` holds the stack's
    lock (`down` stops the servers, then deletes stack.json: seconds in between)."""
    import fcntl
    import socket

    from paperline.infra.stack import _read_state, stack_lock_busy

    settings, start = recorded
    _kill(start("mlflow"))
    _kill(start("s3"))
    assert list(dead_servers(settings)) == ["s3", "mlflow"]
    assert list(dead_servers(settings, ("s3", "prefect"))) == ["s3"]
    listener = socket.create_server(("127.0.0.1", 0))
    state = _read_state(settings)
    state["services"]["mlflow"]["url"] = f"http://127.0.0.1:{listener.getsockname()[1]}"
    _write_state(settings, state)
    try:
        assert list(dead_servers(settings)) == ["s3"]
    finally:
        listener.close()
    assert list(dead_servers(settings)) == ["s3", "mlflow"]
    with open(settings.state_dir / ".stack.lock", "a+") as held:  # (as `up` and `down` take it)
        fcntl.flock(held, fcntl.LOCK_EX)
        assert stack_lock_busy(settings) and dead_servers(settings) == {}
        called: list[dict] = []
        with watch.ServerWatch(settings, called.append, grace_s=0.3, poll_s=0.1):
            time.sleep(1.0)
            assert not called and watch.down_reason("s3") is None
    assert not stack_lock_busy(settings)


def test_servers_paperline_down_stopped_under_a_run_are_gone_too(recorded):
    """`down` under a run deletes stack.json: the run went on failing on retries for 84 s (a
    trial). The servers recorded when the watch began, gone and no longer recorded, count as
    gone, said as stopped; an `up` recording new ones ends that."""
    settings, start = recorded
    prefect = start("prefect")
    called: list[dict] = []
    with watch.ServerWatch(settings, called.append, grace_s=1.0, poll_s=0.1):
        _kill(prefect)
        (settings.state_dir / "stack.json").unlink()  # (as `down` does after stopping them)
        deadline = time.monotonic() + 10
        while not called and time.monotonic() < deadline:
            time.sleep(0.05)
        assert called and called[0]["prefect"]["stopped"] and called[0]["prefect"]["pid"] == prefect.pid
        assert watch.down_reason("prefect") == f"its server (pid {prefect.pid}) was stopped during the run " \
                                               "(`paperline down`); `paperline up` starts it again"
    start("prefect")  # `up`: recorded anew, not gone
    assert dead_servers(settings, earlier={"prefect": {"pid": prefect.pid, "url": "http://127.0.0.1:1"}}) == {}


def test_a_server_down_stops_after_an_up_is_named_by_its_own_pid(recorded):
    """A serve watching across a kill, an `up` and a `down` named the server killed first, not the
    one `down` stopped (a trial): the watch goes by the latest records."""
    settings, start = recorded
    first = start("prefect")
    with watch.ServerWatch(settings, lambda dead: None, grace_s=math.inf, poll_s=0.05):
        _kill(first)
        assert _wait_for(lambda: watch.down_reason("prefect") is not None)
        second = start("prefect")  # `up`
        assert _wait_for(lambda: watch.down_reason("prefect") is None)
        _kill(second)
        (settings.state_dir / "stack.json").unlink()  # `down`
        assert _wait_for(lambda: watch.down_reason("prefect") is not None)
        assert watch.down_reason("prefect").startswith(f"its server (pid {second.pid}) was stopped during the run")


def test_marks_an_earlier_watch_left_are_cleared_by_the_next(recorded, monkeypatch):
    settings, _ = recorded
    monkeypatch.setitem(watch._DOWN, "mlflow", "its server (pid 7) died during the run; `paperline up` starts it again")  # (an exit interrupted)
    with watch.ServerWatch(settings, lambda dead: None, poll_s=0.1):
        assert watch.down_reason("mlflow") is None


def test_an_inactive_watch_watches_nothing(recorded):
    settings, start = recorded
    _kill(start("s3"))
    called: list[dict] = []
    with watch.ServerWatch(settings, called.append, grace_s=0.1, poll_s=0.05, active=False) as w:
        time.sleep(0.5)
    assert not called and watch.down_reason("s3") is None
    assert list(w.gone_now()) == ["s3"]  # what an error can still name


def test_an_object_store_fails_at_once_on_a_server_found_gone(monkeypatch, tmp_path):
    from paperline.infra.storage import ObjectStore

    monkeypatch.setitem(watch._DOWN, "s3", "its server (pid 7) died during the run; `paperline up` starts it again")
    store = ObjectStore("http://127.0.0.1:1", "k", "s", log_path=str(tmp_path / "s3.log"))
    with pytest.raises(ServiceError, match=r"s3 is not available at http://127.0.0.1:1: put s3://b/k: its server "
                                           r"\(pid 7\) died during the run.*s3.log"):
        store.put_bytes_to(b"x", "s3://b/k")


def test_prefects_result_write_fails_at_once_on_s3_found_gone(monkeypatch):
    from prefect_aws import S3Bucket

    from paperline.infra import prefect_patches

    prefect_patches.install_result_write_check()
    prefect_patches.install_result_write_check()  # idempotent: wrapped once
    assert not getattr(S3Bucket._write_sync.__wrapped__, "_paperline_checked", False)
    monkeypatch.setitem(watch._DOWN, "s3", "its server (pid 7) died during the run; `paperline up` starts it again")
    with pytest.raises(ServiceError, match=r"write s3://results/k1: its server \(pid 7\) died"):
        S3Bucket(bucket_name="results").write_path("k1", b"x")


def test_prefects_client_sends_once_to_a_server_found_gone(monkeypatch):
    """Prefect's client retried the dead server's final state report ~20 s (a trial)."""
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from paperline.infra import prefect_patches

    prefect_patches.install()
    seen: list[str] = []

    class Unavailable(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802
            seen.append(self.path)
            self.send_response(503)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Unavailable)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        api = f"http://127.0.0.1:{server.server_address[1]}/api"
        with temporary_settings({PREFECT_API_URL: api, PREFECT_CLIENT_MAX_RETRIES: 1}):
            with get_client(sync_client=True) as client:
                with pytest.raises(Exception, match="503"):
                    client.hello()
                assert len(seen) == 2  # Prefect's own: one retry (of one allowed here)
                seen.clear()
                monkeypatch.setitem(watch._DOWN, "prefect", "its server (pid 7) died during the run; `paperline up` starts it again")
                with pytest.raises(Exception, match="503"):
                    client.hello()
                assert len(seen) == 1
    finally:
        server.shutdown()
        server.server_close()  # (its port refuses connections from here on)
    # a connection error says why (a served run ended on a bare "ConnectError('[Errno 111] ...')": a trial)
    import asyncio

    import httpx

    with temporary_settings({PREFECT_API_URL: api}):
        with get_client(sync_client=True) as client, pytest.raises(httpx.ConnectError) as refused:
            client.hello()
        assert str(refused.value).endswith(" (prefect: its server (pid 7) died during the run; `paperline up` "
                                           "starts it again)"), refused.value

        async def hello() -> None:
            async with get_client() as aclient:
                await aclient.hello()

        with pytest.raises(httpx.ConnectError, match=r"\(prefect: its server \(pid 7\) died during the run"):
            asyncio.run(hello())


def test_a_log_batch_prefect_did_not_take_is_one_line_of_its_own(monkeypatch, capsys, free_port):
    """Prefect wrote "--- Error logging to API ---" and the error without a line end (the next
    line, a results table's title, was glued onto it) from every process, for every batch."""
    import asyncio
    import types

    from prefect.client.orchestration import get_client
    from prefect.logging.handlers import APILogWorker
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    from paperline.infra import prefect_patches

    prefect_patches.install()
    monkeypatch.setitem(prefect_patches._LOG_BATCH_SAID, "at", -float("inf"))

    async def send_batches(n: int) -> None:
        async with get_client() as client:
            for _ in range(n):
                await APILogWorker._handle_batch(types.SimpleNamespace(_client=client), [b'{"message": "x"}'])

    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api", PREFECT_CLIENT_MAX_RETRIES: 0}):
        asyncio.run(send_batches(3))
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith("paperline: the Prefect server did not take a batch of 1 log "
                                                        "line(s) (ConnectError: "), err
        assert "Error logging to API" not in err and err.endswith("(the next failures for 10 minutes are not shown)\n")
        monkeypatch.setitem(prefect_patches._LOG_BATCH_SAID, "at", -float("inf"))
        monkeypatch.setitem(watch._DOWN, "prefect", "its server (pid 7) died during the run; `paperline up` starts it again")
        asyncio.run(send_batches(1))
        assert capsys.readouterr().err == ""  # the run's own error says it


def _wait_for(condition, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.05)
    return condition()


def test_a_flow_run_outside_paperline_run_fails_at_once_on_a_dead_server_until_up_records_a_new_one(
        recorded, monkeypatch):
    """A deployment's run under `paperline serve` retried its dead servers ~100 s (a trial):
    ``flow_run_watch`` marks them, stops nothing, and a nested call adds no second watch."""
    settings, start = recorded
    monkeypatch.delenv("PREFECT__FLOW_RUN_ID", raising=False)
    start("s3")
    mlflow = start("mlflow")
    with watch.flow_run_watch(settings):
        assert len(watch._ACTIVE) == 1
        with watch.flow_run_watch(settings):  # (a `paperline run` watch, or a worker's, already watches)
            assert len(watch._ACTIVE) == 1
        _kill(mlflow)
        assert _wait_for(lambda: watch.down_reason("mlflow") is not None)
        assert watch.down_reason("mlflow") == f"its server (pid {mlflow.pid}) died during the run; `paperline up` " \
                                              "starts it again"
        assert watch.down_reason("s3") is None
        start("mlflow")  # `paperline up` records a new server: calls go through again
        assert _wait_for(lambda: watch.down_reason("mlflow") is None)
    assert watch._ACTIVE == []


def test_a_process_started_for_one_deployment_run_is_watched_to_its_end(recorded, monkeypatch):
    """Prefect's engine writes the run's result and final state after the flow's function
    returned: in a process started for the run (``PREFECT__FLOW_RUN_ID``) the watch goes on."""
    settings, start = recorded
    prefect = start("prefect")
    monkeypatch.setenv("PREFECT__FLOW_RUN_ID", "0b6b4d0c-0000-0000-0000-000000000000")
    quieted = []  # (its excepthook and log filter are the run process's own: not installed in pytest's)
    monkeypatch.setattr(watch, "quiet_outage_tracebacks", lambda: quieted.append(True))
    with watch.flow_run_watch(settings):
        pass
    assert quieted == [True]
    try:
        assert len(watch._ACTIVE) == 1
        _kill(prefect)
        assert _wait_for(lambda: watch.down_reason("prefect") is not None)
    finally:
        for w in list(watch._ACTIVE):
            w.__exit__(None, None, None)
    assert watch._ACTIVE == [] and watch.down_reason("prefect") is None


def test_only_the_managed_servers_are_watched(settings_factory, tmp_path):
    """A configured endpoint is not the local stack's: a stale local record of it is not watched."""
    settings = settings_factory(tmp_path / "state", s3_endpoint_url="http://127.0.0.1:9",
                                s3_access_key_id="k", s3_secret_access_key="s")
    assert watch.marking_watch(settings).services == ("prefect", "mlflow")
    assert watch.marking_watch(settings_factory(tmp_path / "s2"), during="while serving").services == \
        ("s3", "prefect", "mlflow")


def test_a_local_dask_worker_marks_a_dead_server_for_its_tasks(recorded, monkeypatch):
    """Tasks on the workers retried a dead S3 ~10 s a result commit (a trial): each local worker
    watches from its preload (``infra/worker_watch.py``)."""
    from distributed import Client, LocalCluster

    from paperline.infra.cluster import _local_cpu_kwargs
    from paperline.infra.settings import Settings

    settings, start = recorded
    s3 = start("s3")
    monkeypatch.setenv("PAPERLINE_STATE_DIR", str(settings.state_dir))  # (the workers read their settings)
    for name in ("PAPERLINE_S3_ENDPOINT_URL", "PAPERLINE_PREFECT_API_URL", "PAPERLINE_MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(name, raising=False)

    def reason_within(seconds: float) -> str | None:
        from paperline.infra.watch import down_reason

        deadline = time.monotonic() + seconds
        while down_reason("s3") is None and time.monotonic() < deadline:
            time.sleep(0.05)
        return down_reason("s3")

    kwargs = {**_local_cpu_kwargs(Settings(n_workers=1)), "dashboard_address": None}
    with LocalCluster(**kwargs) as cluster, Client(cluster) as client:
        client.wait_for_workers(1)
        assert client.submit(reason_within, 0.5, pure=False).result() is None
        _kill(s3)
        assert client.submit(reason_within, 10.0, pure=False).result() == \
            f"its server (pid {s3.pid}) died during the run; `paperline up` starts it again"


def test_a_server_an_up_restarted_is_said_back_however_short_its_outage(recorded):
    """A serve's claimed run was lost when Prefect was killed and `up` restarted it within a poll
    of serve's (a trial): the watch calls ``on_back`` with when the server was first found gone."""
    import datetime

    settings, start = recorded
    first = start("prefect")
    back: list[dict] = []
    with watch.ServerWatch(settings, lambda dead: None, grace_s=math.inf, poll_s=0.05, on_back=back.append):
        before = datetime.datetime.now(datetime.timezone.utc)
        _kill(first)
        assert _wait_for(lambda: watch.down_reason("prefect") is not None)
        assert back == []
        start("prefect")  # `up`
        assert _wait_for(lambda: back)
        time.sleep(0.3)
    assert len(back) == 1 and list(back[0]) == ["prefect"] and before <= back[0]["prefect"]


def test_an_outage_error_is_a_failed_connection_or_raised_from_one(monkeypatch):
    """Not an error raised while one was being handled (a bug in the handling, said in full)."""
    import httpx

    def raised(fn):
        try:
            fn()
        except Exception as exc:  # noqa: BLE001
            return exc

    def refused():
        try:
            raise ConnectionRefusedError(111, "Connection refused")
        except ConnectionRefusedError as exc:
            raise httpx.ConnectError("All connection attempts failed") from exc

    def wrapped():
        try:
            refused()
        except httpx.ConnectError as exc:
            raise RuntimeError("the call failed") from exc

    def buggy():
        try:
            refused()
        except httpx.ConnectError:
            return {}["missing"]

    def hidden():
        try:
            refused()
        except httpx.ConnectError:
            raise ValueError("another thing") from None

    errors = {name: raised(fn) for name, fn in (("refused", refused), ("wrapped", wrapped), ("buggy", buggy),
                                                 ("hidden", hidden))}
    assert not any(watch.outage_error(e) for e in errors.values())  # nothing known to be gone
    monkeypatch.setitem(watch._DOWN, "prefect", "its server (pid 7) died during the run")
    assert {name: watch.outage_error(e) for name, e in errors.items()} == {
        "refused": True, "wrapped": True, "buggy": False, "hidden": False}
    assert watch.outage_error(ConnectionResetError()) and not watch.outage_error(None)


_OUTAGE_RUN = r"""
import logging, sys
import httpx
from prefect.logging.configuration import setup_logging
from paperline.infra import watch

setup_logging()
watch.quiet_outage_tracebacks()
watch.quiet_outage_tracebacks()  # idempotent
log = logging.getLogger("prefect.engine")
from websockets.exceptions import ConnectionClosedError
try:  # (the server killed: its observers' websockets close before the watch has seen it gone)
    raise ConnectionClosedError(None, None)
except ConnectionClosedError:
    logging.getLogger("prefect.FlowRunSuspendingObserver").warning("The websocket failed", exc_info=True)
logging.getLogger("prefect.flow_runs").error("Finished in state Running()")  # (a cancelled run's: left off)

def refused():
    try:
        raise ConnectionRefusedError(111, "Connection refused")
    except ConnectionRefusedError as exc:
        raise httpx.ConnectError("[Errno 111] Connection refused (prefect: its server (pid 7) died)") from exc

for marked in (False, True):
    if marked:
        watch._DOWN["prefect"] = "its server (pid 7) died during the run"
    try:
        refused()
    except httpx.ConnectError:
        log.error("Execution exited with unexpected exception (marked=%s)", marked, exc_info=True)
    try:
        raise ValueError("a fault of its own")
    except ValueError:
        log.error("a bug (marked=%s)", marked, exc_info=True)
sys.stdout.flush()
if sys.argv[1] == "outage":
    refused()
raise ValueError("the last error")
"""


@pytest.mark.parametrize("last", ["outage", "other"])
def test_a_deployment_runs_process_says_an_outage_in_one_line(last):
    """In a served run's process, Prefect printed a ConnectError to its dead server three times
    with its traceback (~200 lines, a trial): once the watch knows the server is gone, the records
    and the error the process ends on are their one line; other errors keep their traceback, and
    so does a connection error before anything is known to be gone."""
    out = subprocess.run([sys.executable, "-c", _OUTAGE_RUN, last], capture_output=True, text=True, timeout=120,
                         env={k: v for k, v in os.environ.items() if k != "PAPERLINE_DEBUG"})
    text = out.stdout + out.stderr
    assert out.returncode == 1, text
    warned, *blocks = text.split("| ERROR   | ")
    assert "The websocket failed" in warned and "Traceback" not in warned, text
    assert "Finished in state Running()" not in text, text
    assert "websockets.exceptions.ConnectionClosedError: " in warned, text
    assert [b.splitlines()[0].split(" - ", 1)[1] for b in blocks] == [
        "Execution exited with unexpected exception (marked=False)", "a bug (marked=False)",
        "Execution exited with unexpected exception (marked=True)", "a bug (marked=True)"], text
    tracebacks = ["Traceback (most recent call last)" in b for b in blocks]
    assert tracebacks[:4] == [True, True, False, True], text
    refused = "httpx.ConnectError: [Errno 111] Connection refused (prefect: its server (pid 7) died)"
    # the error's line instead of its traceback (then the next record's time)
    assert blocks[2].splitlines()[1:-1] == [refused], text
    end = blocks[-1].split("a bug (marked=True)", 1)[1]
    if last == "outage":
        assert "Traceback" not in end.split("ValueError: a fault of its own", 1)[1], end
        assert end.rstrip().endswith("\n" + refused), end
    else:
        assert end.rstrip().endswith("ValueError: the last error") and end.count("Traceback") == 2, end
