"""What `paperline serve` / `paperline worker` do with the flow runs they were executing when
stopped (infra/flow_runs.py), and the one-line log records of expected errors (infra/errors.py).
The end-to-end stops are in tests/flows/test_worker.py and test_serve.py."""

import datetime
import logging
import os
import subprocess
import sys
import uuid

import pytest

from paperline.infra.errors import ExpectedErrorOneLine, InputError, quiet_expected_tracebacks
from paperline.infra.flow_runs import (
    FLOW_RUN_ENV,
    crash_lost_runs,
    crash_unstarted_runs,
    deployment_report,
    deployment_status,
    executing_report,
    flow_run_processes,
    serve_lock_holder,
    watch_flow_runs,
)

# a process that names a flow run in its environment and starts a child that inherits it (as a
# flow run's engine process starts its Dask workers), then waits for its stdin to close
_ENGINE = ("import subprocess, sys; c = subprocess.Popen([sys.executable, '-c', 'import sys; sys.stdin.read()'], "
           "stdin=subprocess.PIPE); print(c.pid, flush=True); sys.stdin.read(); c.stdin.close(); c.wait()")


def _engine(run_id: str) -> tuple[subprocess.Popen, int]:
    proc = subprocess.Popen([sys.executable, "-c", _ENGINE], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, FLOW_RUN_ENV: run_id})
    return proc, int(proc.stdout.readline())


def _until(condition, timeout_s: float = 30.0) -> None:
    import time

    deadline = time.time() + timeout_s
    while not condition() and time.time() < deadline:
        time.sleep(0.05)


def _stop(proc: subprocess.Popen) -> None:
    proc.stdin.close()
    proc.wait(timeout=30)


def test_flow_run_processes_names_each_runs_topmost_process():
    run_a, run_b = str(uuid.uuid4()), str(uuid.uuid4())
    (a, a_child), (b, _) = _engine(run_a), _engine(run_b)
    plain = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        seen = flow_run_processes(os.getpid())
        assert {k: v for k, v in seen.items() if k in (run_a, run_b)} == {run_a: a.pid, run_b: b.pid}
        assert a_child not in seen.values() and plain.pid not in seen.values()
    finally:
        for p in (a, b):
            _stop(p)
        plain.stdin.close()
        plain.wait(timeout=30)
    assert flow_run_processes(2**22 + 12345) == {}  # no such process


def test_watch_records_runs_while_it_serves_and_reports_the_lost_ones(monkeypatch):
    """The watch's thread sees a run's process appear; after it has ended, leaving the watch
    hands exactly that run to crash_lost_runs (a server is not needed to see what it was given)."""
    import paperline.infra.flow_runs as fr

    given = {}
    monkeypatch.setattr(fr, "crash_lost_runs", lambda seen, who, report=None: (given.update(seen), ([], []))[1])
    run_id = str(uuid.uuid4())
    with watch_flow_runs("paperline worker", interval_s=0.1) as seen:
        proc, _ = _engine(run_id)
        _until(lambda: run_id in seen)
        _stop(proc)
    assert given == {run_id: proc.pid}
    # a run that ended longer than recent_s before the stop is not the stop's doing: forgotten
    given.clear()
    with watch_flow_runs("paperline worker", interval_s=0.1, recent_s=0.5) as seen:
        proc, _ = _engine(run_id)
        _until(lambda: run_id in seen)
        _stop(proc)
        _until(lambda: run_id not in seen)
    assert given == {} and seen == {}


def test_watch_ends_the_mlflow_runs_of_a_run_whose_process_ended(monkeypatch):
    """With a tracking URI, a run's process that ends while serving has its MLflow runs looked at
    on a thread of their own (its flow run may be marked Crashed a moment later); the runs the stop
    marked Crashed are looked at once, before the watch is left."""
    import threading
    import time

    import paperline.infra.flow_runs as fr
    import paperline.infra.tracking as tracking

    calls: list[tuple[list[str], str, dict]] = []
    called = threading.Event()

    def fake_end(run_ids, uri, **kwargs):
        calls.append((list(run_ids), uri, kwargs))
        called.set()
        return []

    monkeypatch.setattr(tracking, "end_runs_of_ended_flow_runs", fake_end)
    stopped_run = str(uuid.uuid4())
    monkeypatch.setattr(fr, "crash_lost_runs", lambda seen, who, report=None: ([stopped_run], []))
    run_id = str(uuid.uuid4())
    with watch_flow_runs("paperline serve", interval_s=0.1, tracking_uri="http://127.0.0.1:1") as seen:
        proc, _ = _engine(run_id)
        _until(lambda: run_id in seen)
        assert not called.is_set()  # executing: nothing to end
        _stop(proc)
        assert called.wait(30)
        assert [c for c in calls if run_id in c[0]] == [([run_id], "http://127.0.0.1:1", {"report": None})]
    # on leaving: the runs the stop marked Crashed, and those lately seen whose process has ended
    assert calls[-1] == (sorted([run_id, stopped_run]), "http://127.0.0.1:1", {"report": None, "waits_s": (0.0,)})
    # without a tracking URI (a test, a client with no MLflow) nothing is looked at
    calls.clear()
    with watch_flow_runs("paperline serve", interval_s=0.1) as seen:
        proc, _ = _engine(run_id)
        _until(lambda: run_id in seen)
        _stop(proc)
        time.sleep(0.5)
    assert calls == []


def _flow_run(client, state):
    from prefect import flow

    @flow(name="paperline-test-flow-runs-probe")
    def probe() -> None:
        """Never executed: its runs only carry states."""

    run = client.create_flow_run(probe)
    client.set_flow_run_state(run.id, state, force=True)
    return run


def test_crash_lost_runs_says_what_it_could_not_check(free_port):
    """With the server unreachable (or refusing the login) it said "could not mark the
    interrupted flow runs Crashed" of a run that had ended minutes before (a trial)."""
    from prefect.settings import PREFECT_API_URL, PREFECT_CLIENT_MAX_RETRIES, temporary_settings

    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    lines: list[str] = []
    with temporary_settings({PREFECT_API_URL: f"http://127.0.0.1:{free_port()}/api", PREFECT_CLIENT_MAX_RETRIES: 0}):
        assert crash_lost_runs({str(uuid.uuid4()): proc.pid}, "paperline worker", report=lines.append) == ([], [])
    assert len(lines) == 1 and lines[0].startswith("could not check whether the 1 flow run(s) it executed lately "
                                                   "ended (ConnectError: "), lines
    assert lines[0].endswith("one left Running is marked Crashed by the server's automation, once the server is "
                             "up, when its heartbeats have stopped"), lines


@pytest.mark.stack
def test_the_mlflow_runs_an_ended_flow_run_left_running_are_ended(stack):
    """What serve and worker do once a run's process has ended: its MLflow runs (parent and
    child) still RUNNING end KILLED when its flow run crashed, FAILED when it failed; a flow run
    still Running keeps its runs RUNNING (tried again after the next wait), and runs of other
    flow runs are not touched."""
    from prefect.client.orchestration import get_client
    from prefect.states import Crashed, Failed, Running

    from paperline.infra.tracking import Tracker, end_runs_of_ended_flow_runs

    tracker = Tracker(stack[1].mlflow_tracking_uri)
    experiment = f"flow-runs-test-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        crashed, failed, running, other = (_flow_run(client, s) for s in (Crashed(), Failed(), Running(), Crashed()))
    mlflow_runs = {}
    for name, flow_run in (("crashed", crashed), ("failed", failed), ("running", running), ("other", other)):
        tags = {"prefect.flow_run_id": str(flow_run.id)}
        parent = tracker.start_run(experiment, run_name=name, tags=tags)
        mlflow_runs[name] = (parent, tracker.start_run(experiment, run_name=f"{name}-child", tags=tags,
                                                       parent_run_id=parent))
    lines: list[str] = []
    ids = [str(crashed.id), str(failed.id), str(running.id)]
    ended = end_runs_of_ended_flow_runs(ids, stack[1].mlflow_tracking_uri, waits_s=(0.0, 0.1), report=lines.append)
    assert sorted(ended) == sorted([*mlflow_runs["crashed"], *mlflow_runs["failed"]])
    status = {name: [tracker.get_run(r).info.status for r in runs] for name, runs in mlflow_runs.items()}
    assert status == {"crashed": ["KILLED"] * 2, "failed": ["FAILED"] * 2, "running": ["RUNNING"] * 2,
                      "other": ["RUNNING"] * 2}
    assert tracker.get_run(mlflow_runs["crashed"][0]).data.tags["paperline.ended_by"] == "Prefect flow run Crashed"
    assert lines == [f"flow run {crashed.id} ended Crashed with its process: 2 MLflow run(s) it left RUNNING marked "
                     "KILLED", f"flow run {failed.id} ended Failed with its process: 2 MLflow run(s) it left RUNNING "
                     "marked FAILED"], lines
    # nothing left to end: no line
    assert end_runs_of_ended_flow_runs([str(crashed.id)], stack[1].mlflow_tracking_uri, waits_s=(0.0,),
                                       report=lines.append) == [] and len(lines) == 2
    # MLflow away: nothing raised (it runs on a watch's thread)
    assert end_runs_of_ended_flow_runs([str(running.id)], "http://127.0.0.1:9", waits_s=(0.0,)) == []


@pytest.mark.stack
def test_a_run_whose_process_is_gone_is_ended_before_prefect_marks_it_crashed(stack):
    """`kill -9` of `paperline run`: its MLflow run stayed RUNNING until Prefect marked the flow run
    Crashed (~90 s without heartbeats), and a run started meanwhile did not end it (an infra trial).
    The run's process (tag paperline.process, pid@host) gone from this host ends it KILLED at the
    next sweep; a live process's, another host's or an untagged run is left to Prefect."""
    import socket

    from prefect.client.orchestration import get_client
    from prefect.states import Running

    from paperline.infra.storage import this_machine
    from paperline.infra.tracking import PROCESS_TAG, Tracker, this_process

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    host, machine_id = this_machine()
    assert host == socket.gethostname() and this_process() == f"{os.getpid()}@{host}@{machine_id}"
    tracker = Tracker(stack[1].mlflow_tracking_uri)
    experiment = f"process-gone-test-{uuid.uuid4().hex[:8]}"
    runs = {}
    with get_client(sync_client=True) as client:
        # another machine: another host name, or the same one with another machine id (its PIDs
        # are unknown here, which is not their being gone)
        for name, process in (("gone", f"{dead.pid}@{host}@{machine_id}"), ("live", this_process()),
                              ("elsewhere", f"{dead.pid}@not-{host}@{machine_id}"),
                              ("twin", f"{dead.pid}@{host}@another-{machine_id}"), ("untagged", None)):
            flow_run = _flow_run(client, Running())
            tags = {"prefect.flow_run_id": str(flow_run.id), **({PROCESS_TAG: process} if process else {})}
            runs[name] = tracker.start_run(experiment, run_name=name, tags=tags)
    exp = tracker.client.get_experiment_by_name(experiment).experiment_id
    assert tracker.end_orphaned_runs([exp]) == [runs["gone"]]
    status = {name: tracker.get_run(r).info.status for name, r in runs.items()}
    assert status == {"gone": "KILLED", "live": "RUNNING", "elsewhere": "RUNNING", "twin": "RUNNING",
                      "untagged": "RUNNING"}
    assert tracker.get_run(runs["gone"]).data.tags["paperline.ended_by"] == (
        f"its process {dead.pid}@{host} ended without ending it (killed outright: kill -9, out of memory) while "
        "Prefect showed the flow run Running")


@pytest.mark.stack
def test_crash_lost_runs_crashes_only_unfinished_runs_whose_process_ended(stack):
    from prefect.client.orchestration import get_client
    from prefect.states import Completed, Pending, Running

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    alive, _ = _engine(str(uuid.uuid4()))
    lines: list[str] = []
    try:
        with get_client(sync_client=True) as client:
            lost, done, going = (_flow_run(client, s) for s in (Running(), Completed(), Running()))
            seen = {str(lost.id): dead.pid, str(done.id): dead.pid, str(going.id): alive.pid}
            crashed, still = crash_lost_runs(seen, "paperline worker", wait_s=0.5, report=lines.append)
            assert crashed == [str(lost.id)] and still == [str(going.id)]
            state = client.read_flow_run(lost.id).state
            assert state.name == "Crashed"
            assert state.message.startswith("`paperline worker` was stopped while this run was executing")
            assert client.read_flow_run(done.id).state.name == "Completed"
            assert client.read_flow_run(going.id).state.name == "Running"
            # after an outage of the Prefect server (`paperline serve`): said as what happened
            outage: list[str] = []
            pending = _flow_run(client, Pending(name="Submitting"))  # (the runner's claim)
            seen = {str(pending.id): dead.pid, str(going.id): alive.pid}
            why = "its process ended while the Prefect server was away"
            assert crash_lost_runs(seen, "paperline serve", wait_s=0.0, report=outage.append, why=why) == \
                ([str(pending.id)], [str(going.id)])
            assert client.read_flow_run(pending.id).state.message == \
                f"Its process ended while the Prefect server was away (pid {dead.pid}, `paperline serve`); its end " \
                "was not recorded."
            assert outage == [f"flow run {pending.name!r} ({pending.id}) marked Crashed: {why}"]  # (none "still executing")
    finally:
        _stop(alive)
    assert any("marked Crashed" in line and str(lost.id) in line for line in lines), lines
    assert any("still executing" in line and str(going.id) in line for line in lines), lines


@pytest.mark.stack
def test_crash_unstarted_runs_crashes_the_claimed_runs_of_the_served_deployments_only(stack):
    """A stopped serve's claimed-but-unstarted run (Pending, no process) is marked Crashed; a
    Pending run whose process is there, a Scheduled run and another deployment's Pending run are
    left as they are."""
    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.states import Pending, Scheduled

    @flow(name="paperline-test-unstarted-probe")
    def probe() -> None:
        """Never executed: its runs only carry states."""

    lines: list[str] = []
    with get_client(sync_client=True) as client:
        flow_id = client.create_flow(probe)
        served, other = (client.create_deployment(flow_id=flow_id, name=n) for n in ("served", "other"))
        claimed, starting, scheduled = (client.create_flow_run_from_deployment(served, state=s)
                                        for s in (Pending(), Pending(), Scheduled()))
        elsewhere = client.create_flow_run_from_deployment(other, state=Pending())
        crashed = crash_unstarted_runs(["paperline-test-unstarted-probe/served", "no-such-flow/local"],
                                       "paperline serve", executing={str(starting.id)}, report=lines.append)
        assert crashed == [str(claimed.id)]
        state = client.read_flow_run(claimed.id).state
        assert state.name == "Crashed" and state.message.startswith(
            "`paperline serve` was stopped after claiming this run, before its process started")
        assert [client.read_flow_run(r.id).state.name for r in (starting, scheduled, elsewhere)] == \
            ["Pending", "Scheduled", "Pending"]
        assert len(lines) == 1 and str(claimed.id) in lines[0], lines
        # once serve's Prefect server is back after an outage: a run claimed since is about to start
        began = client.read_flow_run(starting.id).state.timestamp + datetime.timedelta(milliseconds=1)
        since = client.create_flow_run_from_deployment(served, state=Pending())
        lines.clear()
        why = "it was claimed before the Prefect server went away, and no process of it runs now"
        assert crash_unstarted_runs(["paperline-test-unstarted-probe/served"], "paperline serve", report=lines.append,
                                    why=why, before=began) == [str(starting.id)]
        assert client.read_flow_run(starting.id).state.message == f"{why[0].upper()}{why[1:]} (`paperline serve`); " \
                                                                 "run it again."
        assert client.read_flow_run(since.id).state.name == "Pending"
        assert lines == [f"flow run {starting.name!r} ({starting.id}) marked Crashed: {why}"]


def _served(name, polled=None, paused=False):
    return {"name": name, "work_pool": None, "polled_s_ago": polled, "paused": paused}


def test_status_names_the_flow_runs_executing_longest_first():
    """`paperline status` said who would execute the runs, not what was running (a trial)."""
    assert executing_report([]) == ["flow runs executing: none"]
    runs = [{"flow": "gemm", "name": "copper-prawn", "deployment": "gemm/local", "state": "Running",
             "started_s_ago": 42.4},
            {"flow": "nas", "name": "calm-fox", "deployment": None, "state": "Running", "started_s_ago": 3 * 3600},
            {"flow": "gemm", "name": "odd-owl", "deployment": "gemm/gemm", "state": "Pending", "started_s_ago": None}]
    assert executing_report(runs) == [
        "flow runs executing: 3: nas 'calm-fox' (no deployment, Running, for 3.0 h); gemm 'copper-prawn' "
        "(gemm/local, Running, for 42 s); gemm 'odd-owl' (gemm/gemm, Pending)"]
    many = [{**runs[0], "name": f"r{i}", "started_s_ago": 60.0 * i} for i in range(8)]
    (line,) = executing_report(many)
    assert line.startswith("flow runs executing: 8: gemm 'r7' (gemm/local, Running, for 7 min); gemm 'r6'")
    assert line.endswith("gemm 'r3' (gemm/local, Running, for 3 min); and 3 more"), line


def test_next_run_report_says_when_and_in_how_long():
    """`status` named who serves the deployments, not when one would next run."""
    import datetime

    from paperline.infra.flow_runs import next_run_report

    assert next_run_report([]) == []
    at = datetime.datetime(2026, 12, 8, 3, 30, tzinfo=datetime.timezone(datetime.timedelta(hours=1)))
    assert next_run_report([{"deployment": "gemm/local", "seconds": 68040.0, "at": at}]) == [
        "next scheduled run: gemm/local at 2026-12-08 02:30 UTC (in 18.9 h)"]
    assert next_run_report([{"deployment": "nas/local", "seconds": 5.5 * 86400, "at": at}])[0].endswith("(in 5.5 d)")
    # the soonest that a process will take (the work pool's, no worker online, was named over the served
    # one's run at the same time: a trial); none taken: the soonest
    runs = [{"deployment": "gemm/gemm", "seconds": 60.0, "at": at}, {"deployment": "gemm/local", "seconds": 60.0, "at": at},
            {"deployment": "nas/local", "seconds": 30.0, "at": at}]
    assert next_run_report(runs, taken={"gemm/local"})[0].startswith("next scheduled run: gemm/local at ")
    assert next_run_report(runs, taken=set())[0].startswith("next scheduled run: nas/local at ")
    assert next_run_report(runs, taken=set())[0].endswith("(in 30 s); no process takes its runs now (above: what would)")
    assert "no process" not in next_run_report(runs, taken={"gemm/local"})[0]
    assert next_run_report(runs)[0].startswith("next scheduled run: nas/local at ")


def test_a_deployment_is_executed_by_its_serve_or_an_online_worker():
    from paperline.infra.flow_runs import POLLED_WITHIN_S, executed_now

    local, pooled = {"name": "gemm/local", "work_pool": None, "polled_s_ago": None}, {"name": "gemm/gemm", "work_pool": "p"}
    assert not executed_now(local, {}, serve_pid=None) and executed_now(local, {}, serve_pid=4242)
    assert executed_now({**local, "polled_s_ago": 5.0}, {}, None)  # another serving process polls it
    assert not executed_now({**local, "polled_s_ago": POLLED_WITHIN_S + 1}, {}, None)
    assert not executed_now(pooled, {}, serve_pid=4242)  # serve takes no work pool's runs
    assert executed_now(pooled, {"p": [{"heartbeat_s_ago": 3.0}]}, None)
    assert not executed_now(pooled, {"p": [{"heartbeat_s_ago": 3.0, "exited": True}, {"heartbeat_s_ago": None}]}, None)


def test_deployment_report_says_who_executes_the_runs_and_what_waits():
    """`paperline status` said nothing of serve or workers, so runs waited Scheduled unexplained."""
    assert deployment_report([], {}, {}) == [
        'deployments: none (`paperline serve`, or `prefect deploy --all` with `paperline worker`: README "Deployments")']
    assert deployment_report([], {}, {}, serve_pid=42) == ["deployments: `paperline serve` (pid 42) is starting"]
    local = [_served(f"{f}/local", polled=5.0) for f in ("a", "b")]
    assert deployment_report(local, {}, {}, serve_pid=42) == ["deployments: 2 served by `paperline serve` (pid 42)"]
    # one a serve stopped serving (its package uninstalled) stays paused: not counted as served (a trial)
    left = [*local, _served("gone/local", polled=900.0, paused=True)]
    assert deployment_report(left, {}, {}, serve_pid=42) == ["deployments: 2 served by `paperline serve` (pid 42)",
                                                             "paused deployments: gone/local"]
    # another host's serve: no lock here, but its polls are fresh
    assert deployment_report(local, {}, {"a/local": 2}) == [
        "deployments: 2 served by a serving process; 2 scheduled run(s) past their start time wait for it"]
    # a stopped serve pauses its deployments: a poll seconds old no longer means served
    stopped = [_served(f"{f}/local", polled=5.0, paused=True) for f in ("a", "b", "c", "d")]
    lines = deployment_report(stopped, {}, {"c/local": 1})
    assert lines == ["deployments: 4 without a work pool (a/local, b/local, c/local, ...), not served now and paused "
                     "(as a stopping `paperline serve` leaves them): their schedules make no runs, and a run triggered "
                     "now waits Scheduled until `paperline serve` runs, which unpauses those it paused itself; 1 "
                     "scheduled run(s) past their start time wait for it"], lines  # (no second line saying "paused" again)
    # paused in the Prefect UI while served: named apart, as the next serve keeps them paused (they were
    # said to be a stopping serve's, which would unpause them: a trial)
    kept = [dict(d, kept_paused=d["name"] in ("b/local", "d/local")) for d in stopped]
    assert deployment_report(kept, {}, {})[1:] == [
        "paused in the Prefect UI while served, and kept paused by `paperline serve`: b/local, d/local (their "
        "schedules make no runs; a run triggered while served executes)"]
    serving = [dict(d, paused=d["kept_paused"]) for d in kept]
    assert deployment_report(serving, {}, {}, serve_pid=42) == [
        "deployments: 4 served by `paperline serve` (pid 42)",
        "paused in the Prefect UI while served, and kept paused by `paperline serve`: b/local, d/local (their "
        "schedules make no runs; a run triggered while served executes)"]
    stopped[1]["schedule_paused"] = True  # paused in the UI: said apart from the deployments serve paused
    assert deployment_report(stopped, {}, {})[1] == "paused schedules (kept so by `paperline serve`): b/local"
    stopped[0].update(paused=False, polled_s_ago=None)  # one unpaused by hand: the others are named
    assert deployment_report(stopped, {}, {})[:2] == [
        "deployments: 4 without a work pool (a/local, b/local, c/local, ...), not served now: their runs wait "
        "Scheduled until `paperline serve` runs", "paused deployments: b/local, c/local, d/local"]
    assert deployment_report([_served("a/local", polled=91.0)], {}, {})[0].startswith("deployments: 1 without a work pool")
    pooled = [{"name": "gemm/gemm", "work_pool": "paperline-cpu", "polled_s_ago": None, "paused": False},
              {"name": "x/y", "work_pool": "other", "polled_s_ago": None, "paused": False}]
    workers = {"paperline-cpu": [{"name": "w1", "heartbeat_s_ago": 12.4}, {"name": "old", "heartbeat_s_ago": 600.0}],
               "other": [{"name": "never", "heartbeat_s_ago": None}]}
    assert deployment_report(pooled, workers, {"x/y": 3}) == [
        "work pool other: 1 deployment(s), no worker online: their runs wait Scheduled until a worker of the pool "
        "runs; 3 scheduled run(s) past their start time wait for it",
        "work pool paperline-cpu: 1 deployment(s), 1 worker(s) online: w1 (heartbeat 12 s ago)"]
    assert deployment_report(pooled[:1], {}, {})[0].endswith("until `paperline worker --pool cpu` runs")
    # a `paperline worker` of this machine that exited: not online, whatever its last heartbeat
    workers["paperline-cpu"][0]["exited"] = True
    assert deployment_report(pooled[:1], workers, {})[0].startswith("work pool paperline-cpu: 1 deployment(s), no worker")


def test_a_local_worker_is_known_exited_by_its_process():
    """`status` showed a `paperline worker` killed seconds before as online (a trial): its Prefect
    worker is named after its process, which is looked for on this machine."""
    from paperline.infra.flow_runs import _local_worker_exited, local_worker_name

    this = local_worker_name(os.getpid())  # pytest: alive, but not a `paperline worker`
    assert this.startswith("paperline-") and this.endswith(f"-{os.getpid()}")
    assert _local_worker_exited(this)  # (a PID used again by another program)
    import time

    import psutil

    fake = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "paperline", "worker"])
    try:
        while "worker" not in psutil.Process(fake.pid).cmdline():  # (still the forked pytest, before its exec)
            time.sleep(0.01)
        assert not _local_worker_exited(local_worker_name(fake.pid))
    finally:
        fake.kill()
        fake.wait()
    assert _local_worker_exited(local_worker_name(fake.pid))
    # another machine's worker, or one named by its user: left to its heartbeat
    assert not _local_worker_exited(f"paperline-another-host-{os.getpid()}")
    assert not _local_worker_exited("ProcessWorker 1b2c") and not _local_worker_exited(this + "x")


def test_serve_lock_holder_names_the_pid_only_while_the_lock_is_held(tmp_path):
    import fcntl

    assert serve_lock_holder(tmp_path) is None  # no file
    with open(tmp_path / "serve.pid", "a+") as f:
        f.write("4242\n")
        f.flush()
        assert serve_lock_holder(tmp_path) is None  # a stopped serve's file: not held
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        assert serve_lock_holder(tmp_path) == 4242
    assert serve_lock_holder(tmp_path) is None


@pytest.mark.stack
def test_deployment_status_reads_pools_workers_and_late_runs_from_the_server(stack, tmp_path):
    import datetime

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import WorkPoolCreate
    from prefect.states import Scheduled

    _, info = stack

    @flow(name="paperline-test-status-probe")
    def probe() -> None:
        """Never executed: its runs only carry states."""

    pool = f"paperline-test-status-{uuid.uuid4().hex[:8]}"
    past = datetime.datetime.now(datetime.timezone.utc) - datetime.timedelta(minutes=5)
    with get_client(sync_client=True) as client:
        client.create_work_pool(WorkPoolCreate(name=pool, type="process"))
        try:
            deployment = client.create_deployment(flow_id=client.create_flow(probe), name="pooled", work_pool_name=pool)
            soon = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(minutes=10)
            for when in (past, past, soon + datetime.timedelta(hours=1), soon):
                client.create_flow_run_from_deployment(deployment, state=Scheduled(scheduled_time=when))
            lines = deployment_status(info.prefect_api_url, info.prefect_login, tmp_path)
            assert f"work pool {pool}: 1 deployment(s), no worker online: their runs wait Scheduled until a worker " \
                   "of the pool runs; 2 scheduled run(s) past their start time wait for it" in lines, lines
            # the next run to start (past ones are said above), unless another deployment's starts sooner
            def next_run(lines: list[str]) -> tuple[str, datetime.datetime]:
                (upcoming,) = [line for line in lines if line.startswith("next scheduled run: ")]
                shown = datetime.datetime.strptime(upcoming.split(" at ")[1][:20], "%Y-%m-%d %H:%M UTC")
                return upcoming, shown.replace(tzinfo=datetime.timezone.utc)

            upcoming, shown = next_run(lines)
            at = soon.strftime("%Y-%m-%d %H:%M UTC")
            # a run still to come (not a past one); this deployment's (no worker takes it) only where no
            # process takes another's
            assert past < shown, lines
            assert upcoming == (f"next scheduled run: paperline-test-status-probe/pooled at {at} (in 10 min); no "
                                "process takes its runs now (above: what would)") or \
                "paperline-test-status-probe/pooled" not in upcoming, lines
            # a paused deployment's runs start only once it is unpaused: the next one is another's, however many
            # of the paused one's come first (20 of them hid the line: a trial)
            later = client.create_deployment(flow_id=client.create_flow(probe), name="later", work_pool_name=pool)
            client.create_flow_run_from_deployment(later, state=Scheduled(scheduled_time=soon + datetime.timedelta(days=3)))
            for _ in range(25):
                client.create_flow_run_from_deployment(deployment, state=Scheduled(scheduled_time=soon))
            client.pause_deployment(deployment)
            lines = deployment_status(info.prefect_api_url, info.prefect_login, tmp_path)
            assert not [line for line in lines if "paperline-test-status-probe/pooled at" in line], lines
            upcoming, shown = next_run(lines)  # later's, or another unpaused deployment's sooner
            assert past < shown <= soon + datetime.timedelta(days=3), lines
            assert upcoming.startswith("next scheduled run: paperline-test-status-probe/later at ") or \
                shown < soon + datetime.timedelta(days=3) - datetime.timedelta(minutes=1), lines
            client.resume_deployment(deployment)
            client.delete_deployment(later)
            client.send_worker_heartbeat(pool, "probe-worker")
            lines = deployment_status(info.prefect_api_url, info.prefect_login, tmp_path)
            online = [line for line in lines if line.startswith(f"work pool {pool}: 1 deployment(s), 1 worker(s) "
                                                                 "online: probe-worker (heartbeat ")]
            assert len(online) == 1 and online[0].endswith("2 scheduled run(s) past their start time wait for it"), lines
            upcoming, shown = next_run(lines)  # taken now: its run, or one sooner that a process takes
            assert past < shown <= soon and (upcoming.startswith("next scheduled run: paperline-test-status-probe/pooled "
                                                                 "at ") or shown < soon - datetime.timedelta(minutes=1)), lines
        finally:
            client.delete_deployment(deployment)
            client.delete_work_pool(pool)
    refused = deployment_status(info.prefect_api_url, "nobody:wrong", tmp_path)
    assert len(refused) == 1 and refused[0].startswith("deployments: could not read them from Prefect ("), refused


def _record(exc: BaseException) -> logging.LogRecord:
    try:
        raise exc
    except BaseException:  # noqa: BLE001
        return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, "Encountered exception: %r",
                                 (exc,), sys.exc_info())


@pytest.mark.parametrize("exc", [InputError("beta", 2.0, "TRSM does not use it"), KeyboardInterrupt()])
def test_expected_errors_are_logged_without_their_traceback(exc):
    record = _record(exc)
    assert ExpectedErrorOneLine().filter(record) and record.exc_info is None
    assert repr(exc) in record.getMessage()


def test_an_expected_error_is_not_called_unexpected_nor_said_twice_by_the_cli():
    """A refused run's serve log read "Engine execution exited with unexpected exception"; the
    CLI printed the error as Prefect's "Encountered exception" line, the Failed state and its
    own `error:` line (a trial)."""
    from paperline.flows.cli import _error_said_once

    error = InputError("source", "/v", "every input was rejected (1)")
    engine = _record(error)
    engine.msg, engine.args = "Engine execution exited with unexpected exception", ()
    assert not ExpectedErrorOneLine().filter(engine)  # dropped
    encountered = _record(error)
    encountered.msg = "Encountered exception during execution: %r"
    assert ExpectedErrorOneLine().filter(encountered) and not _error_said_once(encountered)  # kept for the UI
    bug = _record(RuntimeError("a bug"))
    bug.msg = "Encountered exception during execution: %r"
    assert ExpectedErrorOneLine().filter(bug) and _error_said_once(bug)
    # the task run's own report of it too (a diverged training said its error five times: a trial)
    failed = _record(error)
    failed.msg = "Task run failed with exception: %r"
    assert ExpectedErrorOneLine().filter(failed) and not _error_said_once(failed)
    failed_bug = _record(RuntimeError("a bug"))
    failed_bug.msg = "Task run failed with exception: %r"
    assert ExpectedErrorOneLine().filter(failed_bug) and _error_said_once(failed_bug)
    engine_bug = _record(RuntimeError("a bug"))
    engine_bug.msg, engine_bug.args = "Engine execution exited with unexpected exception", ()
    assert ExpectedErrorOneLine().filter(engine_bug) and engine_bug.exc_info is not None


def test_other_errors_keep_their_traceback():
    record = _record(RuntimeError("a bug"))
    assert ExpectedErrorOneLine().filter(record) and record.exc_info is not None


def test_the_filter_sits_on_the_run_loggers_unless_debugging(monkeypatch):
    logger = logging.getLogger("paperline.test.run-logger")
    monkeypatch.setattr(logger, "filters", [])
    monkeypatch.setenv("PAPERLINE_DEBUG", "1")
    quiet_expected_tracebacks(("paperline.test.run-logger",))
    assert logger.filters == []
    monkeypatch.delenv("PAPERLINE_DEBUG")
    quiet_expected_tracebacks(("paperline.test.run-logger",))
    quiet_expected_tracebacks(("paperline.test.run-logger",))
    assert [type(f) for f in logger.filters] == [ExpectedErrorOneLine]
    import paperline.tasks  # noqa: F401 - installs it, in a flow's process and on every worker

    assert any(isinstance(f, ExpectedErrorOneLine) for f in logging.getLogger("prefect.flow_runs").filters)


def test_a_server_error_reading_the_deployments_shows_no_password(tmp_path):
    """`status` printed httpx's message, which quotes the URL, with the password of a configured
    PAPERLINE_PREFECT_API_URL in it (a review)."""
    import http.server
    import threading

    from paperline.infra.flow_runs import deployment_status

    class Forbidden(http.server.BaseHTTPRequestHandler):
        def refuse(self):
            self.send_response(403)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"detail": "no"}')

        do_GET = do_POST = refuse

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Forbidden)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        (line,) = deployment_status(f"http://bob:s3cretpw@127.0.0.1:{server.server_address[1]}/api", None, tmp_path)
    finally:
        server.shutdown()
    assert line.startswith("deployments: could not read them from Prefect (") and "403" in line, line
    assert "s3cretpw" not in line and "bob@127.0.0.1" in line, line
