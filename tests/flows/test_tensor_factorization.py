"""End to end through the real stack: `paperline run` twice on real data (produc).

One module, two CLI runs in subprocesses (as a user runs them), sharing the session stack:
the first computes, the second is served from the S3-backed cache; both are visible in Prefect
and MLflow, and the artifacts are objects in the SeaweedFS bucket.
"""

import dataclasses
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.stack

ARGS = ["run", "tensor-factorization", "--set", "datasets=produc", "--set", "n_epochs=4",
        "--set", "baseline_iterations=5", "--set", "rank=3"]


@pytest.fixture(scope="module")
def two_runs(stack, tmp_path_factory, run_cli, cli_env):
    _, info = stack
    out = tmp_path_factory.mktemp("runs")
    runs = []
    for n in (1, 2):
        summary = out / f"summary{n}.json"
        proc = run_cli(cli_env, *ARGS, "--summary-json", str(summary), check=True)
        runs.append((proc, json.loads(summary.read_text())))
    return info, runs


def test_run_prints_results_and_urls(two_runs):
    info, runs = two_runs
    proc, summary = runs[0]
    out = " ".join(proc.stdout.split())
    assert "test RMSE" in out and "p2t2f" in out and "tensorly" in out
    assert summary["prefect_flow_run_url"] in out.replace(" ", "") or summary["prefect_flow_run_id"] in out
    assert summary["prefect_flow_run_url"].startswith(info.prefect_ui_url)
    assert summary["mlflow_run_url"].startswith(info.mlflow_tracking_uri)
    rows = {(r["split"], r["method"]): r for r in summary["rows"]}
    assert set(rows) == {(s, m) for s in ("random", "temporal") for m in ("p2t2f", "tensorly_cp")}
    for r in rows.values():
        assert 0 < r["test_rmse"] < 5
        # iterations run: n_epochs / baseline_iterations (TensorLy's history adds the initialization)
        assert 1 <= r["epochs"] <= (4 if r["method"] == "p2t2f" else 5), r
    # the parameters as MLflow records them; beside the ones as run (`parameters`), not named alike
    assert summary["mlflow_params"]["rank"] == 3 and summary["mlflow_params"]["n_epochs"] == 4
    assert "params" not in summary and summary["parameters"]["rank"] == 3


def test_second_run_is_served_from_the_cache(two_runs):
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    _, runs = two_runs
    states = []
    for _, summary in runs:
        with get_client(sync_client=True) as client:
            flow_run = client.read_flow_run(summary["prefect_flow_run_id"])
            assert flow_run.state.name == "Completed"
            task_runs = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run.id])))
        states.append({t.name.rsplit("-", 1)[0]: t.state.name for t in task_runs} | {
            "_all": sorted(t.state.name for t in task_runs)})
    first, second = states
    assert "Cached" not in first["_all"], first  # a fresh session stack: everything computed once
    assert set(second["_all"]) == {"Cached"}, second
    assert {"load-tensor", "split-tensor", "fit-p2t2f", "fit-tensorly-cp"} <= set(second)
    # Same results from the cache.
    assert runs[0][1]["rows"] == runs[1][1]["rows"]


def test_the_baselines_start_after_the_p2t2f_fits(two_runs):
    """A P²T²F sub-problem is bound to its worker: baselines submitted first held the workers, and
    each P²T²F fit's seconds counted the wait (263-316 s beside a 159-s baseline, 0.54 s alone: a
    fresh-user trial). The fits run first, then the baselines."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId

    _, runs = two_runs
    with get_client(sync_client=True) as client:
        task_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[runs[0][1]["prefect_flow_run_id"]])))
    fits = [t for t in task_runs if t.name.startswith("fit-p2t2f")]
    baselines = [t for t in task_runs if t.name.startswith("fit-tensorly-cp")]
    assert len(fits) == len(baselines) == 2, [t.name for t in task_runs]
    assert max(t.end_time for t in fits) <= min(t.start_time for t in baselines), [
        (t.name, t.start_time, t.end_time) for t in fits + baselines]


def test_second_run_is_compared_with_the_first(two_runs):
    from paperline.infra.tracking import Tracker

    info, runs = two_runs
    (_, first), (proc, second) = runs
    assert first["versus_best_earlier"]["best_run_id"] is None  # a fresh session stack
    versus = second["versus_best_earlier"]
    assert versus["best_run_id"] == first["mlflow_run_id"] and versus["earlier_runs"] == 1
    assert not versus["regression"] and versus["params_key"] == first["versus_best_earlier"]["params_key"]
    assert versus["metrics"]["produc.random.p2t2f.test_rmse"]["ratio"] == 1.0  # served from the cache
    out = " ".join(proc.stdout.split())
    assert "no regression against the best of 1 earlier run(s)" in out and "all 4 metric(s) equal" in out
    tags = Tracker(info.mlflow_tracking_uri).client.get_run(second["mlflow_run_id"]).data.tags
    assert tags["paperline.best_earlier_run_id"] == first["mlflow_run_id"] and tags["paperline.regression"] == "false"
    # every fit came from the cache: the run is a copy of the first's results, which compare leaves
    # out (listed as a run of its own, with the first's very fit_s, and taken as the best: a trial)
    assert tags["paperline.cached_from_flow_run_id"] == first["prefect_flow_run_id"], tags
    assert "paperline.cached_from_flow_run_id" not in Tracker(info.mlflow_tracking_uri).client.get_run(
        first["mlflow_run_id"]).data.tags
    assert "every fit was served from Prefect's task cache (fitted by flow run " in out


def test_a_run_is_a_cached_copy_only_when_every_fit_came_from_the_cache():
    from paperline.flows.tensor_factorization import cached_copy_of

    a, b = {"id": "a", "name": "first-run"}, {"id": "b", "name": "second-run"}
    assert cached_copy_of([{"flow_run": a}, {"flow_run": a}], "b") == a
    assert cached_copy_of([{"flow_run": a}, {"flow_run": b}], "b") is None  # one fit ran here
    assert cached_copy_of([{"flow_run": a}, {}], "b") is None  # a fit that does not say
    assert cached_copy_of([], "b") is None


def test_mlflow_run_has_params_metrics_and_artifacts_in_s3(two_runs):
    from paperline.infra.storage import ObjectStore
    from paperline.infra.tracking import Tracker

    info, runs = two_runs
    summary = runs[1][1]
    client = Tracker(info.mlflow_tracking_uri).client
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED"
    assert run.data.tags["prefect.flow_run_id"] == summary["prefect_flow_run_id"]
    assert run.data.params["rank"] == "3"
    assert "produc.random.p2t2f.test_rmse" in run.data.metrics
    assert "produc.random.p2t2f.fit_s" in run.data.metrics and "produc.random.p2t2f.wall_s" in run.data.metrics
    history = client.get_metric_history(run.info.run_id, "produc.random.p2t2f.validation_rmse")
    assert [m.step for m in history] == [1, 2, 3, 4]
    assert "secret" not in json.dumps(run.data.params).lower()
    names = {Path(a.path).name for a in client.list_artifacts(run.info.run_id)}
    assert {"convergence.png", "temporal_factors.png", "results.parquet", "factors"} <= names
    objects = ObjectStore.from_stack(info).list(f"s3://{info.artifacts_bucket}/")
    assert any(run.info.run_id in o and o.endswith("convergence.png") for o in objects)
    assert any(run.info.run_id in o and o.endswith("factors_produc_random.npz") for o in objects)
    # The committed fits in the data bucket are the ones the summary names.
    store = ObjectStore.from_stack(info)
    for uri in summary["artifacts"]["fits"]:
        assert store.exists(uri)


def test_missing_s3_data_is_one_clear_line(stack, run_cli, cli_env):
    settings, info = stack
    env = {**cli_env, "PAPERLINE_N_WORKERS": "1"}
    uri = f"s3://{info.data_bucket}/nope/missing.parquet"
    proc = run_cli(env, "run", "tensor-factorization", "--set", f"data={uri}")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert "Traceback" not in out
    assert f"error: data='{uri}': no such object in S3" in " ".join(out.split())
    assert "flow run" not in out.lower()  # refused before a flow run (and an MLflow run) was made
    uri = "s3://no-such-bucket-here/x.parquet"
    proc = run_cli(env, "run", "tensor-factorization", "--set", f"data={uri}")
    assert proc.returncode == 1
    assert f"error: data='{uri}': no such bucket 'no-such-bucket-here'" in " ".join((proc.stdout + proc.stderr).split())
    # a damaged object is refused before the flow run too, by its URI, as a local file is (it
    # failed the flow run, leaving a failed MLflow run, and was called "<24203 bytes>": a trial)
    import io

    from paperline.flows.tensor_factorization import TensorFactorizationParameters
    from paperline.infra.storage import ObjectStore
    from paperline.kernels.errors import InputError  # (the CLI says either kind in one line)
    from paperline.kernels.tensor.datasets import load_dataset, write_coo_parquet

    buf = io.BytesIO()
    write_coo_parquet(load_dataset("produc"), buf)
    store, uri = ObjectStore.from_stack(info), f"s3://{info.data_bucket}/test-damaged/trunc.parquet"
    store.put_bytes_to(buf.getvalue()[: len(buf.getvalue()) // 2], uri)
    with pytest.raises(InputError, match=rf"^data='{uri}': a damaged or truncated Parquet file"):
        TensorFactorizationParameters(data=uri).validate_on_stack(info, store)
    store.put_bytes_to(buf.getvalue(), uri)
    with pytest.raises(InputError, match=rf"^n_parts=99: .*data"):  # what the flow checked only after loading
        TensorFactorizationParameters(data=uri, n_parts=99).validate_on_stack(info, store)
    TensorFactorizationParameters(data=uri).validate_on_stack(info, store)
    # a prefix without its slash said only "no such object in S3" (a trial)
    from paperline.flows.tensor_factorization import check_s3_data
    from paperline.infra.errors import InputError as FlowInputError

    with pytest.raises(FlowInputError, match=r"test-damaged': an S3 prefix \(a folder\) holding objects, not an object"):
        check_s3_data(store, f"s3://{info.data_bucket}/test-damaged")


def test_a_local_data_path_is_made_absolute(tmp_path, monkeypatch):
    """``data=mine.parquet`` and ``data=/abs/mine.parquet`` are the same parameters (cache keys,
    comparisons with earlier runs); S3 URIs are kept as given."""
    from paperline.flows.tensor_factorization import TensorFactorizationParameters

    monkeypatch.chdir(tmp_path)
    rel = TensorFactorizationParameters(data="mine.parquet")
    assert rel.data == str(tmp_path.resolve() / "mine.parquet")
    assert rel == TensorFactorizationParameters(data=str(tmp_path / "mine.parquet"))
    assert TensorFactorizationParameters(data="s3://bucket/x.parquet").data == "s3://bucket/x.parquet"
    from pydantic import ValidationError

    for typo in ("s3:/bucket/x.parquet", "S3://bucket/x.parquet"):  # taken for local paths (a trial)
        with pytest.raises(ValidationError, match="looks like an S3 URI: start it with s3://"):
            TensorFactorizationParameters(data=typo)
    # a prefix was "not a readable Parquet file (... 0 bytes)"; http://h/x a local ./http:/h/x (trials)
    for uri, match in (("s3://bucket/mine/", "an S3 prefix"), ("s3://bucket", "an S3 prefix"),
                       ("http://example.com/x.parquet", "unsupported scheme http://"),
                       ("s3://Bad_Bucket/x.parquet", "not a valid S3 bucket name")):
        with pytest.raises(ValidationError, match=match):
            TensorFactorizationParameters(data=uri)


def test_a_user_file_is_scoped_by_its_name():
    """Runs on different files get different metric names, so compare never ranks the RMSE of one
    tensor against another's; the name is one MLflow accepts."""
    from paperline.tasks.tensor import user_scope

    assert user_scope("/home/me/mine.parquet") == "user-mine"
    assert user_scope("s3://bucket/in/ratings 2026.v2.parquet") == "user-ratings_2026_v2"
    assert user_scope("s3://bucket/in/.parquet") == "user-_parquet"  # a dot file's stem is its name


def test_a_run_on_user_data_records_what_it_fitted(stack, run_cli, cli_env, tmp_path):
    """A tensor of the user's own (here produc, written as COO Parquet rows) is fitted under the
    file's scope (`user-mine`), and MLflow's `datasets` parameter is empty: it used to hold the bundled default
    list, which that run never touched. Then other content at the same path, and an S3 object
    replaced under its key, are read again and compared with the runs of their content (four
    runs: the suite's time)."""
    from paperline.infra.tracking import Tracker
    from paperline.kernels.tensor.datasets import load_dataset, write_coo_parquet

    _, info = stack
    path = tmp_path / "mine.parquet"
    produc = load_dataset("produc")
    write_coo_parquet(produc, path)
    first = path.read_bytes()
    summary = tmp_path / "summary.json"
    args = ["run", "tensor-factorization", "--set", f"data={path}",
            "--set", "n_epochs=2", "--set", "baseline_iterations=3", "--set", "rank=3", "--set", "splits=random",
            "--summary-json", str(summary)]
    proc = run_cli(cli_env, *args, check=True)
    run = Tracker(info.mlflow_tracking_uri).client.get_run(json.loads(summary.read_text())["mlflow_run_id"])
    assert run.data.params["datasets"] == "[]" and run.data.params["data"] == str(path)
    assert "user-mine.random.p2t2f.test_rmse" in run.data.metrics
    out = " ".join(proc.stdout.split())
    assert "held-out RMSE (the file's own units)" in out and "standardized" not in out, out
    assert json.loads(summary.read_text())["parameters"]["datasets"] == []  # not the bundled default list
    # the same path with other content (here years as 't', which pass the random split) is not an
    # earlier run of these parameters (it was compared with the old content's runs and flagged a
    # REGRESSION: a fresh-user trial); and the run says the empty leading steps were fitted
    # (nothing did: a trial)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"i": [k % 5 for k in range(600)], "j": [k // 5 % 4 for k in range(600)],
                             "t": [1995 + k // 20 for k in range(600)], "value": [float(k % 7) for k in range(600)]}),
                   path)
    proc = run_cli(cli_env, *args, check=True)
    out = " ".join(proc.stdout.split())
    assert "first finished run with these parameters" in out, proc.stdout[-3000:]
    hint = "warning: user-mine: 't' starts at 1995, so 1995 empty time steps come first: indices are positions 0, 1, ...; subtract 1995"
    assert f"{hint}: the fit above counted those empty indices" in out, proc.stdout[-3000:]
    # and before the fits, once: the flow's log record of it is left off the terminal (it came
    # only under the results, after the fits: a fresh-user trial)
    early = f"{hint}: the fits count those empty indices"
    assert out.count(early) == 1 and out.index(early) < out.index("held-out RMSE"), proc.stdout[-3000:]
    # the flow logs it as it loads the data (a deployment's run has no `paperline run` to print it)
    import logging

    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import LogFilter, LogFilterFlowRunId

    with get_client(sync_client=True) as client:
        logs = client.read_logs(LogFilter(flow_run_id=LogFilterFlowRunId(
            any_=[json.loads(summary.read_text())["prefect_flow_run_id"]])))
    assert [log.level for log in logs if log.message == early] == [logging.WARNING], [log.message for log in logs]
    # an S3 object replaced under the same key is read again (it was served from the task cache
    # with the old content's results: a trial), and its run is compared with the runs of its
    # content, wherever that lay: the local file's first content (the path was part of the key:
    # the same file uploaded was a "first finished run", another trial), then content of its own
    from paperline.infra.storage import ObjectStore

    store, uri = ObjectStore.from_stack(info), f"s3://{info.data_bucket}/test-user-data/{tmp_path.name}/mine.parquet"
    doubled = tmp_path / "doubled.parquet"
    write_coo_parquet(dataclasses.replace(produc, values=produc.values * 2.0), doubled)
    rmse = []
    for content, said in ((first, "against the best of 1 earlier run(s)"),
                          (doubled.read_bytes(), "first finished run with these parameters")):
        store.put_bytes_to(content, uri)
        proc = run_cli(cli_env, *args[:3], f"data={uri}", *args[4:], check=True)
        assert said in " ".join(proc.stdout.split()), proc.stdout[-3000:]
        rmse.append(json.loads(summary.read_text())["rows"][0]["test_rmse"])
    assert rmse[0] != rmse[1]


def test_the_same_datasets_and_splits_in_another_order_are_compared_alike():
    """`--set datasets=flights,produc,kinetic --set splits=temporal,random` was served from the
    cache but said "first finished run with these parameters" (a trial): the lists are kept in
    the defaults' order (others after them, by name), so the run's key, fits and headlines are
    those of the same set in any order."""
    from paperline.flows.tensor_factorization import TensorFactorizationParameters as Params
    from paperline.infra.regression import params_key

    given = Params(datasets=["flights", "produc", "kinetic"], splits=["temporal", "random"])
    assert (given.datasets, given.splits) == (Params().datasets, Params().splits) == (["kinetic", "produc", "flights"],
                                                                                        ["random", "temporal"])
    assert params_key(given.model_dump()) == params_key(Params().model_dump())
    assert Params(datasets=["produc", "flights"]).datasets == ["produc", "flights"]
