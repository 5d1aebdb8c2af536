"""`paperline compare` on an experiment with several runs: the table, the overlay plot, the
Parquet of runs, the logged comparison, and bad input."""

import time

import pyarrow.parquet as pq
import pytest

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def experiment(stack):
    from paperline.infra.tracking import Tracker

    _, info = stack
    tracker = Tracker(info.mlflow_tracking_uri)
    ids = []
    for i, lr in enumerate((0.1, 0.5, 1.0)):
        run_id = tracker.start_run("compare-test", run_name=f"lr-{lr}", params={"lr": lr, "seed": 0})
        tracker.log_metric_steps(run_id, [(s, {"loss": 1.0 / (1 + lr * s), "step_s": 0.1 * (i + 1)}) for s in range(5)])
        tracker.end_run(run_id)
        ids.append(run_id)
    return info, tracker, ids


def test_compare_prints_the_table_and_writes_the_plot_and_parquet(stack_cli, stack, experiment, tmp_path, monkeypatch):
    settings, _ = stack
    info, tracker, ids = experiment
    for variable in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):  # a shell without them: compare
        monkeypatch.delenv(variable)  # starts no stack, and its MLflow calls were refused (401)
    res = stack_cli("compare", "compare-test", "--metric", "loss", "--top", "2", "--ascending",
               "--filter", "params.seed = '0'", "--out", str(tmp_path), "--log")
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "params.lr" in text and "lr-1.0" in text and "lr-0.5" in text and "lr-0.1" not in text  # 2 lowest losses
    assert "(all runs; earlier --log comparisons aside)" in text  # the count leaves those out: say so
    assert "more runs than the 2 shown match: --top N shows more" in text  # "2 run(s)" of 3 (a trial)
    table = pq.read_table(tmp_path / "compare-test-runs.parquet").to_pydict()
    assert table["run_id"] == [ids[2], ids[1]] and "metrics.loss" in table and "params.lr" in table
    assert (tmp_path / "compare-test-metrics.png").stat().st_size > 1000
    logged = tracker.client.search_runs([tracker.client.get_experiment_by_name("compare-test").experiment_id],
                                        filter_string="attributes.run_name = 'comparison'")
    assert len(logged) == 1
    names = {a.path for a in tracker.client.list_artifacts(logged[0].info.run_id)}
    assert names == {"compare-test-runs.parquet", "compare-test-metrics.png"}
    # a filter only the comparison run matches says so (it was a bare "no runs match", --all-runs too: a trial)
    res = stack_cli("compare", "compare-test", "--filter", "params.top = '2'", "--all-runs", "--out", str(tmp_path))
    assert res.exit_code == 1 and "match: only earlier `compare --log` comparison runs do, which compare never " \
        "lists" in " ".join(res.output.split()), res.output


@pytest.mark.parametrize("args, fragment", [
    (["nope-experiment"], "experiment='nope-experiment': no such MLflow experiment"),
    (["compare-test", "--metric", "nope"], "--metric='nope'"),
    (["compare-test", "--filter", "params.lr ="], "--filter="),
    (["compare-test", "--filter", "params.lr = '0.1"], "--filter=\"params.lr = '0.1\": MLflow rejected it"),
    (["compare-test", "--filter", "params.lr = '7'"], "no runs"),
    (["compare-test", "--top", "0"], "--top=0"),
    (["compare-test", "--top", "100000"], "--top=100000: must be at most 50000"),  # (blamed --filter='': a trial)
    ([""], "name an MLflow experiment"),
])
def test_compare_bad_input(stack_cli, stack, experiment, tmp_path, args, fragment):
    settings, _ = stack
    res = stack_cli("compare", *args, "--out", str(tmp_path))
    assert res.exit_code != 0
    text = " ".join(res.output.split())
    assert "error:" in text and fragment in text and "Traceback" not in text
    assert "comparison" not in text and "params_key" not in text  # only the user's filter, not compare's own clauses


def test_times_and_losses_without_a_recorded_direction_are_ranked_lowest_first(stack, experiment, tmp_path):
    """`--metric wall_s` of video-curation (not a headline there) listed the slowest run first (a trial)."""
    from paperline.flows.compare import compare_runs, lower_is_better

    _, tracker, ids = experiment
    for metric in ("step_s", "loss"):
        result = compare_runs(tracker, "compare-test", [metric], "params.seed = '0'", 3, tmp_path)
        first = [row[1] for row in result["rows"]]
        assert first[0] == ("lr-0.1" if metric == "step_s" else "lr-1.0"), (metric, first)
        assert "more runs" not in result["note"]  # all 3 shown
    assert [lower_is_better(m) for m in ("wall_s", "fit_seconds", "train_loss", "test_rmse", "verification_residual",
                                         "throughput_video_s_per_s", "accuracy_pct", "gflops")] == [True] * 5 + [False] * 3


def test_compare_refuses_a_file_as_out_dir(stack_cli, stack, experiment, tmp_path):
    settings, _ = stack
    target = tmp_path / "a-file"
    target.write_text("x")
    res = stack_cli("compare", "compare-test", "--out", str(target))
    assert res.exit_code != 0 and "--out=" in " ".join(res.output.split()) and "not a directory" in res.output


def test_by_default_only_the_runs_a_pipeline_compares_are_listed(stack_cli, stack, tmp_path):
    """A nas-like experiment: campaign parent runs carry paperline.params_key, their per-evaluation
    child runs do not; the default lists the campaigns with their regression flag, --all-runs all."""
    from paperline.infra.tracking import Tracker

    settings, info = stack
    tracker = Tracker(info.mlflow_tracking_uri)
    parents = []
    for i, flag in enumerate(("none", "true")):
        parent = tracker.start_run("compare-nested", run_name=f"campaign-{i}", params={"seed": i},
                                   tags={"paperline.params_key": "k1", "paperline.regression": flag})
        for j in range(3):
            child = tracker.start_run("compare-nested", run_name=f"eval-{j}", parent_run_id=parent, params={"x": j})
            tracker.log_metrics(child, {"hypervolume": float(j)})
            tracker.end_run(child)
        tracker.log_metrics(parent, {"final_hypervolume": 10.0 - i})
        tracker.end_run(parent)
        parents.append(parent)
    res = stack_cli("compare", "compare-nested", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    table = pq.read_table(tmp_path / "compare-nested-runs.parquet").to_pydict()
    assert sorted(table["run_id"]) == sorted(parents)
    text = " ".join(res.output.split())
    assert "2 run(s) (pipeline runs" in text and "final_hypervolume" in text and "true" in text
    res = stack_cli("compare", "compare-nested", "--all-runs", "--top", "20", "--filter",
               "params.x = '1'", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert len(pq.read_table(tmp_path / "compare-nested-runs.parquet").to_pydict()["run_id"]) == 2  # one per campaign
    res = stack_cli("compare", "compare-nested", "--filter", "params.seed = '1'", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert pq.read_table(tmp_path / "compare-nested-runs.parquet").to_pydict()["run_id"] == [parents[1]]


def test_headline_metrics_by_default_and_runs_that_share_none(stack_cli, stack, tmp_path):
    """Without --metric: the pipeline's headline metrics, best first in their own direction; runs
    with no shared metric get the table without a plot; --log runs never take a --top slot; a
    rejected filter is echoed as the user wrote it; an --out that cannot be made is one line."""
    import json

    from paperline.infra.tracking import Tracker

    settings, info = stack
    tracker = Tracker(info.mlflow_tracking_uri)
    ids = []
    for i, wall in enumerate((3.0, 1.0, 2.0)):
        run_id = tracker.start_run("compare-headlines", run_name=f"r{i}", params={"seed": i}, tags={
            "paperline.params_key": "k", "paperline.headlines": json.dumps([["wall_s", False]])})
        tracker.log_metrics(run_id, {"wall_s": wall, "other": 1.0})
        tracker.end_run(run_id)
        ids.append(run_id)
    assert stack_cli("compare", "compare-headlines", "--log", "--out", str(tmp_path)).exit_code == 0
    res = stack_cli("compare", "compare-headlines", "--top", "3", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    table = pq.read_table(tmp_path / "compare-headlines-runs.parquet").to_pydict()
    assert table["run_id"] == [ids[1], ids[2], ids[0]]  # fastest first; the --log run takes no slot
    assert "3 run(s) (pipeline runs" in " ".join(res.output.split())
    # a headline metric named with --metric is ranked in its own direction too (it was descending)
    res = stack_cli("compare", "compare-headlines", "--metric", "wall_s", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert pq.read_table(tmp_path / "compare-headlines-runs.parquet").to_pydict()["run_id"] == [ids[1], ids[2], ids[0]]
    lone = tracker.start_run("compare-disjoint", run_name="a")
    tracker.log_metrics(lone, {"x": 1.0})
    tracker.end_run(lone)
    other = tracker.start_run("compare-disjoint", run_name="b")
    tracker.log_metrics(other, {"y": 1.0})
    tracker.end_run(other)
    res = stack_cli("compare", "compare-disjoint", "--out", str(tmp_path))
    assert res.exit_code == 0 and "share no metric" in res.output, res.output
    res = stack_cli("compare", "compare-headlines", "--filter", "params.seed = 1", "--out", str(tmp_path))
    text = " ".join(res.output.split())
    assert res.exit_code != 0 and "--filter='params.seed = 1': MLflow rejected it" in text and "LIKE" not in text
    blocker = tmp_path / "file"
    blocker.write_text("x")
    res = stack_cli("compare", "compare-headlines", "--out", str(blocker / "sub"))
    assert res.exit_code != 0 and "cannot create the directory" in res.output and "Traceback" not in res.output


def test_default_headlines_are_the_ones_most_runs_share(stack_cli, stack, tmp_path):
    """A newest run with other headlines (a tensor run on user data among bundled-dataset runs)
    neither decides the metrics nor shows as a row of NaNs."""
    import json

    from paperline.infra.tracking import Tracker

    settings, info = stack
    tracker = Tracker(info.mlflow_tracking_uri)
    ids = []
    for i, rmse in enumerate((0.3, 0.1, 0.2)):
        run_id = tracker.start_run("compare-mixed", run_name=f"bundled{i}", params={"seed": i}, tags={
            "paperline.params_key": f"k{i}", "paperline.headlines": json.dumps([["kinetic.rmse", False]])})
        tracker.log_metrics(run_id, {"kinetic.rmse": rmse})
        tracker.end_run(run_id)
        ids.append(run_id)
    user = tracker.start_run("compare-mixed", run_name="user", params={"seed": 9}, tags={
        "paperline.params_key": "ku", "paperline.headlines": json.dumps([["user.rmse", False], ["user.fit_s", False]])})
    tracker.log_metrics(user, {"user.rmse": 0.5, "user.fit_s": 2.0})
    tracker.end_run(user)
    res = stack_cli("compare", "compare-mixed", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    table = pq.read_table(tmp_path / "compare-mixed-runs.parquet").to_pydict()
    assert table["run_id"] == [ids[1], ids[2], ids[0]]  # best kinetic.rmse first, the user run left out
    # ... and the output says so, and how to see it (nas: single-objective campaigns were dropped silently)
    # (named by the metric it ranks by, not the first alphabetically: fit_s)
    assert "1 run(s) without kinetic.rmse left out (they rank by user.rmse: --metric user.rmse shows them)" in \
        " ".join(res.output.split())
    # --all-runs lists it too, after the ranked ones (it said "left out" there as well: a trial)
    res = stack_cli("compare", "compare-mixed", "--all-runs", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    table = pq.read_table(tmp_path / "compare-mixed-runs.parquet").to_pydict()
    assert table["run_id"] == [ids[1], ids[2], ids[0], user]
    text = " ".join(res.output.split())
    assert "left out" not in text and "the last 1 run(s) have no kinetic.rmse" in text, text
    res = stack_cli("compare", "compare-mixed", "--metric", "user.rmse", "--out", str(tmp_path))
    assert res.exit_code == 0 and pq.read_table(tmp_path / "compare-mixed-runs.parquet").to_pydict()["run_id"] == [user]
    # the runs without a named metric are left out and said, as for the headline (nan rows before: a trial)
    assert "3 run(s) without user.rmse left out (--all-runs lists them too)" in " ".join(res.output.split()), res.output
    res = stack_cli("compare", "compare-mixed", "--metric", "user.rmse", "--all-runs", "--out", str(tmp_path))
    assert len(pq.read_table(tmp_path / "compare-mixed-runs.parquet").to_pydict()["run_id"]) == 4, res.output
    # an unknown metric lists what the experiment's runs have, not only the --top ones it read
    res = stack_cli("compare", "compare-mixed", "--metric", "rmse", "--top", "1", "--out", str(tmp_path))
    assert res.exit_code != 0
    assert "--metric='rmse': no run of 'compare-mixed' has it (give the bare name, no 'metrics.'); known: " \
        "kinetic.rmse, user.fit_s, user.rmse" in " ".join(res.output.split()), res.output


def test_a_metric_maximized_by_some_runs_and_minimized_by_others_is_not_ranked(stack_cli, stack, tmp_path):
    """nas ``final_best``: a NAS-Bench-201 accuracy (higher is better) and a Levy value (lower is
    better) ranked together put the worst Levy campaign first. They are listed newest first with a
    note naming a filter that ranks one problem's campaigns; that filter ranks them (ascending)."""
    import json

    from paperline.infra.tracking import Tracker

    settings, info = stack
    tracker = Tracker(info.mlflow_tracking_uri)
    ids = {}
    for name, problem, better, value in (("acc", "nasbench201-cifar10", True, 91.0), ("levy-a", "levy", False, 40.0),
                                         ("levy-b", "levy", False, 3.0)):
        run_id = tracker.start_run("compare-directions", run_name=name, params={"problem": problem}, tags={
            "paperline.params_key": name, "paperline.headlines": json.dumps([["final_best", better]])})
        tracker.log_metrics(run_id, {"final_best": value})
        tracker.end_run(run_id)
        ids[name] = run_id
    res = stack_cli("compare", "compare-directions", "--metric", "final_best", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    table = pq.read_table(tmp_path / "compare-directions-runs.parquet").to_pydict()
    assert table["run_id"] == [ids["levy-b"], ids["levy-a"], ids["acc"]]  # newest first
    assert "final_best is maximized in some runs and minimized in others: listed newest first, not ranked; " \
        "--filter \"params.problem = 'levy'\" ranks runs of one kind" in " ".join(res.output.split()), res.output
    res = stack_cli("compare", "compare-directions", "--metric", "final_best", "--filter",
               "params.problem = 'levy'", "--out", str(tmp_path))
    assert res.exit_code == 0 and "not ranked" not in res.output, res.output
    assert pq.read_table(tmp_path / "compare-directions-runs.parquet").to_pydict()["run_id"] == [ids["levy-b"],
                                                                                               ids["levy-a"]]


def _finished_run(tracker, experiment, name, params, tags, headlines, metrics):
    """A FINISHED run as a pipeline logs it: its parameter key (its name) and headline metrics."""
    import json

    run_id = tracker.start_run(experiment, run_name=name, params=params, tags={
        **tags, "paperline.params_key": name, "paperline.headlines": json.dumps(headlines)})
    tracker.log_metrics(run_id, metrics)
    tracker.end_run(run_id)
    return run_id


def test_runs_of_different_problems_ranked_together_get_a_note(stack_cli, stack, tmp_path):
    """nas hypervolumes of live-mnist (5.7e9) and NAS-Bench-201 (5.6) were ranked as one list
    without a word (a trial): ranked still, with a note naming a filter for one problem."""
    from paperline.infra.tracking import Tracker

    _, info = stack
    tracker = Tracker(info.mlflow_tracking_uri)
    for name, problem, value in (("bench", "nasbench201-cifar10", 5.6), ("live", "live-mnist", 5.7e9),
                                 ("all-failed", "dtlz2", None)):
        _finished_run(tracker, "compare-problems", name, {"problem": problem}, {},
                      [["final_hypervolume", True]], {"final_hypervolume": value} if value else {"evaluations": 4})
    res = stack_cli("compare", "compare-problems", "--out", str(tmp_path))
    out = " ".join(res.output.split())
    assert res.exit_code == 0, res.output
    assert "ranked across 2 problems (live-mnist, nasbench201-cifar10), whose final_hypervolume values do not " \
           "compare: --filter \"params.problem = 'live-mnist'\" ranks one" in out, res.output
    # a campaign whose every evaluation failed has no hypervolume: the hint named final_hypervolume for it (a trial)
    assert "1 run(s) without final_hypervolume left out (none has a headline metric (e.g. every evaluation " \
           "failed): --all-runs lists them too)" in out, res.output
    # ... and with --metric it is listed without a value, not counted as a problem ranked
    res = stack_cli("compare", "compare-problems", "--metric", "final_hypervolume", "--out", str(tmp_path))
    assert res.exit_code == 0 and "ranked across 2 problems" in " ".join(res.output.split()), res.output
    res = stack_cli("compare", "compare-problems", "--filter", "params.problem = 'live-mnist'", "--out", str(tmp_path))
    assert res.exit_code == 0 and "ranked across" not in res.output, res.output


def test_training_runs_on_different_datasets_ranked_together_get_a_note(stack_cli, stack, tmp_path):
    """compressed-training accuracies on MNIST-5k (93.6) and Fashion-MNIST (89.0) were ranked as
    one list without a word (a trial). (video-curation's `dataset` is the name it writes: no note.)"""
    import uuid

    from paperline.infra.tracking import Tracker

    _, info = stack
    tracker = Tracker(info.mlflow_tracking_uri)
    mark = uuid.uuid4().hex[:8]  # (the experiment is the pipeline's: other tests' runs may be in it)
    for name, dataset, value in (("digits", "mnist-5k", 93.6), ("fashion", "fashion-mnist", 89.0)):
        _finished_run(tracker, "compressed-training", f"{name}-{mark}", {"dataset": dataset}, {"compare-test": mark},
                      [["final_test_accuracy_pct", True]], {"final_test_accuracy_pct": value})
    mine = f"tags.`compare-test` = '{mark}'"
    res = stack_cli("compare", "compressed-training", "--filter", mine, "--out", str(tmp_path))
    out = " ".join(res.output.split())
    assert res.exit_code == 0, res.output
    assert "ranked across 2 datasets (fashion-mnist, mnist-5k), whose final_test_accuracy_pct values do not " \
           "compare: --filter \"params.dataset = 'fashion-mnist'\" ranks one" in out, res.output
    res = stack_cli("compare", "compressed-training", "--filter", f"{mine} and params.dataset = 'mnist-5k'",
                    "--out", str(tmp_path))
    assert res.exit_code == 0 and "ranked across" not in res.output, res.output
    for name, dataset in (("a", "clips-a"), ("b", "clips-b")):  # names it wrote
        _finished_run(tracker, "compare-video", f"{name}-{mark}", {"dataset": dataset}, {},
                      [["clips_per_s", True]], {"clips_per_s": 3.0})
    res = stack_cli("compare", "compare-video", "--out", str(tmp_path))
    assert res.exit_code == 0 and "ranked across" not in res.output, res.output


def test_runs_on_different_contents_of_a_data_file_ranked_together_get_a_note(stack_cli, stack, tmp_path):
    """A user's tensor file edited between runs: its old and new contents (test RMSE 0.079 and
    0.363) were ranked as one list (a trial). The note names the tag that tells them apart."""
    from paperline.infra.tracking import Tracker

    _, info = stack
    tracker = Tracker(info.mlflow_tracking_uri)
    for name, content, value in (("old", "aaa111", 0.079), ("new", "bbb222", 0.363), ("new-again", "bbb222", 0.36)):
        _finished_run(tracker, "compare-contents", name, {"datasets": ""}, {"paperline.data_sha256": content},
                      [["user-mine.random.p2t2f.test_rmse", False]], {"user-mine.random.p2t2f.test_rmse": value})
    res = stack_cli("compare", "compare-contents", "--out", str(tmp_path))
    out = " ".join(res.output.split())
    assert res.exit_code == 0, res.output
    assert "ranked across 2 contents of the data (tag paperline.data_sha256): --filter " \
           "\"tags.`paperline.data_sha256` = 'aaa111'\" ranks one content's runs" in out, res.output
    res = stack_cli("compare", "compare-contents", "--filter", "tags.`paperline.data_sha256` = 'bbb222'",
                    "--out", str(tmp_path))
    assert res.exit_code == 0 and "ranked across" not in res.output, res.output
    assert len(pq.read_table(tmp_path / "compare-contents-runs.parquet").to_pydict()["run_id"]) == 2


def test_a_metric_logged_once_per_run_is_plotted_as_bars(tmp_path):
    """gemm's throughput is one value per run: as lines it was a dot per run at step 0 (fresh-user
    trial); it is a bar per run now, and a metric with steps stays a line per run."""
    from types import SimpleNamespace

    from paperline.flows.compare import _overlay_plot

    runs = [SimpleNamespace(info=SimpleNamespace(run_id=f"{i}abcdef", run_name=f"run-{i}")) for i in range(3)]
    histories = {(r.info.run_id, "throughput_gflop_per_s"): [(0, 50.0 + i)] for i, r in enumerate(runs)}
    histories |= {(r.info.run_id, "train_rmse"): [(s, 1.0 / (s + 1)) for s in range(5)] for r in runs}
    histories[(runs[2].info.run_id, "train_rmse")] = []  # a run without the metric is left out
    path = tmp_path / "plot.png"
    kinds = _overlay_plot(runs, ["throughput_gflop_per_s", "train_rmse"], histories, path)
    assert kinds == {"throughput_gflop_per_s": "bars", "train_rmse": "lines"}
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_final_value_logged_again_is_one_bar_at_its_latest():
    """An extended nas campaign logs ``final_best`` at step 0 again: two points at one step drew a
    vertical line at step 0 (a trial). One point per step, the last logged."""
    from mlflow.entities import Metric

    from paperline.flows.compare import latest_per_step

    history = [Metric("final_best", 20.597, 1000, 0), Metric("final_best", 3.0, 1500, 5),
               Metric("final_best", 20.521, 2000, 0)]
    assert latest_per_step(history) == [(0, 20.521), (5, 3.0)]
    assert latest_per_step(list(reversed(history))) == [(0, 20.521), (5, 3.0)]  # by time, not MLflow's order
    assert latest_per_step([]) == []


def test_many_differing_parameters_are_capped_in_the_table_not_the_parquet(stack_cli, stack, tmp_path):
    """`compare compressed-training --all-runs` had ~15 parameter columns (parent and child runs
    differ in most): unreadable at 80 columns. The table shows the most varied few and names the
    rest; the Parquet file keeps them all."""
    from paperline.flows.compare import MAX_PARAM_COLUMNS, compare_runs
    from paperline.infra.tracking import Tracker

    _, info = stack
    tracker = Tracker(info.mlflow_tracking_uri)
    names = [f"a{i}" for i in range(MAX_PARAM_COLUMNS + 2)]  # (named to sort before "model")
    for run in range(3):  # a0 takes 3 values, the others 2; output 3 (where each run wrote: shown last)
        params = {**{n: (run if n == "a0" else run % 2) for n in names}, "output": f"s3://b/gemm/run-{run}/result.npy",
                  "model": ["resnet", "lstm"][run % 2]}
        run_id = tracker.start_run("compare-wide", run_name=f"wide-{run}", params=params)
        tracker.log_metric_steps(run_id, [(0, {"loss": float(run)})])
        tracker.end_run(run_id)
    res = stack_cli("compare", "compare-wide", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    text = " ".join(res.output.split())
    assert "4 more parameter(s) differ between these runs, in the Parquet file: " in text, text
    table = pq.read_table(tmp_path / "compare-wide-runs.parquet").to_pydict()
    assert all(f"params.{n}" in table for n in [*names, "output"])
    shown = [c for c in compare_runs(tracker, "compare-wide", [], out_dir=tmp_path)["columns"] if c.startswith("params.")]
    assert len(shown) == MAX_PARAM_COLUMNS and "params.a0" in shown  # the most varied kept
    # and first what the runs ran: LSTM rows stood beside ResNet rows without a model column (a trial)
    assert "params.model" in shown and "params.a6" not in shown, shown
    assert "params.output" not in shown  # (it took the first column: compare gemm, a trial)


def test_no_runs_errors_say_why(stack_cli, stack, tmp_path, monkeypatch):
    """A fresh-user trial: `compare gemm --filter "attributes.status = 'FAILED'"` said no runs
    match while --all-runs listed the failed runs (they carry no params_key); `compare Default`
    (no runs) blamed `--filter=''`; a pipeline never run was only "no such MLflow experiment"."""
    from paperline.infra.tracking import Tracker

    _, info = stack
    tracker = Tracker(info.mlflow_tracking_uri)
    ok = tracker.start_run("compare-failed", run_name="ok", params={"seed": 0}, tags={"paperline.params_key": "k"})
    tracker.log_metrics(ok, {"wall_s": 1.0})
    tracker.end_run(ok)
    failed = tracker.start_run("compare-failed", run_name="bad", params={"seed": 1})
    tracker.end_run(failed, "FAILED")
    res = stack_cli("compare", "compare-failed", "--filter", "attributes.status = 'FAILED'", "--out", str(tmp_path))
    text = " ".join(res.output.split())
    assert res.exit_code != 0 and "--filter=\"attributes.status = 'FAILED'\": no pipeline runs of experiment " \
        "'compare-failed' match, but runs the default selection leaves out (runs that ended before their results: " \
        "FAILED, or KILLED by a cancel or a crash) do: --all-runs lists them" in text, text
    assert "params_key" not in text
    res = stack_cli("compare", "compare-failed", "--all-runs", "--filter", "attributes.status = 'FAILED'",
                    "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert pq.read_table(tmp_path / "compare-failed-runs.parquet").to_pydict()["run_id"] == [failed]
    res = stack_cli("compare", "compare-failed", "--filter", "params.seed = '7'", "--out", str(tmp_path))
    text = " ".join(res.output.split())
    assert res.exit_code != 0 and "no runs in experiment 'compare-failed' match" in text and "--all-runs" not in text
    assert "no run of it has" not in text  # seed is a parameter: a true empty match
    # a misspelt name matched nothing, said as an empty match (a trial): the name is said unknown
    res = stack_cli("compare", "compare-failed", "--filter", "params.sed = '1' and metrics.`wall s` > 0",
                    "--out", str(tmp_path))
    text = " ".join(res.output.split())
    assert res.exit_code != 0 and "match: no run of it has params.sed, metrics.wall s (its metrics: wall_s; its " \
        "params: seed)" in text, text
    # a long list is cut as --metric's is (~190 metric names, 12 KB on one line: a trial)
    tracker.log_metrics(ok, {f"m{i:03d}": 1.0 for i in range(45)})
    res = stack_cli("compare", "compare-failed", "--filter", "metrics.nope > 0", "--out", str(tmp_path))
    text = " ".join(res.output.split())
    assert res.exit_code != 0 and "(its metrics: m000, m001," in text and "m039 and 6 more)" in text, text

    tracker.client.create_experiment("compare-empty")
    res = stack_cli("compare", "compare-empty", "--out", str(tmp_path))
    text = " ".join(res.output.split())
    assert res.exit_code != 0 and "error: experiment='compare-empty': the experiment has no runs" in text, text
    assert "--filter" not in text

    monkeypatch.setattr("paperline.flows.pipelines.pipeline_names", lambda: ["compare-never-run"])
    res = stack_cli("compare", "compare-never-run", "--out", str(tmp_path))
    text = " ".join(res.output.split())
    assert res.exit_code != 0 and "experiment='compare-never-run': no such MLflow experiment (the compare-never-run " \
        "pipeline has not run here yet: run `paperline run compare-never-run` first); known: " in text, text
    res = stack_cli("compare", "compare-never-ran", "--out", str(tmp_path))  # not a pipeline: no such hint
    assert res.exit_code != 0 and "no such MLflow experiment; known: " in " ".join(res.output.split()), res.output


def test_runs_without_the_headline_metric_are_listed_not_refused(stack_cli, stack, tmp_path):
    """Pipeline runs that failed before logging their headline metric: the default headline
    ranking found none and said no runs match; they are listed newest first, with a note."""
    import json

    from paperline.infra.tracking import Tracker

    _, info = stack
    tracker = Tracker(info.mlflow_tracking_uri)
    tags = {"paperline.params_key": "k", "paperline.headlines": json.dumps([["wall_s", False]])}
    ok = tracker.start_run("compare-unranked", run_name="ok", params={"seed": 0}, tags=tags)
    tracker.log_metrics(ok, {"wall_s": 1.0})
    tracker.end_run(ok)
    failed = tracker.start_run("compare-unranked", run_name="bad", params={"seed": 1}, tags=tags)
    tracker.end_run(failed, "FAILED")
    res = stack_cli("compare", "compare-unranked", "--filter", "attributes.status = 'FAILED'", "--out", str(tmp_path))
    assert res.exit_code == 0, res.output
    assert "none of these runs has wall_s: listed newest first" in " ".join(res.output.split())
    assert pq.read_table(tmp_path / "compare-unranked-runs.parquet").to_pydict()["run_id"] == [failed]


def test_a_parameter_that_repeats_the_run_names_is_no_column(stack, tmp_path):
    """compressed training's child runs are named after their compressor: params.compressor
    repeated the name column, and took a --metric's room at 80 columns (a trial)."""
    from paperline.flows.compare import compare_runs
    from paperline.infra.tracking import Tracker

    tracker = Tracker(stack[1].mlflow_tracking_uri)
    for name, theta in (("none", 1.0), ("fft", 0.2)):
        run_id = tracker.start_run("compare-named", run_name=name, params={"compressor": name, "theta": theta})
        tracker.log_metrics(run_id, {"accuracy": 90.0 + theta})
        tracker.end_run(run_id)
    result = compare_runs(tracker, "compare-named", ["accuracy"], out_dir=tmp_path)
    assert "params.compressor" not in result["columns"] and "params.theta" in result["columns"], result["columns"]
    assert "params.compressor" in pq.read_table(tmp_path / "compare-named-runs.parquet").column_names


def test_a_metric_named_twice_is_one_column(stack, experiment, tmp_path):
    from paperline.flows.compare import compare_runs

    _, tracker, _ = experiment
    result = compare_runs(tracker, "compare-test", ["loss", "step_s", "loss"], out_dir=tmp_path)
    assert result["metrics"] == ["loss", "step_s"] and result["columns"].count("loss") == 1


def test_the_table_takes_a_narrow_terminals_width(stack, experiment, tmp_path):
    """The CLI's console is at least 140 columns wide (URLs), and printed compare's table that wide
    on a 60-column terminal: every row wrapped (a fresh-user trial)."""
    from typer.testing import CliRunner

    from paperline.flows.cli import app
    from paperline.infra.settings import get_settings

    args = ["compare", "compare-test", "--metric", "loss", "--metric", "step_s", "--all-runs", "--out", str(tmp_path)]
    widths = {}
    get_settings.cache_clear()
    try:
        for columns in (60, 200):
            res = CliRunner().invoke(app, args, env={"PAPERLINE_STATE_DIR": str(stack[0].state_dir),
                                                     "COLUMNS": str(columns)})
            assert res.exit_code == 0, res.output
            widths[columns] = max(len(line) for line in res.output.splitlines() if line[:1] in "┏┃┡│└")
    finally:
        get_settings.cache_clear()
    assert widths[60] <= 60 < widths[200], widths  # the table needs more room, and gives way


def test_a_metric_the_filters_runs_lack_is_said_as_the_filters_doing(stack, tmp_path):
    """`--filter "attributes.status != 'FINISHED'" --metric wall_s` said "no run of ... has it;
    known: " and an empty list (a trial): the failed runs had logged nothing, the finished ones
    had wall_s."""
    from paperline.flows.compare import compare_runs
    from paperline.infra.errors import InputError
    from paperline.infra.tracking import Tracker

    tracker = Tracker(stack[1].mlflow_tracking_uri)
    name = f"compare-filter-test-{time.time_ns()}"
    done = tracker.start_run(name, run_name="done")
    tracker.log_metrics(done, {"wall_s": 3.0})
    tracker.end_run(done)
    tracker.end_run(tracker.start_run(name, run_name="failed"), "FAILED")
    with pytest.raises(InputError, match=r"^--metric='wall_s': none of the 1 run\(s\) --filter selects has it; they "
                                         r"logged no metric at all .*other runs of 'compare-filter-test-\d+' do"):
        compare_runs(tracker, name, ["wall_s"], "attributes.status != 'FINISHED'", out_dir=tmp_path, all_runs=True)
    with pytest.raises(InputError, match=r"^--metric='nope': no run of"):  # the experiment's own lack: as before
        compare_runs(tracker, name, ["nope"], "attributes.status != 'FINISHED'", out_dir=tmp_path, all_runs=True)
