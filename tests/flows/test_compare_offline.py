"""`paperline compare` without the stack: its selection and sorting against an MLflow SQLite store
(the SQL the local server runs, in this process), the hint for a filter's value of the wrong type,
and the plot's axes."""

import json

import pytest

HEADLINES = [["final_test_accuracy_pct", True], ["bytes_sent_per_step", False]]


class LocalTracker:
    """What :func:`compare_runs` uses of a :class:`Tracker`, on a SQLite store (no Prefect to ask)."""

    def __init__(self, uri):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(uri)

    def end_orphaned_runs(self, experiment_ids):
        return []


def _run(client, experiment_id, name, flow_run, accuracy, bytes_sent, cached_from=None):
    """A compressor's run as compressed training logs it: per-epoch series, step = epoch."""
    tags = {"paperline.params_key": name, "paperline.headlines": json.dumps(HEADLINES), "prefect.flow_run_id": flow_run,
            **({"paperline.cached_from_flow_run_id": cached_from} if cached_from else {})}
    run = client.create_run(experiment_id, run_name=name, tags=tags)
    client.log_param(run.info.run_id, "compressor", name)
    for epoch in range(2):
        client.log_metric(run.info.run_id, "train_loss", 1.0 / (epoch + 1), step=epoch)
        client.log_metric(run.info.run_id, "bytes_sent_per_step", bytes_sent, step=epoch)
    client.log_metric(run.info.run_id, "final_test_accuracy_pct", accuracy)
    client.set_terminated(run.info.run_id)
    return run.info.run_id


@pytest.fixture(scope="module")
def training(tmp_path_factory):
    """Flow run A trained fft and topk; flow run B's fft came from the task cache (a copy of A's)."""
    root = tmp_path_factory.mktemp("mlflow")
    tracker = LocalTracker(f"sqlite:///{root}/mlflow.db")
    exp = tracker.client.create_experiment("compressed-training", artifact_location=(root / "artifacts").as_uri())
    ids = {"fft": _run(tracker.client, exp, "fft", "flow-a-0000-1111", 93.0, 100.0),
           "topk": _run(tracker.client, exp, "topk", "flow-a-0000-1111", 90.0, 50.0)}
    ids["copy"] = _run(tracker.client, exp, "fft", "flow-b-2222-3333", 93.0, 100.0, cached_from="flow-a-0000-1111")
    return tracker, ids


def test_cached_copies_are_left_out_by_default_and_marked_with_all_runs(training, tmp_path):
    """A re-run served from the task cache logs the earlier run's metrics again: `compare
    compressed-training` showed exact duplicate rows (a trial: 3 pairs in 10 rows)."""
    from paperline.flows.compare import compare_runs

    tracker, ids = training
    result = compare_runs(tracker, "compressed-training", [], top=10, out_dir=tmp_path)
    assert [row[0] for row in result["rows"]] == [ids["fft"][:8], ids["topk"][:8]]
    assert "1 cached copy left out (runs repeating an earlier run's result, served from Prefect's task cache: tag " \
        "paperline.cached_from_flow_run_id): --all-runs shows them" in result["note"], result["note"]
    assert "cached copy of" not in result["columns"]
    # --top 3 --metric bytes_sent_per_step showed the same result twice (the trial)
    result = compare_runs(tracker, "compressed-training", ["bytes_sent_per_step"], top=3, out_dir=tmp_path)
    assert [row[0] for row in result["rows"]] == [ids["topk"][:8], ids["fft"][:8]]
    result = compare_runs(tracker, "compressed-training", [], top=10, out_dir=tmp_path, all_runs=True)
    marks = {row[0]: row[result["columns"].index("cached copy of")] for row in result["rows"]}
    assert marks == {ids["fft"][:8]: "", ids["topk"][:8]: "", ids["copy"][:8]: f"run {ids['fft'][:8]}"}
    assert "cached cop" not in result["note"]
    import pyarrow.parquet as pq

    table = pq.read_table(result["parquet"]).to_pydict()
    assert dict(zip(table["run_id"], table["cached_from_flow_run_id"]))[ids["copy"]] == "flow-a-0000-1111"
    # a filter matching only a copy: the error says what the default selection left out
    from paperline.infra.errors import InputError

    with pytest.raises(InputError, match="cached copies of earlier runs' results\\) do: --all-runs lists them"):
        compare_runs(tracker, "compressed-training", [], "tags.`prefect.flow_run_id` = 'flow-b-2222-3333'",
                     out_dir=tmp_path)


def test_ascending_applies_to_the_headline_metrics_too(training, tmp_path):
    """`compare compressed-training --ascending --top 3` still listed the best accuracy first (a trial)."""
    from paperline.flows.compare import compare_runs

    tracker, ids = training
    best_first = compare_runs(tracker, "compressed-training", [], out_dir=tmp_path)
    assert [row[0] for row in best_first["rows"]] == [ids["fft"][:8], ids["topk"][:8]]
    assert "--ascending" not in best_first["note"]
    for metrics in ([], ["final_test_accuracy_pct"]):
        result = compare_runs(tracker, "compressed-training", metrics, out_dir=tmp_path, ascending=True)
        assert [row[0] for row in result["rows"]] == [ids["topk"][:8], ids["fft"][:8]], metrics
        assert result["note"].startswith("lowest final_test_accuracy_pct first, as --ascending asks (its pipeline "
                                         "ranks it highest first)"), result["note"]
    # a metric best low is ascending anyway: nothing to say
    result = compare_runs(tracker, "compressed-training", ["bytes_sent_per_step"], out_dir=tmp_path, ascending=True)
    assert "--ascending" not in result["note"]


def test_a_location_made_per_run_is_not_a_column(tmp_path):
    """Two gemm runs of other sizes showed params.output, each run's default location named by
    its flow run id, as a difference worth a column (a trial); a location given by the user is one."""
    from paperline.flows.compare import compare_runs

    tracker = LocalTracker(f"sqlite:///{tmp_path}/mlflow.db")
    exp = tracker.client.create_experiment("gemm", artifact_location=(tmp_path / "artifacts").as_uri())
    ids = []
    for n, flow_run, output in ((512, "f1a2-0000", "s3://paperline-data/gemm/f1a2-0000/result.npy"),
                                (1024, "f3b4-1111", "s3://paperline-data/gemm/f3b4-1111/result.npy"),
                                (1024, "f5c6-2222", "s3://mine/c.npy")):
        run = tracker.client.create_run(exp, run_name=f"n{n}", tags={"prefect.flow_run_id": flow_run})
        tracker.client.log_param(run.info.run_id, "n", n)
        tracker.client.log_param(run.info.run_id, "output", output)
        tracker.client.log_metric(run.info.run_id, "throughput_gflop_per_s", n / 10)
        tracker.client.set_terminated(run.info.run_id)
        ids.append(run.info.run_id)
    both = f"attributes.run_id IN ('{ids[0]}', '{ids[1]}')"
    result = compare_runs(tracker, "gemm", ["throughput_gflop_per_s"], both, out_dir=tmp_path)
    assert [c for c in result["columns"] if c.startswith("params.")] == ["params.n"], result["columns"]
    import pyarrow.parquet as pq

    assert sorted(pq.read_table(result["parquet"]).to_pydict()["params.output"])[0].endswith("f1a2-0000/result.npy")
    result = compare_runs(tracker, "gemm", ["throughput_gflop_per_s"], out_dir=tmp_path)
    assert [c for c in result["columns"] if c.startswith("params.")] == ["params.n", "params.output"]


def test_a_parameter_compared_with_a_number_gets_a_hint(training, tmp_path):
    """`--filter "params.epochs = 2"` failed with MLflow's bare "Expected a quoted string value" (a trial)."""
    from paperline.flows.compare import compare_runs, filter_hint
    from paperline.infra.errors import InputError

    tracker, _ = training
    with pytest.raises(InputError) as raised:
        compare_runs(tracker, "compressed-training", [], "params.epochs = 2", out_dir=tmp_path)
    text = str(raised.value)
    assert "MLflow rejected it: " in text and "Expected a quoted string value" in text, text
    assert "parameters and tags are strings in MLflow, compared as strings: quote the value (params.epochs = '2'); " \
        "metrics are numbers, unquoted" in text, text
    assert "(params.epochs = '2')" in filter_hint("Expected a quoted string value for parameter",
                                                 "params.seed = '1' and params.epochs = 2")
    assert "with =, !=, LIKE or ILIKE only (params.epochs = '2')" in \
        filter_hint("Expected a quoted string value for parameter", "params.epochs > 2")
    assert "leave the value unquoted (metrics.wall_s < 10)" in \
        filter_hint("Expected numeric value type for metric. Found '10'", "metrics.wall_s < '10'")
    assert filter_hint("Invalid clause(s) in filter string", "params.x") == ""


def test_the_plot_says_what_steps_count_and_shows_identical_lines(tmp_path, monkeypatch):
    """compressed training logs per epoch: the axis read "step" (a trial); a cached copy's line
    hid the run it repeats, its legend entry naming a line not seen."""
    from types import SimpleNamespace

    from matplotlib.axes import Axes

    from paperline.flows.compare import _overlay_plot, same_as, step_unit

    assert [step_unit("compressed-training", m) for m in ("train_loss", "collectives.lp_over_backend")] == \
        ["epoch", "message size (bytes)"]
    assert [step_unit(e, m) for e, m in (("gemm", "scaling.throughput_gflop_per_s"), ("nas", "hypervolume"),
                                         ("compare-test", "loss"))] == ["workers", "evaluations done", "step"]
    assert same_as([("a", [(0, 1.0)]), ("b", [(0, 2.0)]), ("c", [(0, 1.0)])]) == [None, None, "a"]
    drawn = {"xlabel": [], "labels": []}
    set_xlabel, plot = Axes.set_xlabel, Axes.plot
    monkeypatch.setattr(Axes, "set_xlabel", lambda ax, text, *a, **k: (drawn["xlabel"].append(text),
                                                                        set_xlabel(ax, text, *a, **k))[1])
    monkeypatch.setattr(Axes, "plot", lambda ax, *a, **k: (drawn["labels"].append((k.get("label"), k.get("linestyle"))),
                                                           plot(ax, *a, **k))[1])
    runs = [SimpleNamespace(info=SimpleNamespace(run_id=f"{i}abcdef", run_name="fft")) for i in range(2)]
    histories = {(r.info.run_id, "train_loss"): [(e, 1.0 / (e + 1)) for e in range(3)] for r in runs}
    _overlay_plot(runs, ["train_loss"], histories, tmp_path / "plot.png", "compressed-training")
    assert drawn["xlabel"] == ["epoch"]
    assert drawn["labels"] == [("fft (0abcde)", "-"), ("fft (1abcde) = fft (0abcde)", "--")]


def test_nas_campaigns_of_other_objectives_or_reference_points_ranked_together_get_a_note(tmp_path):
    """A 3-objective campaign's hypervolume (524, with its own reference point) ranked above
    2-objective ones' (5.7) without a word (a trial): hypervolumes compare only in one objective
    space from one reference point."""
    from paperline.flows.compare import compare_runs

    tracker = LocalTracker(f"sqlite:///{tmp_path}/mlflow.db")
    exp = tracker.client.create_experiment("nas", artifact_location=(tmp_path / "artifacts").as_uri())
    two = json.dumps({"objectives": ["val_accuracy_pct", "model_size_mb"]})
    three = json.dumps({"objectives": ["val_accuracy_pct", "model_size_mb", "latency_s"]})
    for name, options, ref, value in (("a", two, "None", 5.7), ("b", two, "None", 3.6), ("c", three, "[1, 2, 3]", 524.1)):
        run = tracker.client.create_run(exp, run_name=name, tags={
            "paperline.params_key": name, "paperline.headlines": json.dumps([["final_hypervolume", True]])})
        for key, v in (("problem", "nasbench201-cifar10"), ("problem_options", options), ("ref_point_used", ref)):
            tracker.client.log_param(run.info.run_id, key, v)
        tracker.client.log_metric(run.info.run_id, "final_hypervolume", value)
        tracker.client.set_terminated(run.info.run_id)
    tracker.client.log_param(run.info.run_id, "budget", "40")  # campaign c, extended to 60 (its tag): shown as 60
    tracker.client.set_tag(run.info.run_id, "paperline.budget", "60")
    result = compare_runs(tracker, "nas", [], top=10, out_dir=tmp_path)
    rows = {row[1]: row[result["columns"].index("params.budget")] for row in result["rows"]}
    assert rows == {"a": "", "b": "", "c": "60"}, rows
    note = result["note"]
    assert "ranked across 2 problem options or objectives (objectives=val_accuracy_pct+model_size_mb+latency_s, " \
        "objectives=val_accuracy_pct+model_size_mb), whose final_hypervolume" in note, note
    assert "ranked across 2 reference points (None, [1, 2, 3]), whose final_hypervolume values do not compare: " \
        "--filter \"params.ref_point_used = 'None'\" ranks one" in note, note
    import shlex  # the filter it names, pasted into a shell, is the filter (its JSON holds double quotes)

    hint = note.split("--filter ", 1)[1].split(" ranks one")[0]
    assert shlex.split(hint) == [f"params.problem_options = '{three}'"], hint
    one = compare_runs(tracker, "nas", [], f"params.problem_options = '{two}'", top=10, out_dir=tmp_path)["note"]
    assert "ranked across" not in (one or ""), one


def test_a_bare_word_or_curly_quotes_in_a_filter_get_the_quoting_hint():
    """`params.compressor = fft` got MLflow's "either not quoted or unidentified quote types", and
    curly quotes "Invalid clause(s)", with no hint (a trial; the unquoted number had one)."""
    from paperline.flows.compare import filter_hint

    said = "Parameter value is either not quoted or unidentified quote types used for string value fft"
    assert "quote the value (params.compressor = 'fft')" in filter_hint(said, "params.compressor = fft")
    assert "type straight quotes" in filter_hint("Invalid clause(s) in filter string", "params.epochs = ‘2’")
    assert filter_hint("some other error", "params.x = 'y'") == ""


def test_every_filter_given_must_hold():
    """A second --filter replaced the first, unsaid (a trial): they are joined with ``and``."""
    from paperline.flows.cli import joined_filters

    assert joined_filters(["params.problem = 'live-mnist'", " params.seed = '0' "]) == \
        "params.problem = 'live-mnist' and params.seed = '0'"
    assert joined_filters([]) == "" and joined_filters(["", "params.x = 'y'"]) == "params.x = 'y'"


def test_headline_metrics_past_the_table_are_said(tmp_path):
    """tensor-factorization's 12 headlines (six test RMSEs, then their fit_s) showed the first six
    and left the rest out unsaid (a fresh-user trial)."""
    from paperline.flows.compare import MAX_METRICS, compare_runs

    tracker = LocalTracker(f"sqlite:///{tmp_path}/mlflow.db")
    exp = tracker.client.create_experiment("tensor-factorization", artifact_location=(tmp_path / "a").as_uri())
    names = [f"d{i}.random.p2t2f.test_rmse" for i in range(6)] + [f"d{i}.random.p2t2f.fit_s" for i in range(6)]
    for value in (1.0, 2.0):
        run = tracker.client.create_run(exp, tags={"paperline.params_key": "k", "paperline.headlines": json.dumps(
            [[m, False] for m in names])})
        for m in names:
            tracker.client.log_metric(run.info.run_id, m, value)
        tracker.client.set_terminated(run.info.run_id)
    result = compare_runs(tracker, "tensor-factorization", [], out_dir=tmp_path)
    assert result["metrics"] == names[:MAX_METRICS]
    assert "6 more headline metric(s) not shown (d0.random.p2t2f.fit_s, d1.random.p2t2f.fit_s, " \
           "d2.random.p2t2f.fit_s, ...): --metric names the ones to show" in result["note"], result["note"]
    named = compare_runs(tracker, "tensor-factorization", names[6:8], out_dir=tmp_path)
    assert "headline metric(s) not shown" not in named["note"]
