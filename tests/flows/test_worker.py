"""The work-pool path as a user meets it: `prefect deploy --all` (prefect.yaml) against the
session stack, `paperline worker --pool cpu`, a run triggered through the API with custom
parameters, executed by the worker to Completed, and its MLflow run tagged with the flow-run id."""

import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.stack

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def deployed(stack, tmp_path_factory, background_process, cli_env):
    _, info = stack
    # the README's way: `eval "$(paperline env)"` points Prefect's own CLI at the stack
    # (an empty DASK_LOGGING__DISTRIBUTED is unset: exported as it was, Dask raised KeyError: '' in the script)
    exports = subprocess.run([sys.executable, "-m", "paperline.flows.cli", "env"], capture_output=True, text=True,
                             env={**cli_env, "DASK_LOGGING__DISTRIBUTED": ""}, timeout=60, check=True).stdout
    assert info.prefect_login not in exports and info.mlflow_login.split(":", 1)[1] not in exports  # read from files
    clean = {k: v for k, v in cli_env.items() if not k.startswith(("PREFECT_", "MLFLOW_", "DASK_LOGGING__"))}
    shell = subprocess.run(["bash", "-c", 'eval "$1" && env -0', "-", exports], env=clean, capture_output=True,
                           text=True, timeout=60, check=True).stdout
    env = dict(line.split("=", 1) for line in shell.split("\0") if "=" in line)
    assert {k: v for k, v in env.items() if k.startswith(("PREFECT_", "MLFLOW_"))} == {
        "PREFECT_API_URL": info.prefect_api_url, "MLFLOW_TRACKING_URI": info.mlflow_tracking_uri,
        # the local servers' logins: without them Prefect's and MLflow's CLIs got 401s
        "PREFECT_API_AUTH_STRING": info.prefect_login,
        "MLFLOW_TRACKING_USERNAME": info.mlflow_login.split(":")[0],
        "MLFLOW_TRACKING_PASSWORD": info.mlflow_login.split(":", 1)[1],
        # a flow called from a script in that shell caches in the stack's S3, as `paperline run`
        "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true", "PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK": info.result_storage_block}
    # and its Dask cluster's loggers at WARNING, as `paperline run` sets them (55 lines of INFO: a trial)
    assert env["DASK_LOGGING__DISTRIBUTED"] == "warning"
    proc = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", "--all"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    # started as `paperline worker &` in a shell script starts it: SIGINT ignored (it was passed on
    # to its `prefect worker` child as the stop signal, and ignored there too: a trial)
    with background_process([sys.executable, "-m", "paperline.flows.cli", "worker", "--pool", "cpu"], env, log,
                            as_script_job=True) as worker:
        yield info, worker, log


def test_deploy_all_creates_every_deployment_on_its_pool_with_a_schedule(deployed):
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        for name, cron in (("gemm/gemm", "30 3 * * *"), ("tensor-factorization/tensor-factorization", "0 2 * * *")):
            d = client.read_deployment_by_name(name)
            assert d.work_pool_name == "paperline-cpu"
            assert [s.schedule.cron for s in d.schedules] == [cron]


def test_a_worker_executes_a_triggered_run(deployed, wait_for_flow_run):
    from prefect.client.orchestration import get_client

    from paperline.infra.tracking import Tracker

    info, worker, log = deployed
    params = {"m": 100, "n": 80, "tile": 32, "routine": "trmm", "side": "R", "diag": "U", "scaling": False}
    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("gemm/gemm")
        run = client.create_flow_run_from_deployment(deployment.id, parameters={"params": params})
        state = wait_for_flow_run(client, run.id, worker, log)
    assert state.name == "Completed", (state, log.read_text()[-3000:])
    tracker = Tracker(info.mlflow_tracking_uri)
    runs = tracker.client.search_runs([tracker.client.get_experiment_by_name("gemm").experiment_id],
                                      filter_string=f"tags.`prefect.flow_run_id` = '{run.id}'")
    assert len(runs) == 1 and runs[0].data.params["routine"] == "trmm"
    # which deployment made it (serve's gemm/local and a worker's gemm/gemm looked alike: a trial)
    assert runs[0].data.tags["prefect.deployment"] == "gemm/gemm"


def test_status_says_the_pool_has_a_worker_online(deployed, cli_env):
    """`paperline status` said nothing of workers: a run waiting Scheduled for lack of one was
    unexplained (a fresh-user trial)."""
    deadline = time.monotonic() + 120  # the worker's first heartbeat comes once `prefect worker` has started
    while True:
        proc = subprocess.run([sys.executable, "-m", "paperline.flows.cli", "status"], env=cli_env,
                              capture_output=True, text=True, timeout=120)
        out = " ".join(proc.stdout.split())
        assert proc.returncode == 0, proc.stdout + proc.stderr
        if "work pool paperline-cpu: 5 deployment(s), 1 worker(s) online: " in out or time.monotonic() > deadline:
            break
        assert "work pool paperline-cpu: 5 deployment(s), no worker online: their runs wait Scheduled until " \
               "`paperline worker --pool cpu` runs" in out, out
        time.sleep(5)
    assert "work pool paperline-cpu: 5 deployment(s), 1 worker(s) online: " in out, out
    from paperline.infra.flow_runs import local_worker_name, local_worker_pids

    assert f"online: {local_worker_name(deployed[1].pid)} (heartbeat " in out, out  # named after its process
    info = deployed[0]
    assert local_worker_pids(info.prefect_api_url, info.prefect_login) == [deployed[1].pid]  # what `down` names


def test_trigger_says_when_a_work_pool_has_no_worker_online(deployed):
    """`paperline trigger --deployment gemm` with no worker online said nothing while its run waited
    (a trial); after the status test above, this pool's worker is online."""
    from types import SimpleNamespace

    from prefect.client.orchestration import get_client

    from paperline.flows.cli import _why_it_waits

    with get_client(sync_client=True) as client:
        assert _why_it_waits(client, client.read_deployment_by_name("gemm/gemm")) is None
        gpu = SimpleNamespace(paused=False, work_pool_name="paperline-gpu", status=None)  # a pool with no worker
        assert _why_it_waits(client, gpu) == ("has no worker of work pool paperline-gpu online: the run waits until "
                                              "`paperline worker --pool gpu` runs")
        # chosen over a paused gemm/local with no serve running: the other way is said (a trial)
        assert _why_it_waits(client, gpu, local="gemm/local").endswith(
            "runs; or run `paperline serve`, which serves gemm/local, and trigger with `--deployment local`")
        stopped = SimpleNamespace(paused=True, work_pool_name=None, status=None, last_polled=None)
        assert _why_it_waits(client, stopped).startswith("is paused (its `paperline serve` stopped")


def test_trigger_watch_names_the_run_that_holds_the_deployments_slot(deployed):
    """`trigger --watch` of a run queued behind its deployment's one slot said
    "AwaitingConcurrencySlot" and no more (which run to wait for or cancel: a search in the UI)."""
    from types import SimpleNamespace

    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Running

    from paperline.flows.cli import _slot_holder

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("gemm/gemm")
        waiting = SimpleNamespace(id=None, deployment_id=deployment.id)
        assert _slot_holder(client, waiting) == ""  # nothing holds it (the worker's runs above have ended)
        holder = client.create_flow_run_from_deployment(deployment.id, state=Running())  # no process: set at once
        try:
            assert _slot_holder(client, waiting) == f" (the deployment's one slot is held by flow run " \
                f"'{holder.name}', Running)"
            assert _slot_holder(client, SimpleNamespace(id=holder.id, deployment_id=deployment.id)) == ""  # not itself
            assert _slot_holder(client, SimpleNamespace(id=None, deployment_id=None)) == ""  # a run of no deployment
        finally:
            client.set_flow_run_state(holder.id, Cancelled(), force=True)


def test_trigger_watch_says_each_new_holder_of_the_slot(deployed, capsys):
    """A run that waited behind A, then (A done) behind B, was said to wait for A alone (a trial):
    each new wait (Prefect sets a new AwaitingConcurrencySlot state) names the run holding the slot
    then. The states are set through the API, as Prefect's concurrency checks set them (scheduled a
    day ahead: the module's worker leaves them alone)."""
    import datetime
    import threading

    from prefect.client.orchestration import get_client
    from prefect.states import Cancelled, Completed, Running, Scheduled

    from paperline.flows.cli import _watch_triggered
    from paperline.flows.pipelines import get_pipeline
    from paperline.infra.errors import PaperlineError

    later = datetime.datetime.now(datetime.timezone.utc) + datetime.timedelta(days=1)

    def waiting():
        return Scheduled(scheduled_time=later, name="AwaitingConcurrencySlot")

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("gemm/gemm")
        first = client.create_flow_run_from_deployment(deployment.id, state=Running())
        watched = client.create_flow_run_from_deployment(deployment.id, state=waiting())
        ended: list[BaseException] = []

        def watch():
            with get_client(sync_client=True) as own:
                try:
                    _watch_triggered(own, get_pipeline("gemm"), watched)
                except BaseException as exc:  # noqa: BLE001 - the test reads it
                    ended.append(exc)

        out = ""

        def wait_said(text: str) -> None:
            """Until the watch has printed ``text`` (its polls are a second apart), at most 30 s."""
            nonlocal out
            deadline = time.monotonic() + 30
            while text not in out and time.monotonic() < deadline and watcher.is_alive():
                time.sleep(0.2)
                out += capsys.readouterr().out
            assert text in out, out

        watcher = threading.Thread(target=watch)
        watcher.start()
        second = None
        try:
            wait_said(f"held by flow run '{first.name}'")
            client.set_flow_run_state(first.id, Completed(), force=True)
            second = client.create_flow_run_from_deployment(deployment.id, state=Running())
            client.set_flow_run_state(watched.id, waiting(), force=True)  # a new wait, the same name
            wait_said(f"held by flow run '{second.name}'")
        finally:
            client.set_flow_run_state(watched.id, Cancelled(), force=True)
            watcher.join(timeout=30)
            for run in (first, second):
                if run is not None:
                    client.set_flow_run_state(run.id, Cancelled(), force=True)
    out += capsys.readouterr().out
    said = [line for line in out.splitlines() if line.startswith(f"{watched.name}: ")]
    assert said == [f"{watched.name}: AwaitingConcurrencySlot (the deployment's one slot is held by flow run "
                    f"'{first.name}', Running)",
                    f"{watched.name}: AwaitingConcurrencySlot (the deployment's one slot is held by flow run "
                    f"'{second.name}', Running)",
                    f"{watched.name}: Cancelled"], out
    assert len(ended) == 1 and isinstance(ended[0], PaperlineError), ended


def test_sigterm_stops_the_worker_and_crashes_its_run_at_once(deployed, running_flow_run, stack):
    """`kill` (SIGTERM) of `paperline worker`, as a supervisor stops it, left its `prefect worker`
    child running under PID 1, taking runs (a fresh-user trial); it is passed on now. The run it
    was executing stayed Running until the heartbeat automation crashed it, 90 s later, blaming a
    dead process (another trial): it is Crashed as the worker exits, saying so. The worker was
    started with SIGINT ignored, as from a script (`paperline worker &`), which once left its
    child deaf to the stop, its run going on. Runs last: the module's worker is stopped here."""
    import signal

    import psutil
    from prefect.client.orchestration import get_client

    _, worker, log = deployed
    with get_client(sync_client=True) as client:
        run = running_flow_run(client, "gemm/gemm", worker, log)
        children = psutil.Process(worker.pid).children(recursive=True)
        assert any("worker" in c.cmdline() and "start" in c.cmdline() for c in children), \
            [c.cmdline() for c in children]
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=90) is not None
        _, alive = psutil.wait_procs(children, timeout=30)
        assert not alive, [p.cmdline() for p in alive]
        state = client.read_flow_run(run.id).state
    assert state.name == "Crashed", (state, log.read_text()[-3000:])
    assert state.message.startswith("`paperline worker` was stopped while this run was executing"), state.message
    assert f"({run.id}) marked Crashed" in log.read_text()
    # Prefect's worker logs the stop it was passed as "Received SIGINT": ours says what came
    assert "paperline: SIGTERM received: stopping the Prefect worker (passed on as SIGINT" in log.read_text()
    # and `status` no longer counts it online (it did for 90 s, on its last heartbeat: a trial)
    from paperline.infra.flow_runs import deployment_status, local_worker_name

    info, _, _ = deployed
    lines = deployment_status(info.prefect_api_url, info.prefect_login, stack[0].state_dir)
    assert [line for line in lines if line.startswith("work pool paperline-cpu: 5 deployment(s), no worker online")], lines
    with get_client(sync_client=True) as client:
        assert local_worker_name(worker.pid) in [w.name for w in client.read_workers_for_work_pool("paperline-cpu")]
