"""The latest run against the best earlier run of the same parameters, on the session's real MLflow
server: which runs count as earlier (same key, FINISHED, not the run itself), which one is best (in
the first headline's direction), and when a regression is flagged."""

import json
import math
import time
import uuid

import pytest

from paperline.infra.errors import InputError
from paperline.infra.regression import (BestEarlier, Headline, MetricComparison, check_latest,
                                       compare_with_best_earlier, params_key)

HEADLINES = [Headline("throughput_gflop_per_s", higher_is_better=True, tolerance=0.10),
             Headline("wall_s", higher_is_better=False, tolerance=0.25)]


def test_the_summary_names_the_equal_metrics_when_they_are_few():
    def metric(name, latest):
        return MetricComparison(name, latest=latest, best=1.0, higher_is_better=True, tolerance=0.05)

    few = BestEarlier("k", 1, "r1", metrics=[metric("per_worker_video_s_per_s", 1.0)]).lines()
    assert few[1:] == ["  all 1 metric(s) equal: per_worker_video_s_per_s"]
    mixed = BestEarlier("k", 1, "r1", metrics=[metric("a", 1.0), metric("b", 1.5), metric("c", 1.0)]).lines()
    assert mixed[1:] == ["  b 1.5 vs 1: 50.0% better", "  the other 2 metric(s) equal: a, c"]
    many = BestEarlier("k", 1, "r1", metrics=[metric(f"m{i}", 1.0) for i in range(4)]).lines()
    assert many[1:] == ["  all 4 metric(s) equal"]


def test_worsening_follows_the_direction_and_the_tolerance():
    up = MetricComparison("throughput_gflop_per_s", latest=9.0, best=10.0, higher_is_better=True, tolerance=0.05)
    assert up.worsening == pytest.approx(0.1) and up.regression and up.ratio == pytest.approx(0.9)
    assert "REGRESSION (more than 5% worse)" in up.text()
    down = MetricComparison("wall_s", latest=9.0, best=10.0, higher_is_better=False, tolerance=0.05)
    assert down.worsening == pytest.approx(-0.1) and not down.regression and "10.0% better" in down.text()
    same = MetricComparison("test_rmse", latest=0.175, best=0.175, higher_is_better=False, tolerance=0.05)
    assert same.text() == "test_rmse 0.175 vs 0.175: equal"
    within = MetricComparison("wall_s", latest=10.4, best=10.0, higher_is_better=False, tolerance=0.05)
    assert not within.regression and "4.0% worse" in within.text()
    negative = MetricComparison("final_best", latest=-2.0, best=-1.0, higher_is_better=True, tolerance=0.05)
    assert negative.regression  # -2 is worse than -1 when maximizing
    zero = MetricComparison("failed", latest=1.0, best=0.0, higher_is_better=False, tolerance=0.05)
    assert zero.regression and math.isnan(zero.ratio)


def test_a_timing_too_short_to_judge_is_not_flagged():
    """A 256-cube GEMM (0.05 s) was flagged REGRESSION in 5 of 14 runs at 0.35-0.9x the best
    earlier (a fresh-user trial): a timing whose part took under ``min_seconds`` is not judged."""
    short = MetricComparison("throughput_gflop_per_s", latest=0.35, best=1.0, higher_is_better=True, tolerance=0.10,
                             timed_s=0.046, min_seconds=1.0)
    assert not short.judged and not short.regression
    assert short.text() == ("throughput_gflop_per_s 0.35 vs 1: 65.0% worse, not judged (timed over 0.046 s, under 1 s: "
                            "the host's noise; a larger problem is judged)")
    long = MetricComparison("throughput_gflop_per_s", latest=0.35, best=1.0, higher_is_better=True, tolerance=0.10,
                            timed_s=1.5, min_seconds=1.0)
    assert long.judged and long.regression


def test_bad_headlines_are_refused():
    with pytest.raises(InputError, match="min_seconds"):
        Headline("wall_s", higher_is_better=False, min_seconds=-1.0)
    with pytest.raises(InputError, match="tolerance"):
        Headline("wall_s", higher_is_better=False, tolerance=-0.1)
    with pytest.raises(InputError, match="metric"):
        Headline("", higher_is_better=True)


def test_params_key_ignores_order_and_sees_values():
    assert params_key({"a": 1, "b": [1, 2]}) == params_key({"b": [1, 2], "a": 1})
    assert params_key({"a": 1}) != params_key({"a": 2})


def test_runs_on_a_configured_cluster_are_keyed_apart_from_the_local_clusters(monkeypatch):
    """A run on one's own Dask cluster was judged against the best local run of the same
    parameters (an infra trial); the local cluster's key stays what earlier runs carry."""
    from paperline.infra.regression import run_key
    from paperline.infra.settings import get_settings

    monkeypatch.delenv("PAPERLINE_DASK_SCHEDULER_ADDRESS", raising=False)
    getattr(get_settings, "cache_clear", lambda: None)()
    local = run_key({"n": 1})
    assert local == params_key({"n": 1})
    keys = []
    # by host: a jobqueue scheduler comes up on another port each time (keyed apart, it never had an
    # earlier run to compare with: a review); the scheme and the port aside
    for address in ("tcp://10.0.0.5:8786", "10.0.0.5:40123", "tls://10.0.0.5:8786", "tcp://10.0.0.6:8786"):
        monkeypatch.setenv("PAPERLINE_DASK_SCHEDULER_ADDRESS", address)
        getattr(get_settings, "cache_clear", lambda: None)()
        keys.append(run_key({"n": 1}))
    monkeypatch.delenv("PAPERLINE_DASK_SCHEDULER_ADDRESS")
    getattr(get_settings, "cache_clear", lambda: None)()
    assert keys[0] == keys[1] == keys[2] != keys[3] and local not in keys


@pytest.mark.stack
def test_best_earlier_run_of_the_same_key_and_regressions(stack, caplog, monkeypatch):
    from paperline.infra.tracking import Tracker

    _, info = stack
    tracker = Tracker(info.mlflow_tracking_uri)
    experiment = f"regression-{uuid.uuid4().hex[:8]}"
    key, other = params_key({"n": 1}), params_key({"n": 2})

    def run(name, metrics, status="FINISHED", k=key):
        run_id = tracker.start_run(experiment, run_name=name, tags={"paperline.params_key": k})
        tracker.log_metrics(run_id, metrics)
        if status:
            tracker.end_run(run_id, status)
        time.sleep(0.01)  # distinct start times
        return run_id

    first = run("first", {"throughput_gflop_per_s": 10.0, "wall_s": 4.0})
    # nothing earlier for the very first run
    alone = compare_with_best_earlier(tracker, first, key, HEADLINES)
    assert alone.best_run_id is None and alone.earlier_runs == 0 and "no earlier run" in alone.lines()[0]
    tags = tracker.client.get_run(first).data.tags
    assert tags["paperline.regression"] == "none" and tags["paperline.best_earlier_run_id"] == ""
    assert tags["paperline.regressed_metrics"] == ""
    assert json.loads(tags["paperline.headlines"]) == [["throughput_gflop_per_s", True], ["wall_s", False]]

    best = run("best", {"throughput_gflop_per_s": 12.0, "wall_s": 5.0})
    run("failed-but-fast", {"throughput_gflop_per_s": 50.0, "wall_s": 1.0}, status="FAILED")
    run("other-params", {"throughput_gflop_per_s": 100.0, "wall_s": 1.0}, k=other)
    no_throughput = run("no-throughput", {"wall_s": 0.5})
    latest = run("latest", {"throughput_gflop_per_s": 11.5, "wall_s": 7.0}, status=None)  # still running
    run("unfinished", {"throughput_gflop_per_s": 90.0, "wall_s": 1.0}, status=None)  # still running

    got = compare_with_best_earlier(tracker, latest, key, HEADLINES)
    assert got.best_run_id == best and got.earlier_runs == 2  # first and best have the ranking metric
    by_name = {m.metric: m for m in got.metrics}
    assert not by_name["throughput_gflop_per_s"].regression  # 4.2% below, tolerance 10%
    assert by_name["wall_s"].regression  # 40% slower, tolerance 25%
    assert got.regression and got.regressed == ["wall_s"]
    lines = got.lines("fft")
    assert lines[0].startswith("fft: REGRESSION against the best of 2 earlier run(s)") and best in lines[0]
    assert "wall_s 7 vs 5: REGRESSION (more than 25% worse)" in lines[2] and len(lines) == 3
    recorded = tracker.client.get_run(latest).data
    assert recorded.tags["paperline.best_earlier_run_id"] == best
    assert recorded.tags["paperline.regression"] == "true" and recorded.tags["paperline.regressed_metrics"] == "wall_s"
    assert recorded.tags["paperline.params_key"] == key
    assert recorded.metrics["vs_best_earlier.throughput_gflop_per_s"] == pytest.approx(11.5 / 12.0)
    assert recorded.metrics["vs_best_earlier.wall_s"] == pytest.approx(7.0 / 5.0)

    # a timing too short to judge (its timed_by metric under min_seconds) is not flagged
    timed = compare_with_best_earlier(tracker, latest, key, [
        Headline("throughput_gflop_per_s", higher_is_better=True, tolerance=0.01, timed_by="wall_s", min_seconds=8.0)])
    assert not timed.regression and timed.metrics[0].timed_s == 7.0 and "not judged (timed over 7 s" in timed.lines()[1]

    # ranked by a metric to minimize: the smallest earlier value wins
    fastest = compare_with_best_earlier(tracker, latest, key, [Headline("wall_s", higher_is_better=False)])
    assert fastest.best_run_id == no_throughput and fastest.metrics[0].best == 0.5 and fastest.earlier_runs == 3

    # a tie on the first headline goes to the next: equal accuracies (cached runs), the fastest is
    # the best earlier run, not the newest (which once hid a 44% slower run's regression)
    tie = params_key({"n": 4})
    quick = run("tie-quick", {"test_accuracy": 93.6, "wall_s": 10.8}, k=tie)
    run("tie-slow", {"test_accuracy": 93.6, "wall_s": 15.6}, k=tie)
    again = run("tie-again", {"test_accuracy": 93.6, "wall_s": 15.6}, k=tie, status=None)
    acc_time = [Headline("test_accuracy", higher_is_better=True), Headline("wall_s", higher_is_better=False)]
    tied = compare_with_best_earlier(tracker, again, tie, acc_time)
    assert tied.best_run_id == quick and tied.regressed == ["wall_s"]

    # a run that ended before a reopened run (a resumed campaign) counts as earlier; the run itself never
    assert compare_with_best_earlier(tracker, first, key, HEADLINES).best_run_id == best

    # the caller's note for a run with nothing earlier is what is logged (a resumed campaign's flow
    # log said "first finished run" while its summary said "resumed")
    caplog.set_level("INFO", logger="paperline")
    lonely = run("lonely", {"throughput_gflop_per_s": 1.0, "wall_s": 1.0}, k=params_key({"n": 3}))
    noted = check_latest(tracker, lonely, {"n": 3}, HEADLINES, label="c", first_run_note="resumed its own run")
    assert noted.lines() == ["resumed its own run"] and "c: resumed its own run" in caplog.text
    assert "first finished run" not in caplog.text

    # in a deployment's run the summary logged at the flow's end holds these lines: only a
    # regression is logged as it is found (the log said "first finished run" twice: a review)
    from paperline.infra.flow_runs import FLOW_RUN_ENV

    monkeypatch.setenv(FLOW_RUN_ENV, "7c1e0c52-0000-4000-8000-000000000000")
    caplog.clear()
    alone = run("alone", {"throughput_gflop_per_s": 1.0, "wall_s": 1.0}, k=params_key({"n": 5}))
    assert check_latest(tracker, alone, {"n": 5}, HEADLINES).lines()[0].startswith("first finished run")
    assert caplog.text == ""
    run("fast", {"throughput_gflop_per_s": 100.0, "wall_s": 1.0}, k=params_key({"n": 6}))
    slow = run("slow", {"throughput_gflop_per_s": 1.0, "wall_s": 1.0}, k=params_key({"n": 6}))
    assert check_latest(tracker, slow, {"n": 6}, HEADLINES).regression
    assert "REGRESSION against" in caplog.text
