"""Deployments as a user meets them: `paperline serve` on the session stack, a run triggered
through the Prefect API with the call the UI's "Run" button makes (create a flow run from the
deployment, with custom parameters), executed to Completed by the serving process, and the
matching MLflow run tagged with the flow-run id."""

import re
import signal
import subprocess
import sys
import time

import psutil
import pytest

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def served(stack, tmp_path_factory, background_process, cli_env):
    _, info = stack
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with background_process([sys.executable, "-m", "paperline.flows.cli", "serve"], cli_env, log) as proc:
        yield info, proc, log


def _deployment(client, name, proc, log, timeout=120):
    from prefect.exceptions import ObjectNotFound

    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, log.read_text()[-3000:]
        try:
            return client.read_deployment_by_name(name)
        except ObjectNotFound:
            time.sleep(1)
    raise AssertionError(f"deployment {name} never appeared:\n{log.read_text()[-3000:]}")


def test_a_run_triggered_through_the_api_completes_and_is_tracked(served, wait_for_flow_run):
    from prefect.client.orchestration import get_client

    from paperline.infra.tracking import Tracker

    info, proc, log = served
    with get_client(sync_client=True) as client:
        deployment = _deployment(client, "gemm/local", proc, log)
        _deployment(client, "tensor-factorization/local", proc, log)
        assert deployment.schedules and deployment.schedules[0].schedule.cron == "30 3 * * *"
        params = {"n": 90, "k": 70, "tile": 32, "routine": "syr2k", "uplo": "L", "scaling": False}
        run = client.create_flow_run_from_deployment(deployment.id, parameters={"params": params})
        state = wait_for_flow_run(client, run.id, proc, log)
        assert state.name == "Completed", (state, log.read_text()[-3000:])
        # the summary `paperline run` prints is in the run's logs (the UI's): a resumed or cached
        # deployment run said so nowhere (a trial)
        from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

        deadline = time.time() + 30  # (logs are sent in batches: the last ones after the run's state)
        while True:
            logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(any_=[run.id])))
            summary = [entry.message for entry in logs if entry.message.startswith("gemm summary:")]
            if summary or time.time() > deadline:
                break
            time.sleep(0.5)
        assert len(summary) == 1, [entry.message[:200] for entry in logs]
        assert "verif" in summary[0] and "MLflow run: http://127.0.0.1:" in summary[0], summary[0]
    runs = Tracker(info.mlflow_tracking_uri).client.search_runs(
        [Tracker(info.mlflow_tracking_uri).client.get_experiment_by_name("gemm").experiment_id],
        filter_string=f"tags.`prefect.flow_run_id` = '{run.id}'")
    assert len(runs) == 1
    assert runs[0].data.params["routine"] == "syr2k" and runs[0].data.params["m"] == "90"  # SYR2K's result is n x n
    assert runs[0].data.metrics["verification_residual"] < 1e-12


def test_the_readme_command_line_triggers_a_run(served, cli_env, wait_for_flow_run):
    """`eval "$(paperline env)"`, then `prefect deployment run gemm/local --params ...` (the README's
    commands), in a shell without PREFECT_API_URL: the run is created on the stack's server and
    completes. Without the export, Prefect's CLI started an empty temporary server of its own and
    answered "Deployment 'gemm/local' not found"."""
    import re
    import subprocess

    from prefect.client.orchestration import get_client

    _, proc, log = served
    env = {k: v for k, v in cli_env.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    py = sys.executable
    params = '{"params": {"m": 64, "n": 48, "k": 40, "tile": 32, "scaling": false}}'
    script = f"eval \"$({py} -m paperline.flows.cli env)\" && {py} -m prefect deployment run gemm/local --params '{params}'"
    # what `serve` prints says the same (it said PREFECT_API_URL=... alone, a 401 with the login: a trial)
    # ... with commands the serve's shell finds (the venv's paths unless its PATH leads there: a trial)
    from paperline.flows.cli import _on_path

    with get_client(sync_client=True) as client:
        _deployment(client, "gemm/local", proc, log)  # (serving: its lines are printed)
    said = " ".join(log.read_text().split())
    # ... and the state directory of a stack not in the default one (pasted elsewhere, the printed
    # command pointed at the default stack: a trial)
    state = cli_env["PAPERLINE_STATE_DIR"]
    assert f"in a shell, with `PAPERLINE_STATE_DIR={state} {_on_path('paperline')} trigger gemm --set m=512 " in said, \
        said[-3000:]  # (paperline's own first: run's --set, checked before the run exists)
    assert f"with Prefect's CLI: `eval \"$(PAPERLINE_STATE_DIR={state} {_on_path('paperline')} env)\"` (the stack's " \
        f"URLs and logins) then `{_on_path('prefect')} deployment run gemm/local" in said, said[-3000:]
    out = subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True, timeout=180)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    run_id = re.search(r"UUID: ([0-9a-f-]{36})", out.stdout).group(1)
    with get_client(sync_client=True) as client:
        state = wait_for_flow_run(client, run_id, proc, log)
    assert state.name == "Completed", (state, log.read_text()[-3000:])


def test_trigger_runs_a_deployment_with_run_s_checks_and_watches_it_to_its_summary(served, cli_env, run_cli, tmp_path):
    """`paperline trigger PIPELINE --set ...`: the Run button's call with `run`'s parameter
    language and checks (the README's `prefect deployment run ... --params '{"params": ...}'` took
    JSON nested by hand); `--watch` follows the run and prints the summary its flow logged, and a
    run that fails exits 1 with its state's message."""
    from prefect.client.orchestration import get_client

    _, proc, log = served
    with get_client(sync_client=True) as client:
        _deployment(client, "gemm/local", proc, log)
    # what `run` takes is sent as it checked it (the text as typed, `"96"`, `Gemm`, was a 409 from
    # Prefect's schema: a trial)
    done = run_cli(cli_env, "trigger", "gemm", "--set", "routine=Gemm", "--set", 'm="96"', "--set", "n=64", "--set",
                   "k=32", "--set", "tile=32", "--set", "scaling=false", "--deployment", "gemm/local", "--watch")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:] + log.read_text()[-3000:]
    out = done.stdout
    assert re.search(r"triggered gemm/local: flow run '[\w-]+' http://127\.0\.0\.1:\d+/runs/flow-run/", out), out
    assert out.index(": Running") < out.index(": Completed") < out.index("gemm: throughput") < out.index("verified")
    assert "GEMM 96x64 (k=32) float64 tile=32" in out, out
    # a missing local file is refused before the run (served here: its files are these); an S3 object is
    # looked for by the run
    missing = run_cli(cli_env, "trigger", "gemm", "--set", "a=/nonexistent/A.npy")
    assert missing.returncode == 1 and "error: a='/nonexistent/A.npy': no such file" in missing.stderr
    assert "triggered" not in missing.stdout
    failed = run_cli(cli_env, "trigger", "gemm", "--set", "a=s3://paperline-data/nonexistent/A.npy", "--watch")
    err = " ".join(failed.stderr.split())
    assert failed.returncode == 1 and "Traceback" not in err, err
    assert "ended Failed: Flow run encountered an exception: InputError: a='s3://paperline-data/nonexistent/A.npy'" \
        in err, err
    # a preset's values are the run's given parameters (gemm's `full` m beside operand files): refused before
    # the run exists, not as it starts (a review)
    import numpy as np

    np.save(tmp_path / "A.npy", np.ones((40, 30)))
    np.save(tmp_path / "B.npy", np.ones((30, 20)))
    # ... and a preset's value the input checks refuse as given is left out, as `run` takes a preset's
    # values as defaults ("m=8192: ... leave it out", then n, then k, could not be done: trials)
    preset = run_cli(cli_env, "trigger", "gemm", "--preset", "full", "--set", f"a={tmp_path / 'A.npy'}",
                     "--set", f"b={tmp_path / 'B.npy'}", "--set", "scaling=false", "--watch")
    said = " ".join(preset.stdout.split())
    assert preset.returncode == 0, said + preset.stderr
    assert "sent without m, n, k of the preset 'full': the run's inputs decide them" in said, said
    assert "GEMM 40x20 (k=30) float64 tile=2048" in said, said
    # the deployment's own parameters: not {"params": ...} (every run crashed), or refused, said as theirs
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentUpdate

    with get_client(sync_client=True) as client:
        deployment = client.read_deployment_by_name("gemm/local")
        try:
            client.update_deployment(deployment.id, DeploymentUpdate(parameters={"m": 256}))
            stray = run_cli(cli_env, "trigger", "gemm", "--set", "k=64")
            err = " ".join(stray.stderr.split())
            assert stray.returncode == 1 and "triggered" not in stray.stdout, err
            assert "error: gemm/local's own parameters on the Prefect server are {\"m\": 256}, not {\"params\": " \
                "{...}}: its flow takes `params` alone, and any run of it would crash" in err, err
            client.update_deployment(deployment.id, DeploymentUpdate(parameters={"params": {"memory_budget": "lots"}}))
            theirs = run_cli(cli_env, "trigger", "gemm", "--set", "k=64")
            err = " ".join(theirs.stderr.split())
            assert theirs.returncode == 1 and "(the deployment's own value, set on the Prefect server: --set " \
                "memory_budget=..., or fix it there)" in err and err.startswith("error: memory_budget='lots'"), err
        finally:
            client.update_deployment(deployment.id, DeploymentUpdate(parameters={}))
    # `kill` of a watching trigger stops the watch as Ctrl-C does, saying the run goes on (it ended unsaid: a trial)
    watching = subprocess.Popen([sys.executable, "-m", "paperline.flows.cli", "trigger", "gemm", "--set", "m=64",
                                 "--set", "n=32", "--set", "k=32", "--set", "tile=32", "--set", "scaling=false",
                                 "--watch"], env=cli_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    first = watching.stdout.readline()
    assert first.startswith("triggered gemm/local: flow run "), first
    watching.send_signal(signal.SIGTERM)
    rest = watching.communicate(timeout=60)[0]
    assert watching.returncode != 0 and "interrupted: stopped watching; flow run '" in rest and "goes on" in rest, rest
    nowhere = run_cli(cli_env, "trigger", "gemm", "--deployment", "nope")
    said = " ".join(nowhere.stderr.split())
    assert nowhere.returncode == 1 and "error: --deployment='nope': no deployment gemm/nope on the Prefect server" \
        in said
    # while a serve runs, it is the one to restart ("`paperline serve` serves gemm/local" read wrong: a trial)
    assert f"the `paperline serve` running (pid {proc.pid}) made gemm/local as it started: restart it" in said, said


def test_invalid_parameters_are_rejected_with_the_validation_error(served):
    """What the UI shows when a custom run's form holds a bad value: the server refuses the run."""
    from prefect.client.orchestration import get_client

    _, proc, log = served
    with get_client(sync_client=True) as client:
        deployment = _deployment(client, "gemm/local", proc, log)
        assert deployment.concurrency_limit == 1 or getattr(deployment, "global_concurrency_limit", None)
        with pytest.raises(Exception) as err:
            client.create_flow_run_from_deployment(deployment.id, parameters={"params": {"tile": 0}})
    assert "tile" in str(err.value) and ("0" in str(err.value))


# -- the same, in a real browser --------------------------------------------------------------------
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _browser_or_skip():
    """Playwright driving the system's Chromium (Debian's `chromium`; `.ci/run` installs it and sets
    PAPERLINE_REQUIRE_BROWSER=1 so that a missing browser fails there instead of skipping)."""
    import os
    import shutil

    chromium = os.environ.get("PAPERLINE_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        chromium = None
    if chromium is None:
        if os.environ.get("PAPERLINE_REQUIRE_BROWSER"):
            pytest.fail("the browser test needs Debian's chromium and the playwright package (.ci/run installs both)")
        pytest.skip("no chromium/playwright here; .ci/run installs them")
    return chromium


@pytest.mark.browser
def test_prefect_and_mlflow_uis_show_the_deployments_and_the_runs(served, wait_for_flow_run):
    """Headless Chromium logs in to the Prefect UI with the stack's login, finds every deployment, runs a
    small campaign from the nas deployment (the UI's Run call), then finds that run on the Prefect
    flow-runs page and the campaign in the MLflow UI's runs page; a gemm run that fails (a missing
    operand file) shows Failed and its error on its Prefect UI page. Screenshots go to
    ``$PAPERLINE_TEST_ARTIFACTS`` (default ``test-artifacts/``)."""
    import os
    from pathlib import Path

    from playwright.sync_api import sync_playwright
    from prefect.client.orchestration import get_client

    from paperline.infra.tracking import Tracker

    chromium = _browser_or_skip()
    info, proc, log = served
    shots = Path(os.environ.get("PAPERLINE_TEST_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
    shots = shots / "browser"
    shots.mkdir(parents=True, exist_ok=True)
    names = ["gemm/local", "nas/local", "tensor-factorization/local", "video-curation/local"]
    campaign = f"browser-{int(time.time())}"
    with get_client(sync_client=True) as client:
        deployments = [_deployment(client, n, proc, log) for n in names]
        params = {"optimizer": "random", "problem": "branin-currin", "budget": 6, "q": 3, "n_init": 3,
                  "campaign": campaign}
        run = client.create_flow_run_from_deployment(deployments[1].id, parameters={"params": params})
        # and a run that fails inside the flow (valid form, missing operand file)
        missing = f"/nonexistent/paperline-{campaign}.npy"
        failing = client.create_flow_run_from_deployment(deployments[0].id, parameters={"params": {
            "m": 64, "n": 64, "k": 64, "tile": 32, "a": missing}})
        state = wait_for_flow_run(client, run.id, proc, log)
        assert state.name == "Completed", (state, log.read_text()[-3000:])
        failed = wait_for_flow_run(client, failing.id, proc, log)
        assert failed.name == "Failed" and "no such file" in (failed.message or ""), failed
        run_name = client.read_flow_run(run.id).name
    tracker = Tracker(info.mlflow_tracking_uri)
    experiment_id = tracker.client.get_experiment_by_name("nas").experiment_id
    prefect_ui, mlflow_ui = info.prefect_ui_url.rstrip("/"), info.mlflow_tracking_uri.rstrip("/")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        # MLflow's UI takes the browser's basic auth (its login prompt): the stack's MLflow login
        user, password = info.mlflow_login.split(":", 1)
        page = browser.new_page(viewport={"width": 1400, "height": 900},
                                http_credentials={"username": user, "password": password})
        try:
            page.goto(f"{prefect_ui}/deployments", wait_until="load")
            # the UI asks for the server's login once (the line in prefect/auth_string), then keeps it
            page.get_by_placeholder("admin:pass").fill(info.prefect_login)
            page.screenshot(path=str(shots / "prefect-login.png"))
            page.get_by_role("button", name="Login").click()
            for n in names:  # each row: the deployment's name over its flow's name
                page.get_by_text(n.split("/")[0], exact=True).first.wait_for(timeout=60_000)
            assert page.get_by_text("local", exact=True).count() >= len(names)
            page.screenshot(path=str(shots / "prefect-deployments.png"), full_page=True)
            page.goto(f"{prefect_ui}/runs", wait_until="load")
            page.get_by_text(run_name).first.wait_for(timeout=60_000)
            page.screenshot(path=str(shots / "prefect-runs.png"), full_page=True)
            page.goto(f"{mlflow_ui}/#/experiments/{experiment_id}/runs", wait_until="load")
            page.get_by_text(campaign).first.wait_for(timeout=60_000)
            page.screenshot(path=str(shots / "mlflow-runs.png"), full_page=True)
            # the failed run's page shows its state and the error (the flow's log, with the bad operand)
            page.goto(f"{prefect_ui}/runs/flow-run/{failing.id}", wait_until="load")
            page.get_by_text("Failed").first.wait_for(timeout=60_000)
            page.get_by_text(f"a='{missing}': no such file").first.wait_for(timeout=60_000)
            page.screenshot(path=str(shots / "prefect-failed-run.png"), full_page=True)
        except Exception:
            page.screenshot(path=str(shots / "failure.png"), full_page=True)
            raise
        finally:
            browser.close()
    for name in ("prefect-deployments.png", "prefect-runs.png", "mlflow-runs.png", "prefect-failed-run.png"):
        assert (shots / name).stat().st_size > 10_000


def test_schedules_and_parameters_set_in_the_ui_outlive_a_restart_of_serve(served):
    """Each `paperline serve` replaced its deployments' schedules and parameters with the
    pipelines' own: a schedule paused in the Prefect UI came back active (and made runs) after
    serve was restarted (a trial), and a schedule edited or added there, or parameters set there,
    were lost unsaid. The UI's calls, then the deployments as a restarted serve registers them:
    what the UI left is kept, and serve's lines say so."""
    from datetime import timedelta

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import DeploymentScheduleCreate, DeploymentUpdate
    from prefect.client.schemas.schedules import CronSchedule, IntervalSchedule

    from paperline.deployments import local_deployments
    from paperline.flows.cli import _schedules_said, existing_deployments, served_names

    info, proc, log = served
    with get_client(sync_client=True) as client:
        before = _deployment(client, "gemm/local", proc, log)
        assert [(s.slug, s.schedule.cron, s.active) for s in before.schedules] == [("gemm-schedule", "30 3 * * *", True)]
        assert _schedules_said(before.schedules, "30 3 * * *") == "30 3 * * *"  # the pipeline's: said plainly
        try:
            # the UI: the schedule's toggle, its edit (another time), a second schedule, the parameters' form
            client.update_deployment_schedule(before.id, before.schedules[0].id, active=False,
                                              schedule=CronSchedule(cron="0 9 * * 1-5", timezone="UTC"))
            client.create_deployment_schedules(before.id, [(IntervalSchedule(interval=timedelta(hours=6)), True)])
            client.update_deployment(before.id, DeploymentUpdate(parameters={"params": {"m": 256, "tile": 64}}))
            existing = existing_deployments(served_names())
            assert set(existing) == set(served_names())  # every one exists: each is registered as it is
            said: list[str] = []
            again = {f"{d.flow_name}/{d.name}": d for d in local_deployments(info.data_bucket, existing, said.append)}
            assert said == ["gemm/local: parameters as set on the Prefect server, not the pipeline's own: m=256, "
                            "tile=64"], said
            fresh = {f"{d.flow_name}/{d.name}": d for d in local_deployments(info.data_bucket)}
            assert fresh["nas/local"].schedules[0].schedule.cron == "0 4 * * 0"  # (a first serve: the pipeline's)
            assert fresh["gemm/local"].parameters == {}
            again["gemm/local"].apply()  # as the restarted serve registers it
            after = client.read_deployment_by_name("gemm/local")
            assert sorted((getattr(s.schedule, "cron", None) or str(s.schedule.interval), s.active)
                          for s in after.schedules) == [("0 9 * * 1-5", False), ("6:00:00", True)]
            assert _schedules_said(after.schedules, "30 3 * * *") == (
                "0 9 * * 1-5, schedule paused; every 6:00:00; as set on the Prefect server (the pipeline's: 30 3 * * *)")
            assert after.parameters == {"params": {"m": 256, "tile": 64}}
        finally:  # as the module's serve registered it, for the tests after this one
            after = client.read_deployment_by_name("gemm/local")
            for schedule in after.schedules:
                client.delete_deployment_schedule(after.id, schedule.id)
            client.create_deployment_schedules(after.id, [DeploymentScheduleCreate(
                schedule=CronSchedule(cron="30 3 * * *", timezone="UTC"), active=True, slug="gemm-schedule")])
            client.update_deployment(after.id, DeploymentUpdate(parameters={}))


def test_a_second_serve_on_the_same_stack_is_refused(served, cli_env):
    """Two `paperline serve` on one stack served the same deployments, and stopping the second
    paused the first one's schedules (a fresh-user trial)."""
    _, proc, _ = served
    second = subprocess.run([sys.executable, "-m", "paperline.flows.cli", "serve"], env=cli_env, capture_output=True,
                            text=True, timeout=300)
    err = " ".join(second.stderr.split())
    assert second.returncode == 1 and "Traceback" not in err, err
    assert f"error: another `paperline serve` (pid {proc.pid}) already serves this stack's deployments" in err, err
    assert proc.poll() is None  # the first one serves on


def test_a_serve_of_another_state_dir_on_the_same_prefect_server_is_refused(served):
    """The serve lock is per state directory: a client configured against a shared Prefect server
    served the same deployments, and stopping it paused them all under the first serve (a trial).
    Deployments unpaused and polled in the last 90 s are another process's: refused, named."""
    from prefect.client.orchestration import get_client

    from paperline.flows.cli import existing_deployments, served_elsewhere, served_names
    from paperline.infra.errors import PaperlineError

    _, proc, log = served
    with get_client(sync_client=True) as client:
        deadline = time.time() + 60
        while not _deployment(client, "gemm/local", proc, log).last_polled and time.time() < deadline:
            time.sleep(1)
    with pytest.raises(PaperlineError, match=r"another process serves 5 of these deployments on the Prefect server at "
                                             r".*compressed-training/local \(polled \d+ s ago\)"):
        served_elsewhere(existing_deployments(served_names()))
    assert existing_deployments(["nosuch/local"]) == {}
    served_elsewhere({})  # nothing served: passes


def test_status_names_the_serving_process(served, cli_env):
    """`paperline status` did not say whether anything served the deployments (a fresh-user trial)."""
    from prefect.client.orchestration import get_client

    _, proc, log = served
    with get_client(sync_client=True) as client:
        _deployment(client, "video-curation/local", proc, log)
    status = subprocess.run([sys.executable, "-m", "paperline.flows.cli", "status"], env=cli_env, capture_output=True,
                            text=True, timeout=120)
    out = " ".join(status.stdout.split())
    assert status.returncode == 0, status.stdout + status.stderr
    assert re.search(rf"deployments: \d+ served by `paperline serve` \(pid {proc.pid}\)", out), out


def test_ctrl_c_stops_serving_and_crashes_the_run_in_flight_at_once(stack, served, running_flow_run):
    """Ctrl-C on `paperline serve` during a run left it Running until the heartbeat automation
    crashed it, 75-90 s later, blaming a dead process (a fresh-user trial); now it ends Crashed as
    serve exits, either by its own report of the interrupt or, when its process ended without one,
    by serve's, naming the stop. The log has no traceback of the interrupt (a Dask worker
    process printed two each). A run serve had claimed (Pending) and not started would stay
    Pending for good, holding its deployment's one concurrency slot: it is marked Crashed too.
    Runs last: the module's serve is stopped here."""
    import os
    import signal

    from prefect.client.orchestration import get_client
    from prefect.states import Pending

    stack_settings, stack_info = stack
    _, proc, log = served
    with get_client(sync_client=True) as client:
        _deployment(client, "gemm/local", proc, log)  # served (when this test runs alone)
        run = running_flow_run(client, "gemm/local", proc, log)
        # the run's process leads a session of its own, its Dask workers in it: the terminal's
        # Ctrl-C reached them with serve, and workers still importing printed ~250 lines of
        # spawn tracebacks (a trial); serve stops the run's group instead
        engines = [p for p in psutil.Process(proc.pid).children() if "prefect.engine" in " ".join(p.cmdline())]
        assert engines and all(os.getsid(p.pid) == p.pid != os.getsid(proc.pid) for p in engines), engines
        family = engines + [c for p in engines for c in p.children(recursive=True)]
        assert len(family) > len(engines)  # (its workers: spawned, and in its group)
        assert {os.getpgid(p.pid) for p in family} == {p.pid for p in engines}
        # `status` names what executes (it said who would, not what ran: a trial)
        from paperline.infra.flow_runs import deployment_status

        lines = deployment_status(stack_info.prefect_api_url, stack_info.prefect_login, stack_settings.state_dir)
        assert [line for line in lines if line.startswith("flow runs executing: ") and
                f"gemm '{run.name}' (gemm/local, Running, for " in line], lines
        claimed = client.create_flow_run_from_deployment(  # as serve leaves a run it claims at the instant it stops
            _deployment(client, "tensor-factorization/local", proc, log).id, state=Pending())
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C sends
        proc.wait(timeout=90)
        state = client.read_flow_run(run.id).state
        unstarted = client.read_flow_run(claimed.id).state
    assert unstarted.name == "Crashed" and "stopped after claiming this run" in unstarted.message, unstarted
    text = log.read_text()
    assert state.name == "Crashed", (state, text[-3000:])
    assert state.message == "Execution was aborted by an interrupt signal." or \
        state.message.startswith("`paperline serve` was stopped while this run was executing"), state.message
    assert "Traceback" not in text and "KeyboardInterrupt\n" not in text, text[-3000:]
    assert psutil.wait_procs(family, timeout=30)[1] == []  # stopped with serve, workers too


@pytest.mark.parametrize("as_script_job", [False, True], ids=["terminal", "script-job"])
def test_sigterm_stops_serving_as_ctrl_c_does(stack, background_process, cli_env, running_flow_run, tmp_path,
                                              as_script_job):
    """`kill` (SIGTERM) on `paperline serve` ended its run Cancelled, Prefect's runner's own
    handling, while Ctrl-C and `paperline worker` end it Crashed naming the stop (a trial). Then
    SIGTERM during a run paused one of the five deployments (another trial): the other four kept
    making Scheduled runs that nothing executes. Also with SIGINT ignored, as `paperline serve &`
    in a script starts it (asyncio then installs no Ctrl-C handler to call). Runs after the
    module's serve is stopped (one serve per stack). From a terminal, SIGHUP (the terminal closed):
    it ended serve at once, and its runs, in sessions of their own, would have run on. (SIGTERM
    enters through Prefect's ``Runner.handle_sigterm``, tested as the script job; SIGHUP through
    serve's own handler; both end in the same ``as_ctrl_c``, whose asyncio branch the terminal
    variant and the Ctrl-C test take.)"""
    import datetime
    import os
    import signal

    from prefect.client.orchestration import get_client

    stop = signal.SIGTERM if as_script_job else signal.SIGHUP
    log = tmp_path / "serve.log"
    names = [f"{name}/local" for name in ("compressed-training", "gemm", "nas", "tensor-factorization",
                                          "video-curation")]
    with background_process([sys.executable, "-m", "paperline.flows.cli", "serve"], cli_env, log,
                            as_script_job=as_script_job) as proc, get_client(sync_client=True) as client:
        run = running_flow_run(client, "gemm/local", proc, log)
        assert not any(client.read_deployment_by_name(n).paused for n in names)  # serving unpaused them
        if not as_script_job:  # the user pauses one in the Prefect UI (its deployment toggle)
            client.pause_deployment(client.read_deployment_by_name("nas/local").id)
        os.kill(proc.pid, stop)  # `kill PID`, as a supervisor stops it; or the terminal closed
        proc.wait(timeout=90)
        state = client.read_flow_run(run.id).state
        paused = {n: client.read_deployment_by_name(n).paused for n in names}
    text = log.read_text()
    assert state.name == "Crashed", (state, text[-3000:])
    assert "Traceback" not in text, text[-3000:]
    assert all(paused.values()), (paused, text[-3000:])
    if as_script_job:
        return
    # Prefect's runner stopped as on Ctrl-C, not only paperline's backstop pausing
    assert "All deployments have been paused!" in text, text[-3000:]
    # the user's pause outlives a restart of serve (the runner unpaused every one it served: a trial); serve's own
    # stop paused the others, and the restarted serve unpauses them
    again = tmp_path / "again.log"
    restarted = datetime.datetime.now(datetime.timezone.utc)
    with background_process([sys.executable, "-m", "paperline.flows.cli", "serve"], cli_env, again) as proc, \
            get_client(sync_client=True) as client:
        try:
            deadline = time.time() + 120
            while (paused := {n: client.read_deployment_by_name(n).paused for n in names}) != \
                    {**dict.fromkeys(names, False), "nas/local": True} and time.time() < deadline:  # registered in turn
                assert proc.poll() is None, again.read_text()[-3000:]
                time.sleep(1)
            assert paused == {**dict.fromkeys(names, False), "nas/local": True}, (paused, again.read_text()[-3000:])
            # ... once its runner polls for nas/local's runs too (all are registered before it polls)
            while (nas := client.read_deployment_by_name("nas/local")).last_polled is None or \
                    nas.last_polled < restarted:
                assert proc.poll() is None and time.time() < deadline, again.read_text()[-3000:]
                time.sleep(1)
            assert nas.paused, again.read_text()[-3000:]
            assert "nas/local (0 4 * * 0; deployment paused, as left in the Prefect UI: its schedules make no runs, a " \
                "triggered run executes)" in again.read_text(), again.read_text()[-3000:]
            from paperline.infra.flow_runs import deployment_status  # `paperline status`'s lines

            stack_settings, stack_info = stack
            lines = deployment_status(stack_info.prefect_api_url, stack_info.prefect_login, stack_settings.state_dir)
            assert "paused in the Prefect UI while served, and kept paused by `paperline serve`: nas/local (their " \
                "schedules make no runs; a run triggered while served executes)" in lines, lines
            # ... and one paused during this serve (its record lists it as served unpaused: a trial's status said
            # "4 served" and "paused deployments: gemm/local")
            client.pause_deployment(client.read_deployment_by_name("gemm/local").id)
            lines = deployment_status(stack_info.prefect_api_url, stack_info.prefect_login, stack_settings.state_dir)
            assert "paused in the Prefect UI while served, and kept paused by `paperline serve`: gemm/local, nas/local " \
                "(their schedules make no runs; a run triggered while served executes)" in lines, lines
            assert lines[0].startswith(f"deployments: 5 served by `paperline serve` (pid {proc.pid})"), lines
        finally:  # resumed in the UI (while stopped): served unpaused by the next serve
            for name in ("gemm/local", "nas/local"):
                client.resume_deployment(client.read_deployment_by_name(name).id)
