"""Deployments as a user meets them: `paperline serve` on the session stack, a run triggered
through the Prefect API with the call the UI's "Run" button makes (create a flow run from the
deployment, with custom parameters), executed to Completed by the serving process, and the
matching MLflow run tagged with the flow-run id."""

import sys
import time

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
        params = {"m": 120, "n": 90, "k": 70, "tile": 32, "routine": "syr2k", "uplo": "L", "scaling": False}
        run = client.create_flow_run_from_deployment(deployment.id, parameters={"params": params})
        state = wait_for_flow_run(client, run.id, proc, log)
        assert state.name == "Completed", (state, log.read_text()[-3000:])
    runs = Tracker(info.mlflow_tracking_uri).client.search_runs(
        [Tracker(info.mlflow_tracking_uri).client.get_experiment_by_name("gemm").experiment_id],
        filter_string=f"tags.`prefect.flow_run_id` = '{run.id}'")
    assert len(runs) == 1
    assert runs[0].data.params["routine"] == "syr2k" and runs[0].data.params["m"] == "120"
    assert runs[0].data.metrics["verification_residual"] < 1e-12


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
