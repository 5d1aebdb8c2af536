"""A process executing a flow run killed mid-run (SIGKILL: no chance to report) leaves the run
Crashed, never stuck Running: `paperline serve` runs emit heartbeats and `paperline up` installs
the automation that crashes a run whose heartbeats stop."""

import os
import signal
import sys
import time

import pytest

pytestmark = pytest.mark.stack


def _heartbeats(client, flow_run_id) -> int:
    from prefect.events.filters import EventFilter, EventNameFilter, EventResourceFilter

    page = client.read_events(filter=EventFilter(event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
                                                 resource=EventResourceFilter(id=[f"prefect.flow-run.{flow_run_id}"])),
                              limit=1)  # (the client's default, 100, is over the server's maximum)
    return page.total


def _automation():
    from prefect.automations import Automation

    from paperline.infra.stack import ZOMBIE_AUTOMATION

    return Automation.read(name=ZOMBIE_AUTOMATION)


def test_the_crash_window_follows_the_setting(stack):
    from prefect.client.orchestration import get_client

    from paperline.infra.stack import ZOMBIE_AUTOMATION, ensure_zombie_automation

    settings, info = stack
    assert _automation().trigger.within.total_seconds() == settings.crash_after_s
    try:
        ensure_zombie_automation(info.prefect_api_url, 75.0)  # e.g. `paperline up` with a new setting
        assert _automation().trigger.within.total_seconds() == 75.0
        assert "No heartbeat for 75 s" in _automation().actions[0].message
    finally:
        ensure_zombie_automation(info.prefect_api_url, settings.crash_after_s)
    assert _automation().trigger.within.total_seconds() == settings.crash_after_s
    # an earlier paperline's wording ("died", said also of a run whose server was stopped) is replaced
    old = _automation()
    old.actions[0].message = "No heartbeat for 90 s: the process running this flow run died."
    old.update()
    assert _automation().actions[0].message.endswith("died.")
    ensure_zombie_automation(info.prefect_api_url, settings.crash_after_s)
    assert "`paperline down` during the run" in _automation().actions[0].message
    with get_client(sync_client=True) as client:
        assert [a.name for a in client.read_automations()].count(ZOMBIE_AUTOMATION) == 1


def _engine_of(serve_pid: int, flow_run_id):
    """The ``prefect.engine`` process ``paperline serve`` (``serve_pid``) started for the flow run."""
    import psutil

    (engine,) = [p for p in psutil.Process(serve_pid).children() if "prefect.engine" in " ".join(p.cmdline())
                 and p.environ().get("PREFECT__FLOW_RUN_ID") == str(flow_run_id)]
    return engine


def test_killed_serve_processes_leave_their_runs_crashed(stack, background_process, cli_env, running_flow_run,
                                                          long_gemm, tmp_path):
    """Two runs of one `paperline serve`, then a `kill -9` of serve (one serve for both cases: the
    suite's time, their waits overlap):

    - a NAS run killed with it (SIGKILL: no chance to report) is Crashed by `paperline up`'s
      automation once its heartbeats stop, and its MLflow run, left RUNNING, is ended by the next;
    - a GEMM run left alone still ends, Crashed, its Dask workers with it, nothing left running
      unwatched: each run serve executes leads a session of its own (the terminal's Ctrl-C reached
      its Dask workers: a trial), so a kill of serve alone no longer takes the run's processes.
    """
    import psutil
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    from paperline.infra.stack import ZOMBIE_AUTOMATION
    from paperline.infra.tracking import Tracker

    _, cluster_up = long_gemm

    log = tmp_path / "serve.log"
    with background_process([sys.executable, "-m", "paperline.flows.cli", "serve"], cli_env, log) as proc, \
            get_client(sync_client=True) as client:
        assert [a.name for a in client.read_automations()].count(ZOMBIE_AUTOMATION) == 1
        deadline = time.time() + 120
        while True:
            assert proc.poll() is None, log.read_text()[-3000:]
            try:
                deployment = client.read_deployment_by_name("nas/local")
                break
            except ObjectNotFound:
                assert time.time() < deadline, log.read_text()[-3000:]
                time.sleep(1)
        # a campaign that trains CNNs for minutes: long enough to be killed while Running
        params = {"optimizer": "random", "problem": "live-mnist", "budget": 200, "q": 2, "n_init": 2,
                  "campaign": f"crash-{int(time.time())}"}
        run = client.create_flow_run_from_deployment(deployment.id, parameters={"params": params})
        deadline = time.time() + 180
        while client.read_flow_run(run.id).state.name != "Running" or not _heartbeats(client, run.id):
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        assert client.read_flow_run(run.id).state.name == "Running"  # heartbeating, not yet done
        # and its MLflow run exists (the flow creates it after its first heartbeat on a loaded host),
        # and its Dask cluster (whose line running_flow_run counts for the GEMM run's next)
        tracker = Tracker(stack[1].mlflow_tracking_uri)
        deadline = time.time() + 120
        while not _mlflow_runs(tracker, run.id) or cluster_up not in log.read_text():
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(1)
        left_alone = running_flow_run(client, "gemm/local", proc, log)
        nas = _engine_of(proc.pid, run.id)
        gemm = _engine_of(proc.pid, left_alone.id)
        family = [gemm, *gemm.children(recursive=True)]
        assert len(family) > 1, log.read_text()[-3000:]
        # serve, no goodbye, and the NAS run's session (it leads one, with its Dask workers: serve
        # killed alone, the run sees it go and ends itself Crashed, as the GEMM run does)
        proc.kill()
        os.killpg(nas.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.time() + stack[0].crash_after_s + 90
        states = {}
        while time.time() < deadline:
            states = {r: client.read_flow_run(r).state for r in (run.id, left_alone.id)}
            if states[left_alone.id].is_final() and states[run.id].name != "Running":
                break
            time.sleep(2)
    state = states[left_alone.id]
    assert state.name == "Crashed", (state, log.read_text()[-3000:])
    assert psutil.wait_procs(family, timeout=60)[1] == []
    state = states[run.id]
    assert state.name == "Crashed", state
    assert "heartbeat" in (state.message or "")
    # its MLflow run was left RUNNING (nobody ended it); the next run started, in any experiment,
    # ends it KILLED, naming why
    (orphan,) = [r for r in _mlflow_runs(tracker, run.id) if "mlflow.parentRunId" not in r.data.tags]  # the parent
    assert orphan.info.status == "RUNNING"
    probe = Tracker(stack[1].mlflow_tracking_uri).start_run("crash-test-probe", run_name="crash-test-probe")
    tracker.client.delete_run(probe)
    orphan = tracker.client.get_run(orphan.info.run_id)
    assert orphan.info.status == "KILLED" and orphan.data.tags["paperline.ended_by"] == "Prefect flow run Crashed"
    # a resumed campaign reopens it: running again, without the old attempt's ending
    tracker.reopen_run(orphan.info.run_id)
    orphan = tracker.client.get_run(orphan.info.run_id)
    assert orphan.info.status == "RUNNING" and "paperline.ended_by" not in orphan.data.tags
    # `paperline compare` sweeps its experiment before listing: the table does not show it RUNNING
    from paperline.flows.compare import compare_runs

    compared = compare_runs(tracker, "nas", [], f"tags.`prefect.flow_run_id` = '{run.id}'", 5, tmp_path, False,
                            False, True)
    orphan = tracker.client.get_run(orphan.info.run_id)
    assert orphan.info.status == "KILLED", compared


def _mlflow_runs(tracker, flow_run_id) -> list:
    """The nas experiment's MLflow runs of the flow run (none before the experiment exists)."""
    experiment = tracker.client.get_experiment_by_name("nas")
    if experiment is None:
        return []
    return tracker.client.search_runs([experiment.experiment_id],
                                      filter_string=f"tags.`prefect.flow_run_id` = '{flow_run_id}'")


def test_a_run_whose_heartbeats_stopped_while_the_server_was_down_is_crashed_at_up(stack, monkeypatch):
    """A run whose Prefect server was killed (or stopped by `paperline down`) under it stayed
    Running after the next `paperline up`, for good: the server drops a heartbeat window that
    expired while it was down (a trial). `up` restarting the server marks such runs Crashed; a run
    that heartbeats still, or whose first heartbeat is not due yet, is left alone (one whose first is
    long due is crashed); `down` names the Running runs first."""
    import datetime
    import uuid

    from prefect import flow
    from prefect.client.orchestration import get_client
    from prefect.events import Event
    from prefect.states import Cancelled, Running

    from paperline.infra.stack import crash_silent_runs, running_flow_runs

    _, info = stack

    @flow(name="heartbeat-probe")
    def probe() -> None:
        pass

    def heartbeat(run_id) -> dict:
        return Event(event="prefect.flow-run.heartbeat", resource={"prefect.resource.id": f"prefect.flow-run.{run_id}"},
                     occurred=datetime.datetime.now(datetime.timezone.utc), id=uuid.uuid4()).model_dump(mode="json")

    with get_client(sync_client=True) as client:
        silent, quiet = (client.create_flow_run(probe, state=Running()) for _ in range(2))  # quiet: no heartbeat
        flow_id = client.create_flow(probe)
        deployment = client.create_deployment(flow_id=flow_id, name=f"heartbeat-probe-{uuid.uuid4().hex[:8]}")
        deployed = client.create_flow_run_from_deployment(deployment, state=Running())
        client._client.post("/events", json=[heartbeat(silent.id)]).raise_for_status()
        deadline = time.time() + 60
        while not _heartbeats(client, silent.id):  # the server persists events asynchronously
            assert time.time() < deadline
            time.sleep(0.5)
        try:
            assert f"{silent.name} ({silent.id})" in running_flow_runs(info)
            assert f"{silent.name} ({silent.id})" not in crash_silent_runs(info.prefect_api_url, within_s=600)  # recent
            time.sleep(1.5)
            # `down` says a run whose heartbeats stopped is likely gone (runs Ctrl-C'ed while the server was
            # down were listed among what it interrupts: a trial)
            assert any(x.startswith(f"{silent.name} ({silent.id}; no heartbeat for ") and
                       x.endswith(" s: its process is likely gone)") for x in running_flow_runs(info, silent_after_s=1))
            crashed = crash_silent_runs(info.prefect_api_url, within_s=1)  # (and any run of this worker's left dead)
            assert f"{silent.name} ({silent.id})" in crashed and str(quiet.id) not in " ".join(crashed)
            state = client.read_flow_run(silent.id).state
            assert state.name == "Crashed" and "No heartbeat since" in state.message
            assert client.read_flow_run(quiet.id).state.name == "Running"  # its first heartbeat is not due yet
            # never a heartbeat, its first long due (its server killed in its first seconds): it stayed
            # Running for good (a trial). (The server stamps a run's start itself: the first heartbeat
            # is made due at once instead.)
            monkeypatch.setattr("paperline.infra.stack.FLOW_HEARTBEAT_S", 0)
            crashed = crash_silent_runs(info.prefect_api_url, within_s=1)
            assert f"{quiet.name} ({quiet.id})" in crashed
            # a deployment's run without heartbeats is left alone: a worker of the user's may send none
            assert client.read_flow_run(deployed.id).state.name == "Running", crashed
            state = client.read_flow_run(quiet.id).state
            assert state.name == "Crashed" and state.message.startswith("No heartbeat since it started at "), state
        finally:
            for run in (silent, quiet, deployed):
                client.set_flow_run_state(run.id, Cancelled(), force=True)
            client.delete_deployment(deployment)


def test_a_stopped_run_ends_killed_and_a_failed_one_says_why(stack):
    """A run cancelled from Prefect (its process gets SIGTERM: TerminationSignal in the flow) ended
    FAILED in MLflow with no reason, like a real failure (a trial)."""
    from prefect.exceptions import TerminationSignal

    from paperline.infra.tracking import Tracker

    _, info = stack
    tracker = Tracker(info.mlflow_tracking_uri)
    cases = [(TerminationSignal(signal=15), "KILLED", "stopped: cancelled from Prefect"),
             (KeyboardInterrupt(), "KILLED", "stopped: interrupted"),
             (ValueError("m=-1: must be positive\nmore"), "FAILED", "ValueError: m=-1: must be positive")]
    for exc, status, why in cases:
        run_id = tracker.start_run("end-failed-test", run_name=type(exc).__name__)
        tracker.end_failed(run_id, exc)
        run = tracker.client.get_run(run_id)
        assert run.info.status == status and run.data.tags["paperline.ended_by"].startswith(why), run.data.tags
        assert "more" not in run.data.tags["paperline.ended_by"]
    # MLflow itself gone: no ending tried (each call's retries held the run ~30 s); the next run's sweep ends it
    from paperline.infra.errors import ServiceError

    run_id = tracker.start_run("end-failed-test", run_name="mlflow-gone")
    tracker.end_failed(run_id, ServiceError("mlflow", "not available"))
    assert tracker.client.get_run(run_id).info.status == "RUNNING"
    tracker.end_run(run_id, "KILLED")
