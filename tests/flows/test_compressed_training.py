"""End to end through the real stack: `paperline run compressed-training` as a user runs it, two
ranks on the flow's Dask workers (gloo rendezvous set up by the flow), `none` and `fft` compared in
MLflow; a NaN step skipped and logged; a rank killed mid-training and every rank resumed from the
S3 checkpoints to the accuracy of the uninterrupted run; bad input refused with a clear error."""

import json
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.stack

SMALL = ["epochs=2", "max_steps_per_epoch=12", "batch_size=32", "model_options={\"width\": 8, \"blocks\": 1}",
         "n_train=2000"]


def _run(cli_env, *sets, summary=None, timeout=600):
    args = [sys.executable, "-m", "paperline.flows.cli", "run", "compressed-training", "--preset", "demo"]
    for s in sets:
        args += ["--set", s]
    if summary is not None:
        args += ["--summary-json", str(summary)]
    workers = "1" if "world_size=1" in sets else "2"  # the demo's two ranks: one rank per worker
    return subprocess.run(args, env={**cli_env, "PAPERLINE_N_WORKERS": workers}, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def trained(stack, cli_env, tmp_path_factory):
    _, info = stack
    out = tmp_path_factory.mktemp("ct")
    prefix = f"s3://{info.data_bucket}/test-ct-{int(time.time())}"
    proc = _run(cli_env, *SMALL, "nan_steps=3", f"checkpoint_prefix={prefix}/a", summary=out / "a.json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return info, proc, json.loads((out / "a.json").read_text()), prefix, out


def test_none_and_fft_are_compared_with_bytes_and_accuracy(trained):
    _, proc, summary, _, _ = trained
    runs = {r["name"]: r for r in summary["runs"]}
    assert set(runs) == {"none", "fft"}
    # --summary-json holds the parameters as run (the preset with the --set overrides)
    assert summary["parameters"]["compressors"] == ["none", "fft"] and summary["parameters"]["nan_steps"] == [3]
    assert summary["parameters"]["model_options"] == {"width": 8, "blocks": 1}
    assert runs["none"]["compression_ratio"] == 1 and runs["fft"]["compression_ratio"] > 10
    assert runs["fft"]["bytes_sent_per_step"] * 10 < runs["none"]["bytes_sent_per_step"]
    assert all(0 <= r["final_test_accuracy_pct"] <= 100 for r in runs.values())
    out = " ".join(proc.stdout.split())
    assert "final epoch per compressor" in out and "bytes vs none" in out and "x fewer" in out
    assert "skipped 1 step(s) with NaN/inf loss or gradients (global steps [3])" in out


def test_mlflow_has_a_run_per_compressor_with_epoch_metrics_and_the_plots(trained):
    from paperline.infra.tracking import Tracker

    info, _, summary, _, _ = trained
    client = Tracker(info.mlflow_tracking_uri).client
    names = {a.path for a in client.list_artifacts(summary["mlflow_run_id"])}
    assert {"accuracy_vs_bytes.png", "accuracy_vs_time.png", "comparison.json", "collectives_bandwidth.png"} <= names
    logged = json.loads(open(client.download_artifacts(summary["mlflow_run_id"], "comparison.json")).read())
    assert [r["versus"]["params_key"] for r in logged["runs"]] == [r["versus"]["params_key"] for r in summary["runs"]]
    sweep = summary["collectives"]
    assert [r["bytes"] for r in sweep] == [1024 * 4**i for i in range(7)]  # 1 KiB .. 4 MiB in x4 steps
    assert all(r["lp"]["algbw_bytes_per_s"] > 0 and r["backend"]["algbw_bytes_per_s"] > 0 for r in sweep)
    for r in summary["runs"]:
        run = client.get_run(r["mlflow_run_id"])
        assert run.data.tags["mlflow.parentRunId"] == summary["mlflow_run_id"]
        assert run.data.metrics["skipped_steps_total"] == 1
        # every parameter the result depends on is on the compared (child) run
        assert {"seed": "0", "momentum": "0.9", "n_train": "2000", "max_steps_per_epoch": "12", "isgd_stop": "3",
                "compressor": r["name"]}.items() <= run.data.params.items()
        hist = client.get_metric_history(r["mlflow_run_id"], "test_accuracy_pct")
        assert [m.step for m in hist] == [0, 1]
        for key in ("bytes_sent_per_step", "compression_ratio", "wall_s"):  # one point per epoch, no extra
            assert sorted(m.step for m in client.get_metric_history(r["mlflow_run_id"], key)) == [0, 1], key
        for key in ("bytes_sent_per_step", "compression_ratio", "compress_s", "decompress_s", "step_s", "train_loss"):
            assert key in run.data.metrics, key


def test_a_rerun_served_from_the_task_cache_says_so(trained, cli_env):
    """The first run's command again: every compressor's training is served from the task cache, and
    the summary and each MLflow run name the flow run that trained it (a trial's re-run read "all 3
    metrics equal" as a second training)."""
    from paperline.infra.tracking import Tracker

    info, _, summary, prefix, out = trained
    proc = _run(cli_env, *SMALL, "nan_steps=3", f"checkpoint_prefix={prefix}/a", summary=out / "a2.json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    again = json.loads((out / "a2.json").read_text())
    said = " ".join(proc.stdout.split())
    client = Tracker(info.mlflow_tracking_uri).client
    # the Linear Pipelining timings are the first run's too (printed as if measured now: a trial)
    assert f"x (timed by flow run {again['runs'][0]['cached_from']['name']}, whose result the task cache served: " \
           "not measured now)" in said, said
    assert "not measured now" not in " ".join(trained[1].stdout.split())
    for first, cached in zip(summary["runs"], again["runs"]):
        assert cached["cached_from"]["id"] == summary["prefect_flow_run_id"] != again["prefect_flow_run_id"]
        assert f"{cached['name']}: trained by an earlier flow run of this configuration " \
               f"({cached['cached_from']['name']}, {summary['prefect_flow_run_id']}) and served from the task cache" in said
        assert cached["final_test_accuracy_pct"] == first["final_test_accuracy_pct"]
        assert cached["versus"]["best_run_id"] == first["mlflow_run_id"]  # compared with the run that trained
        tags = client.get_run(cached["mlflow_run_id"]).data.tags
        assert tags["paperline.cached_from_flow_run_id"] == summary["prefect_flow_run_id"]
        assert "paperline.cached_from_flow_run_id" not in client.get_run(first["mlflow_run_id"]).data.tags


def test_a_killed_rank_resumes_from_the_checkpoints_to_the_same_accuracy(trained, cli_env):
    from paperline.infra.storage import ObjectStore

    info, _, summary, prefix, out = trained
    # global step 15 = epoch 1, step 3: after the epoch-0 checkpoints, before the end; the restarted
    # ranks meet again within timeout_s (at 20 s, one rank's restarted worker missed it under the load
    # of the parallel suite)
    proc = _run(cli_env, *SMALL, "nan_steps=3", "compressors=none", "crash_rank_at_step=15", "timeout_s=60",
                "collectives_max_bytes=0",
                f"checkpoint_prefix={prefix}/b", summary=out / "b.json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (run,) = json.loads((out / "b.json").read_text())["runs"]
    assert run["restarts"] == 1 and run["resumed_from"] == [None, 0] and run["failures"]
    # the failure is told as the drill's (the first error seen is often a survivor's gloo error)
    assert run["failures"][0].startswith("attempt 0, with the crash drill armed (rank 1 exits at global step 15): ")
    assert "none: restarted 1 time(s) after a failure, from the checkpoints of epoch 0; attempt 0, with the crash drill" \
        in " ".join(proc.stdout.split()), proc.stdout[-3000:]
    clean = next(r for r in summary["runs"] if r["name"] == "none")
    assert abs(run["final_test_accuracy_pct"] - clean["final_test_accuracy_pct"]) <= 1.0
    # the same configuration as the first run's `none`: compared with it (bytes per step are equal)
    assert run["versus"]["best_run_id"] == clean["mlflow_run_id"]
    assert run["versus"]["metrics"]["bytes_sent_per_step"]["ratio"] == 1.0
    uris = ObjectStore.from_stack(info).list(f"{prefix}/b/")
    assert sum(u.endswith("epoch-0001.pt") for u in uris) == 2  # each rank wrote its own checkpoint
    # the drill again on the now complete checkpoints (another step: not a cached task) cannot run: it says so
    proc = _run(cli_env, *SMALL, "nan_steps=3", "compressors=none", "crash_rank_at_step=16", "timeout_s=60",
                "collectives_max_bytes=0", f"checkpoint_prefix={prefix}/b")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = " ".join(proc.stdout.split())
    assert "none: the crash drill did not run (crash_rank_at_step=16 was not reached" in out
    assert "children): accuracy_vs_bytes.png, accuracy_vs_time.png Prefect flow run:" in out  # no sweep, no such plot
    parent_url = out.split("MLflow run: ")[1].split()[0]
    assert out.count(parent_url) == 1, out  # once (it was printed twice)


def test_a_checkpoint_bucket_that_does_not_exist_is_refused_before_the_flow_run(cli_env):
    """It failed in the flow with botocore's NoSuchBucket, after an MLflow run was made (the other
    refusals, in process and without a stack: tests/flows/test_cli.py)."""
    proc = _run(cli_env, *SMALL, "checkpoint_prefix=s3://no-such-bucket-9/ck", timeout=300)
    assert proc.returncode == 1 and "Traceback" not in proc.stderr
    out = " ".join((proc.stdout + proc.stderr).split())
    assert "error: checkpoint_prefix='s3://no-such-bucket-9/ck': no such bucket 'no-such-bucket-9'" in out, out
    assert "flow run" not in out.lower()


def test_one_rank_trains_and_times_no_collective(stack, cli_env, tmp_path):
    """world_size=1 printed and logged Linear Pipelining / backend "ratios" with no peer to talk
    to (a fresh-user trial): one rank trains, and the collectives are said to be not timed."""
    _, info = stack
    summary = tmp_path / "one.json"
    proc = _run(cli_env, *SMALL, "world_size=1", "compressors=none",
                f"checkpoint_prefix=s3://{info.data_bucket}/test-ct-one-{int(time.time())}", summary=summary)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(summary.read_text())
    assert "collectives" not in result and [r["name"] for r in result["runs"]] == ["none"]
    out = " ".join(proc.stdout.split())
    assert "world_size=1: no collective between ranks ran" in out and "collectives: not timed" in out and "Linear Pipelining allreduce" not in out, out


def test_a_diverged_run_fails_naming_lr_without_restarting_its_ranks(stack, cli_env):
    """lr=1e6 finished FINISHED at chance accuracy (a fresh-user trial): now the run fails at its
    first epoch's end with one line naming lr, and its ranks are not restarted into the same
    divergence."""
    _, info = stack
    proc = _run(cli_env, *SMALL, "lr=1e6", "compressors=none", "world_size=1", "collectives_max_bytes=0",
                f"checkpoint_prefix=s3://{info.data_bucket}/test-ct-diverge-{int(time.time())}", timeout=300)
    out = " ".join((proc.stdout + proc.stderr).split())
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, out[-3000:]
    assert "lr=1000000.0: training diverged: the mean training loss of epoch 0 was" in out, out[-3000:]
    assert "restarting all" not in out, out[-3000:]


def test_a_configuration_trained_now_by_another_run_is_refused(stack):
    """Two runs of one configuration both trained from scratch into the same checkpoints (a
    trial): the second is refused, naming the run that holds it; once released it is free."""
    from paperline.flows.compressed_training import TRAIN_LEASE, training_held
    from paperline.infra.errors import InputError
    from paperline.infra.storage import ObjectStore

    _, info = stack
    store = ObjectStore.from_stack(info)
    prefix = f"s3://{info.data_bucket}/test-ct-lease-{int(time.time())}/abc123"
    with store.lease(f"{prefix}/{TRAIN_LEASE}", "compressed-training flow run brave-otter (0f3c)", wait=False):
        with pytest.raises(InputError, match=r"^compressors='fft': this configuration is being trained now by "
                                             r"compressed-training flow run brave-otter \(0f3c\) .*: wait for it to "
                                             r"end, then run this again to take its result from the task cache"):
            with training_held(store, prefix, "fft"):
                pass
    with training_held(store, prefix, "fft") as still_held:  # released: free
        assert store.exists(f"{prefix}/{TRAIN_LEASE}")
        still_held()  # (held: no error)
    assert not store.exists(f"{prefix}/{TRAIN_LEASE}")
    # refused before the flow run too (in the flow it left a Failed flow run and a FAILED MLflow run: a trial)
    from paperline.flows.compressed_training import CompressedTrainingParameters

    params = CompressedTrainingParameters(compressors=["none", "fft"], checkpoint_prefix=prefix.rsplit("/", 1)[0])
    held = params.checkpoint_prefixes(info.data_bucket)["fft"]
    params.validate_on_stack(info, store)  # free
    with store.lease(f"{held}/{TRAIN_LEASE}", "compressed-training flow run calm-heron (1a2b)", wait=False):
        with pytest.raises(InputError, match=r"^compressors='fft': this configuration is being trained now by "
                                             r"compressed-training flow run calm-heron \(1a2b\)"):
            params.validate_on_stack(info, store)
