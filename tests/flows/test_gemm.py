"""End to end through the real stack: `paperline run gemm` as a user runs it (a subprocess on a
2-worker local cluster), then the result object in S3, the MLflow run and its plots are checked
against an independent reference."""

import dataclasses
import io
import json
import re
import subprocess
import sys

import numpy as np
import pytest

pytestmark = pytest.mark.stack

ARGS = ["run", "gemm", "--preset", "demo", "--set", "m=300", "--set", "n=200", "--set", "k=130",
        "--set", "tile=64", "--set", "beta=0.5", "--set", "c=random", "--set", "alpha=2.0",
        "--set", "trans_a=T"]


@pytest.fixture(scope="module")
def gemm_run(stack, tmp_path_factory, run_cli, cli_env):
    _, info = stack
    out = tmp_path_factory.mktemp("gemm")
    summary = out / "summary.json"
    # two workers: the scaling rows (1 and 2 workers) and each worker's busy fraction
    proc = run_cli({**cli_env, "PAPERLINE_N_WORKERS": "2"}, *ARGS, "--summary-json", str(summary), check=True)
    return info, proc, json.loads(summary.read_text())


def test_run_verifies_and_prints_gflops_with_the_ratio_to_numpy(gemm_run):
    _, proc, summary = gemm_run
    out = " ".join(proc.stdout.split())
    assert "verified (Freivalds)" in out and "numpy.matmul" in out and "GFLOP/s" in out
    assert summary["gflops"] > 0 and summary["ratio_to_peer"] > 0
    assert summary["verification_residual"] < 1e-12
    assert f"output: {summary['output']}" in summary["lines"]  # a new object: no word of a replaced one
    # S3's bytes are part of the sources': "from sources X, from peers Y, from S3 Z" read as three amounts (a trial)
    (moved,) = [line for line in summary["lines"] if "bytes from sources" in line]
    assert re.search(r"; bytes from sources [1-9]\d* \(S3 GETs fetched 0\), from peers \d+$", moved), moved
    assert [r[0] for r in summary["table"]["rows"]][-2:] == ["paperline on 1 worker(s)", "paperline on 2 worker(s)"]
    # the comparison with the best earlier run: printed once, in the summary (its log record
    # goes to the Prefect UI, not also to this terminal)
    (versus,) = [line for line in summary["lines"] if "earlier" in line]
    assert " ".join((proc.stdout + proc.stderr).split()).count(" ".join(versus.split())) == 1, proc.stderr[-3000:]


def test_output_in_s3_equals_an_independent_reference(gemm_run):
    from paperline.infra.storage import ObjectStore
    from paperline.kernels.blas.sources import RandomSource, read_all

    info, _, summary = gemm_run
    assert summary["output"].startswith(f"s3://{info.data_bucket}/gemm/")
    got = np.load(io.BytesIO(ObjectStore.from_stack(info).get_bytes(summary["output"])))
    a = read_all(RandomSource((130, 300), "float64", seed=0, stream=0))  # trans_a=T: A is k x m
    b = read_all(RandomSource((130, 200), "float64", seed=0, stream=1))
    c = read_all(RandomSource((300, 200), "float64", seed=0, stream=2))
    np.testing.assert_allclose(got, 2.0 * a.T @ b + 0.5 * c, rtol=1e-12, atol=1e-12)


def test_mlflow_run_has_the_metrics_and_plots(gemm_run):
    from paperline.infra.tracking import Tracker

    info, _, summary = gemm_run
    run = Tracker(info.mlflow_tracking_uri).client.get_run(summary["mlflow_run_id"])
    m = run.data.metrics
    for key in ("throughput_gflop_per_s", "wall_s", "bytes_host_to_device", "bytes_peer", "bytes_s3", "cache_hit_rate",
                "verification_residual", "busy_fraction.worker_0", "busy_fraction.worker_1", "ratio_to_peer"):
        assert key in m, key
    assert 0 < m["cache_hit_rate"] < 1 and 0 < m["busy_fraction.worker_0"] <= 1
    assert run.data.tags["prefect.flow_run_id"] == summary["prefect_flow_run_id"]
    names = {a.path for a in Tracker(info.mlflow_tracking_uri).client.list_artifacts(summary["mlflow_run_id"])}
    assert {"timeline.png", "scaling.png", "tasks.json"} <= names
    assert "s3_secret_access_key" not in json.dumps(run.data.params)
    assert run.data.tags["paperline.params_key"] == summary["versus_best_earlier"]["params_key"]
    # the workers the multiply ran on: logged, and part of the comparison's key
    assert run.data.params["dask_workers"] == "2" == str(summary["mlflow_params"]["dask_workers"])
    assert not [line for line in summary["lines"] if "Dask workers the cluster was started with" in line]


def test_a_multiply_on_fewer_workers_than_started_says_so():
    from paperline.flows.gemm import fewer_workers_lines

    (line,) = fewer_workers_lines(1, 2)
    assert line.startswith("the multiply ran on 1 of the 2 Dask workers") and "runs on 1 worker(s)" in line
    assert fewer_workers_lines(2, 2) == fewer_workers_lines(3, None) == []


SCRIPT = """
from paperline.flows.gemm import GemmParameters, gemm
from paperline.infra.errors import PaperlineError
from paperline.infra.stack import connect

if __name__ == "__main__":  # the local Dask cluster's workers import this script again
    params = GemmParameters(m=90, n=70, k=50, tile=32, scaling=False, peer=False, output="out.npy")
    try:
        gemm(params)
    except PaperlineError as exc:
        print("REFUSED:", exc)
    connect(start=False)
    summary = gemm(params)
    print("URL:", summary["prefect_flow_run_url"])
    print("OUTPUT:", next(line for line in summary["lines"] if line.startswith("output:")))
"""


def test_a_flow_called_from_python_runs_on_the_stack_after_connect(stack, cli_env, tmp_path):
    """A user's script that called the gemm flow without pointing Prefect at the stack ran it on
    Prefect's temporary server, while the summary and MLflow linked to a page of the stack's UI that
    did not exist (a trial): refused as it is called, naming connect(); after connect() the run is
    on the stack."""
    from prefect.client.orchestration import get_client

    _, info = stack
    (tmp_path / "use.py").write_text(SCRIPT)
    np.save(tmp_path / "out.npy", np.zeros(3))  # an earlier file: replaced, as documented, and now said so
    env = {k: v for k, v in cli_env.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    proc = subprocess.run([sys.executable, "use.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    refused = next(line for line in proc.stdout.splitlines() if line.startswith("REFUSED:"))
    assert "flow 'gemm': PREFECT_API_URL is not set, so Prefect would run it on a temporary server" in refused
    assert "call paperline.infra.stack.connect()" in refused
    # refused before Prefect started its temporary server (14 s, a failed telemetry call and a
    # traceback before, a trial)
    assert "temporary server" not in proc.stderr.lower() and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    url = next(line for line in proc.stdout.splitlines() if line.startswith("URL:")).split()[1]
    assert f"OUTPUT: output: {tmp_path / 'out.npy'} (it replaced the file or object that was there)" in proc.stdout
    assert np.load(tmp_path / "out.npy").shape == (90, 70)
    assert url.startswith(f"{info.prefect_ui_url}/runs/flow-run/")
    with get_client(sync_client=True) as client:
        assert client.read_flow_run(url.rsplit("/", 1)[1]).state.name == "Completed"


def test_a_script_without_a_main_guard_is_refused_by_connect(stack, cli_env, tmp_path):
    """Each spawned Dask worker imports the script again: without the guard one gemm call made
    five failed flow runs and 4,000 lines of tracebacks ending in "Nanny failed to start" (a
    trial). connect() refuses such a script at once, naming the guard."""
    script = "\n".join(line for line in SCRIPT.splitlines() if line.startswith(("from", "import"))) + "\n"
    script += "connect(start=False)\nprint('RAN', gemm(GemmParameters(m=90, n=70, k=50, tile=32)))\n"
    (tmp_path / "noguard.py").write_text(script)
    env = {k: v for k, v in cli_env.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    proc = subprocess.run([sys.executable, "noguard.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "RAN" not in out and "Nanny failed" not in out, out[-3000:]
    assert "noguard.py has no `if __name__ == \"__main__\":` block" in out and "put connect() and the flow calls under it" in out


def test_a_flow_on_another_prefect_server_is_refused(stack):
    """The same check in a flow run on the stack, against a stack whose Prefect is elsewhere; the
    loopback names are one host (localhost for 127.0.0.1 is no mismatch)."""
    from prefect import flow

    from paperline.infra.errors import PaperlineError
    from paperline.infra.stack import _check_flow_run_server

    _, info = stack
    _check_flow_run_server(info)  # outside a flow run: nothing to check

    @flow
    def check(api_url: str) -> None:
        _check_flow_run_server(dataclasses.replace(info, prefect_api_url=api_url))

    check(info.prefect_api_url.replace("127.0.0.1", "localhost") + "/")
    with pytest.raises(PaperlineError, match=r"this flow run is on the Prefect server at http://127\.0\.0\.1:\d+/api/?, "
                                             r"not the stack's \(http://127\.0\.0\.1:1/api\)"):
        check("http://127.0.0.1:1/api")


def test_s3_inputs_are_checked_before_the_flow_run(stack, run_cli, cli_env):
    """A missing output bucket or S3 operand is named before a flow run exists: it used to fail in
    the flow (a Failed flow run, Prefect's error log line, then the same error again)."""
    _, info = stack
    for sets, message in ((["output=s3://no-such-bucket-9/x.npy"],
                           "error: output='s3://no-such-bucket-9/x.npy': no such bucket 'no-such-bucket-9'"),
                          ([f"b=s3://{info.data_bucket}/nothing/here.npy"],
                           f"error: b='s3://{info.data_bucket}/nothing/here.npy': no such object in S3")):
        proc = run_cli(cli_env, "run", "gemm", "--preset", "demo", *[a for s in sets for a in ("--set", s)])
        out = " ".join((proc.stdout + proc.stderr).split())
        assert proc.returncode == 1 and message in out, out
        assert "flow run" not in out.lower() and out.count(message) == 1, out


@pytest.mark.parametrize("signame, when", [("SIGINT", "multiply"), ("SIGHUP", "multiply"), ("SIGTERM", "multiply"),
                                           ("SIGINT", "start")])
def test_ctrl_c_says_what_running_the_command_again_does(stack, cli_env, long_gemm, tmp_path, signame, when,
                                                         terminal_signals):
    """Ctrl-C on `paperline run` left only Prefect's "Crash detected!" line (a trial): it now says
    what the same command does next, and exits 130 without a traceback. A closed terminal (SIGHUP)
    killed it at once, its runs left Running: it stops the same way, as does SIGTERM (`kill`). A
    Ctrl-C while the local
    cluster's workers were still starting printed two tracebacks per worker, and no word of
    what happened (two trials)."""
    import os
    import signal
    import time

    sets, cluster_up = long_gemm
    log = tmp_path / "run.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "paperline.flows.cli", "run", "gemm", *sets], env=cli_env,
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                preexec_fn=terminal_signals)
    deadline = time.time() + 180
    if when == "start":  # as soon as a worker process is starting (importing, registering)
        while not _spawned_workers(proc.pid):
            assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        time.sleep(0.3)
    while when == "multiply" and cluster_up not in log.read_text():  # stopped during the multiply
        assert proc.poll() is None and time.time() < deadline, log.read_text()[-3000:]
        time.sleep(0.5)
    time.sleep(1 if when == "multiply" else 0)
    os.killpg(proc.pid, getattr(signal, signame))  # what a terminal's Ctrl-C (or its closing) sends
    assert proc.wait(timeout=120) == 130, log.read_text()[-3000:]
    text = log.read_text()
    again = "interrupted: the same command runs the multiply again (staged random operands are reused)"
    assert again in text or (when == "start" and "interrupted before the flow run started: nothing ran" in text), text
    assert "Traceback" not in text, text[-3000:]
    # nor Prefect's red "Crash detected!" line (SIGTERM left it: Prefect's handler logs before ours counts)
    assert "Crash detected!" not in text, text[-3000:]
    # SIGTERM to the process group ended the local workers too, and their nanny's "Restarting
    # worker" read as a fault beside the "interrupted" line (a trial with `timeout`)
    assert "Restarting worker" not in text, text[-3000:]


def _spawned_workers(pid: int) -> list:
    """The Dask worker processes (multiprocessing spawn children, not its resource tracker) below ``pid``."""
    import psutil

    found = []
    for child in psutil.Process(pid).children(recursive=True):
        try:
            cmdline = " ".join(child.cmdline())
        except psutil.Error:
            continue
        if "spawn_main" in cmdline:
            found.append(child)
    return found


FAILING = """
import os
import sys

import paperline.flows.gemm as g
from paperline.infra.stack import connect


def fail(*args, **kwargs):
    raise RuntimeError("stopped here")


if __name__ == "__main__":
    connect(start=False)
    out, step = sys.argv[1], sys.argv[2]
    setattr(g, step, fail)
    try:
        g.gemm(g.GemmParameters(m=90, n=70, k=50, tile=32, output=out, peer=False))
    except RuntimeError as exc:
        print("FAILED:", exc)
    print("EXISTS:", os.path.exists(out))
"""


@pytest.mark.parametrize("step, written", [("scaling_sweep", False), ("_log_run", True)])
def test_a_run_that_fails_before_its_end_leaves_no_output_or_says_where_it_is(stack, cli_env, tmp_path, step,
                                                                            written):
    """An interrupted run (its multiply committed, then stopped in the scaling sweep) left its
    whole result at a default S3 key nobody was told (a trial): the output is now committed
    last, and a run stopped after that (logging to MLflow) says where its verified result is."""
    (tmp_path / "fail.py").write_text(FAILING)
    out = tmp_path / "c.npy"
    env = {k: v for k, v in cli_env.items() if not k.startswith(("PREFECT_", "MLFLOW_"))}
    proc = subprocess.run([sys.executable, "fail.py", str(out), step], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 0 and "FAILED: stopped here" in text, text[-3000:]
    assert f"EXISTS: {written}" in text, text[-3000:]
    said = f"the verified result had been written to {out} before the run stopped"
    assert (said in " ".join(text.split())) == written, text[-3000:]


def test_an_upload_left_by_a_run_killed_outright_is_aborted_by_the_next(stack, tmp_path, monkeypatch):
    """`kill -9` of a run while it uploaded its output to S3 left the multipart upload's parts in
    the bucket (never visible, but kept and, on AWS, billed until aborted: an infra trial). The
    upload is recorded in the run's scratch directory as it begins, and the next run's sweep of
    dead runs' scratch aborts it."""
    import os
    import socket
    from pathlib import Path

    from paperline.infra.settings import get_settings
    from paperline.infra.storage import ObjectStore, split_uri
    from paperline.tasks.gemm import UPLOAD_RECORD, scratch_dir

    _, info = stack
    store = ObjectStore.from_stack(info)
    # the record is written as S3 begins a multipart upload (over boto3's 8-MiB threshold)
    whole, record = f"s3://{info.data_bucket}/gemm/upload-test/whole.npy", tmp_path / "record.json"
    (tmp_path / "big").write_bytes(os.urandom(9 << 20))
    store.upload_file_to(tmp_path / "big", whole, record=record)
    recorded = json.loads(record.read_text())
    assert recorded["uri"] == whole and recorded["upload_id"] and store.exists(whole)
    assert store.abort_recorded_upload(record) and store.exists(whole)  # completed: nothing to abort
    # a run killed mid-upload: S3 holds a part; its scratch directory records the upload
    left = f"s3://{info.data_bucket}/gemm/upload-test/killed.npy"
    bucket, key = split_uri(left)
    upload_id = store.client.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    store.client.upload_part(Bucket=bucket, Key=key, PartNumber=1, UploadId=upload_id, Body=b"x" * (5 << 20))
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    monkeypatch.setenv("PAPERLINE_STATE_DIR", str(tmp_path / "state"))
    getattr(get_settings, "cache_clear", lambda: None)()
    try:
        entry = Path(scratch_dir()) / f"run-{dead.pid}@{socket.gethostname()}-k2j_x9ab"
        entry.mkdir()
        (entry / UPLOAD_RECORD).write_text(json.dumps({"uri": left, "upload_id": upload_id}))
        pending = lambda: [u["UploadId"] for u in  # noqa: E731
                           store.client.list_multipart_uploads(Bucket=bucket, Prefix=key).get("Uploads", [])]
        assert pending() == [upload_id]
        scratch_dir()  # no object store to abort it with: kept for a later run
        assert entry.exists() and pending() == [upload_id]
        scratch_dir(store)
        assert not entry.exists() and pending() == [] and not store.exists(left)
    finally:
        getattr(get_settings, "cache_clear", lambda: None)()
