"""``paperline compare``: MLflow runs of one experiment side by side.

A table of runs (the parameters that differ between them, the chosen metrics' final values), an
overlay plot of the chosen metrics step by step, and a Parquet file of every run's parameters and
final metrics; optionally logged as a ``comparison`` run of the same experiment.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from paperline.infra.errors import InputError, first_few
from paperline.infra.regression import CACHED_FROM_TAG, HEADLINES_TAG

DATA_TAG = "paperline.data_sha256"  # a user-data tensor-factorization run's content
from paperline.infra.tracking import Tracker


KEY_FILTER = "tags.`paperline.params_key` LIKE '%'"
NOT_COMPARISON = "attributes.run_name != 'comparison'"
NAMES_SHOWN = 40  # metric or parameter names listed in a refusal, then "and N more"
# a re-run served from Prefect's task cache logs a run repeating an earlier one's metrics: exact
# duplicate rows (a trial: 10 rows of compressed training, 3 of them copies); --all-runs lists them
NOT_CACHED = f"tags.`{CACHED_FROM_TAG}` IS NULL"
CACHED = f"tags.`{CACHED_FROM_TAG}` IS NOT NULL"


MAX_METRICS = 6  # metric columns (and plotted metrics) shown when none is named
HEADLINE_SAMPLE = 100  # newest runs whose headline tags decide the default metrics


def _common_headlines(runs: list[Any]) -> list[list[Any]]:
    """The headline list (tag ``paperline.headlines``) most of ``runs`` carry, the newest on a tie:
    a tensor experiment's runs on the bundled datasets share one list, a run on user data has
    its own, and the newest run alone should not decide what the others are compared on."""
    counts: dict[str, int] = {}
    for r in runs:  # newest first: dict order breaks ties towards the newest
        tag = r.data.tags.get(HEADLINES_TAG)
        if tag and tag != "[]":
            counts[tag] = counts.get(tag, 0) + 1
    return json.loads(max(counts, key=counts.__getitem__)) if counts else []


def _headline_list(run: Any) -> list[list[Any]]:
    """A run's headline metrics as ``[[name, higher_is_better], ...]`` (tag ``paperline.headlines``)."""
    return json.loads(run.data.tags.get(HEADLINES_TAG) or "[]")


def _directions(runs: list[Any], metric: str) -> set[bool]:
    """The directions (higher is better: True) ``runs`` give ``metric`` in their headline tags."""
    return {bool(better) for r in runs for m, better in _headline_list(r) if m == metric}


def _example_kind(runs: list[Any], metric: str) -> dict[str, str]:
    """A parameter, and its value in the newest run that minimizes ``metric``, that tells runs of
    opposite directions apart (nas: ``problem``); empty when no single parameter does."""
    minimized = [r for r in runs if [metric, False] in _headline_list(r)]
    maximized = [r for r in runs if [metric, True] in _headline_list(r)]
    for key in ("problem", *sorted(minimized[0].data.params)):
        low = {r.data.params.get(key) for r in minimized}
        if key in minimized[0].data.params and low.isdisjoint({r.data.params.get(key) for r in maximized}):
            return {key: minimized[0].data.params[key]}
    return {}


def lower_is_better(metric: str) -> bool:
    """Whether a metric no pipeline records a direction for is best low, by its name: a time
    (``_s``, ``_seconds``; not a rate ``_per_s``) or a loss or error (``loss``, ``rmse``,
    ``residual``, ``error``). ``--metric wall_s`` of video-curation listed the slowest run first (a trial)."""
    name = metric.rsplit(".", 1)[-1].lower()
    if name.endswith("_per_s"):
        return False
    return name.endswith(("_s", "_seconds")) or any(w in name for w in ("loss", "rmse", "residual", "error"))


# parameters a run may outgrow: MLflow keeps a parameter's first value for good, so a pipeline
# records the later one in a tag (a nas campaign extended from 40 to 60 evaluations showed budget 40
# beside campaigns of 40, read as a fair comparison: a trial)
LATER_VALUE_TAGS = {"budget": "paperline.budget"}


def _param(run: Any, key: str, default: str | None = None) -> str | None:
    """Run ``run``'s parameter ``key`` as it stands now: the tag of :data:`LATER_VALUE_TAGS` when
    the run has it, else the parameter (``default`` when it has neither)."""
    tag = LATER_VALUE_TAGS.get(key)
    if tag is not None and tag in run.data.tags:
        return run.data.tags[tag]
    return run.data.params.get(key, default)


def _sql_quoted(value: str) -> str:
    """``value`` as a string literal of MLflow's search syntax (single quotes)."""
    return "'" + value.replace("'", "\\'") + "'"


def _shell_quoted(text: str) -> str:
    """``text`` quoted for a POSIX shell: in double quotes where it holds none of ``"$`\\``, as
    the hints always read, else :func:`shlex.quote`'s way."""
    import shlex  # noqa: PLC0415

    return f'"{text}"' if not any(c in text for c in '"$`\\') else shlex.quote(text)


def _compact(value: str, limit: int = 60) -> str:
    """A parameter's value for a note: a JSON object as ``key=a+b; key=v`` (nas problem options:
    ``objectives=val_accuracy_pct+model_size_mb``), cut to about ``limit`` characters."""
    try:
        parsed = json.loads(value)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict) and parsed:
        value = "; ".join(f"{k}={'+'.join(map(str, v)) if isinstance(v, list) else v}" for k, v in parsed.items())
    return value if len(value) <= limit else value[:limit - 3] + "..."


def _names_its_own_run(run: Any, key: str) -> bool:
    """Whether ``run``'s parameter ``key`` holds the run's own Prefect flow run id (a location
    made per run, e.g. ``s3://.../gemm/<flow run id>/result.npy``)."""
    flow_run_id = run.data.tags.get("prefect.flow_run_id")
    return bool(flow_run_id) and flow_run_id in (run.data.params.get(key) or "")


def _locations(values: Any) -> bool:
    """Whether every given value names a storage location (an S3 URI or an absolute path)."""
    return all(isinstance(v, str) and (v.startswith("s3://") or v.startswith("/")) for v in values if v is not None)


MAX_PARAM_COLUMNS = 5  # parameters that differ between the runs, shown as table columns
# parameters naming what a run ran, kept first among those that differ (the table's cap)
WHAT_RAN = frozenset({"model", "dataset", "datasets", "compressor", "optimizer", "problem", "routine", "dtype", "source",
                      "splitter", "data"})


def filter_hint(said: str, user_filter: str) -> str:
    """``; <hint>`` after MLflow's rejection ``said`` of ``user_filter`` where a value has the wrong
    type: parameters and tags are strings in MLflow (``params.epochs = 2`` got only "Expected a
    quoted string value ...": a trial), metrics numbers; else empty. The hint names the quoted
    clause for the user to give: the filter is not rewritten (``params.epochs > 2`` quoted
    compares strings, not numbers)."""
    import re  # noqa: PLC0415

    if "Expected a quoted string value" in said or "is either not quoted or unidentified quote" in said:
        # (a bare word, params.compressor = fft, got MLflow's "either not quoted or unidentified
        # quote types", and typographic quotes the same: a trial)
        clause = re.search(r"\b((?:params|tags)\.(?:`[^`]+`|\"[^\"]+\"|[\w.-]+))\s*(!=|=|<=|>=|<|>|I?LIKE)\s*"
                           r"([\w.+-]+|[‘’“”][^‘’“”]*[‘’“”])", user_filter, re.IGNORECASE)
        name, op, value = clause.groups() if clause else ("params.epochs", "=", "2")
        value = value.strip("‘’“”")
        if op in ("<", ">", "<=", ">="):
            return (f"; parameters and tags are strings in MLflow, compared as strings with =, !=, LIKE or ILIKE "
                    f"only ({name} = '{value}'); metrics are numbers, compared with < and >")
        return (f"; parameters and tags are strings in MLflow, compared as strings: quote the value "
                f"({name} {op} '{value}'); metrics are numbers, unquoted")
    if any(q in user_filter for q in "‘’“”"):  # (an editor's curly quotes: "Invalid clause(s)" alone)
        return "; the filter holds typographic quotes (‘ ’ “ ”): type straight quotes, ' around values"
    if "Expected numeric value type for metric" in said:
        clause = re.search(r"\b(metrics\.(?:`[^`]+`|\"[^\"]+\"|[\w.-]+))\s*(!=|=|<=|>=|<|>)\s*['\"]([^'\"]*)['\"]",
                           user_filter, re.IGNORECASE)
        name, op, value = clause.groups() if clause else ("metrics.wall_s", "<", "10")
        return f"; metrics are numbers: leave the value unquoted ({name} {op} {value}); parameters and tags are quoted"
    return ""


def cached_copies(runs: list[Any]) -> dict[str, str]:
    """Which of ``runs`` repeat an earlier run's result (tag :data:`CACHED_FROM_TAG`, served from
    Prefect's task cache), as ``{run_id: "run <id8>"}`` naming the run they copy where it is among
    ``runs`` (the same name, logged by the flow run in the tag), else ``"flow run <id8>"``."""
    copies = {}
    for r in runs:
        flow_run = r.data.tags.get(CACHED_FROM_TAG)
        if not flow_run:
            continue
        original = next((o for o in runs if o.data.tags.get("prefect.flow_run_id") == flow_run
                         and o.info.run_name == r.info.run_name and CACHED_FROM_TAG not in o.data.tags), None)
        copies[r.info.run_id] = f"run {original.info.run_id[:8]}" if original else f"flow run {flow_run[:8]}"
    return copies


# What MLflow's step counts in the step-wise metrics each pipeline logs, by the metric's name
# (prefix; the first that matches, "" any): the plot's x-axis said "step" for compressed training's
# per-epoch metrics (a trial). Other experiments: "step".
STEP_UNITS: dict[str, list[tuple[str, str]]] = {
    "compressed-training": [("collectives.", "message size (bytes)"), ("", "epoch")],
    "tensor-factorization": [("", "epoch (ALS sweep or ADMM iteration)")],
    "gemm": [("scaling.", "workers")],
    "nas": [("suggest_s", "suggestions made"), ("", "evaluations done")],
}


def step_unit(experiment: str, metric: str) -> str:
    """The x-axis label of ``metric``'s history in ``experiment`` (:data:`STEP_UNITS`), else ``"step"``."""
    return next((unit for prefix, unit in STEP_UNITS.get(experiment, []) if metric.startswith(prefix)), "step")


MAX_TOP = 50_000  # MLflow's largest max_results for search_runs


def compare_runs(tracker: Tracker, experiment: str, metrics: list[str], filter_string: str = "", top: int = 10,
                 out_dir: Path = Path("paperline-compare"), log: bool = False, ascending: bool = False,
                 all_runs: bool = False) -> dict[str, Any]:
    """Compare the runs of ``experiment``.

    Args:
        tracker: the MLflow tracker.
        experiment: experiment name (e.g. ``gemm``).
        metrics: metric keys to show and plot (a key given twice counts once); empty: the pipeline's headline metrics (tag
            ``paperline.headlines``: the list most of the newest 100 runs carry, the runs that
            have its first metric, sorted by it in its own direction), else every metric the
            runs share (up to 6; none: no plot). A named headline metric is sorted in its own
            direction too (another one ascending when :func:`lower_is_better` says so by its name); one that some runs maximize and others minimize (nas ``final_best``
            over different problems) is listed newest first, with a note.
        filter_string: an MLflow search filter, e.g. ``"params.routine = 'gemm'"``.
        top: at most this many runs, sorted by the first metric (descending, or ascending for
            losses and times), else newest first.
        ascending: sort ascending whatever the metric's direction, a headline's too (a note says
            where its pipeline ranks it highest first).
        out_dir: where ``<experiment>-runs.parquet`` and ``<experiment>-metrics.png`` are written.
        log: also log both files to a new ``comparison`` run of the experiment.
        all_runs: every run of the experiment. By default only the runs a pipeline compares with
            each other (tagged ``paperline.params_key``: the gemm, tensor and video flow runs, each
            nas campaign's parent run, each compressor's run of compressed training, not a nas
            campaign's per-evaluation child runs); every run when no run carries the tag. Cached
            copies (tag :data:`CACHED_FROM_TAG`: a re-run's result served from Prefect's task
            cache, the earlier run's metrics again) only here, with a ``cached copy of`` column.

    Runs of the experiment that MLflow shows RUNNING while Prefect has their flow run Crashed
    (a killed process) are ended first (:meth:`Tracker.end_orphaned_runs`).

    Returns:
        ``{"columns", "rows", "parquet", "plot" (None without metrics), "comparison_run_id",
        "selection", "metrics", "note"}`` (``note``: the cached copies left out, what the default
        headline left out, what ``ascending`` reversed, why runs are not ranked, the parameters
        that differ beyond the :data:`MAX_PARAM_COLUMNS`
        shown; else empty).

    Raises:
        InputError: unknown experiment (known ones listed; a pipeline's that has not run yet
            said so), an invalid filter (as given; a value of the wrong type with a hint,
            :func:`filter_hint`), no runs (an empty experiment named as such;
            runs that only ``all_runs`` would list pointed to), a metric no run has, top < 1 or over
            :data:`MAX_TOP`, an
            output directory that cannot be made.
    """
    from mlflow.exceptions import MlflowException

    if top < 1:
        raise InputError("--top", top, "must be at least 1")
    if top > MAX_TOP:  # (MLflow's refusal was reported as the --filter's, given or not: a trial)
        raise InputError("--top", top, f"must be at most {MAX_TOP} (the most runs one MLflow search returns)")
    if not experiment.strip():
        raise InputError("experiment", experiment, "name an MLflow experiment, e.g. gemm")
    if out_dir.exists() and not out_dir.is_dir():
        raise InputError("--out", str(out_dir), "exists and is not a directory")
    metrics = list(dict.fromkeys(metrics))  # --metric x --metric x: one column, one panel
    client = tracker.client
    exp = client.get_experiment_by_name(experiment)
    if exp is None:
        known = sorted(e.name for e in client.search_experiments())
        raise InputError("experiment", experiment, f"no such MLflow experiment{_not_run_yet(experiment)}; "
                                                   f"known: {', '.join(known) or 'none'}")
    # a run whose flow process was killed shows RUNNING until swept: Prefect has it Crashed by now
    tracker.end_orphaned_runs([exp.experiment_id])
    user_filter = filter_string.strip()

    def rejected(exc: MlflowException) -> InputError:
        said = str(exc).splitlines()[0][:300]
        return InputError("--filter", user_filter, f"MLflow rejected it: {said}{filter_hint(said, user_filter)}")

    if user_filter:  # alone first: MLflow's message then quotes the user's filter, not the clauses added here
        try:
            client.search_runs([exp.experiment_id], filter_string=user_filter, max_results=1)
        except MlflowException as exc:
            raise rejected(exc) from None
    clauses = [user_filter] if user_filter else []
    clauses.append(NOT_COMPARISON)  # earlier `--log` runs are not runs to compare
    selection = "all runs; earlier --log comparisons aside"
    keyed = not all_runs and bool(client.search_runs([exp.experiment_id], filter_string=KEY_FILTER, max_results=1))
    if keyed:
        selection = "pipeline runs; --all-runs for every run"
    left_out = ([KEY_FILTER] if keyed else []) + ([] if all_runs else [NOT_CACHED])
    query = " and ".join([*clauses, *left_out])

    def search(order: list[str], limit: int, where: str = query) -> list[Any]:
        try:
            return client.search_runs([exp.experiment_id], filter_string=where, order_by=order, max_results=limit)
        except MlflowException as exc:
            raise rejected(exc) from None

    # the cached copies the selection leaves out, counted (up to MLflow's page of 1000)
    copies = 0 if all_runs else len(search([], 1000, " and ".join([*clauses, *([KEY_FILTER] if keyed else []),
                                                                     CACHED])))

    recent = search(["attributes.start_time DESC"], HEADLINE_SAMPLE)
    headline_default = False
    unshown: list[str] = []  # headline metrics past the table's MAX_METRICS
    note = ""
    asked = ""  # what --ascending changed
    if not metrics:  # the pipeline's headline metrics, best first in their own direction
        headlines = _common_headlines(recent)
        if headlines:
            metrics = [m for m, _ in headlines][:MAX_METRICS]
            unshown = [m for m, _ in headlines][MAX_METRICS:]
            # --ascending, asked for, sorts ascending here too: it was ignored without --metric,
            # compressed training's accuracies still best first (a trial)
            if ascending and headlines[0][1]:
                asked = f"lowest {metrics[0]} first, as --ascending asks (its pipeline ranks it highest first)"
            ascending = ascending or not headlines[0][1]
            headline_default = True
    elif ascending:  # as asked, whatever the metric's own direction; said where it is recorded the other way
        if _directions(recent, metrics[0]) == {True}:
            asked = f"lowest {metrics[0]} first, as --ascending asks (its pipeline ranks it highest first)"
    else:  # a named headline metric is ranked in its own direction (wall_s: fastest first)
        directions = _directions(recent, metrics[0])
        if directions == {False} or (not directions and lower_is_better(metrics[0])):
            ascending = True
        elif len(directions) > 1:  # nas final_best: maximized accuracy beside minimized Levy values
            ranked_by = " ".join(f"params.{k} = {v!r}" for k, v in _example_kind(recent, metrics[0]).items())
            note = (f"{metrics[0]} is maximized in some runs and minimized in others: listed newest first, not "
                    f"ranked" + (f"; --filter \"{ranked_by}\" ranks runs of one kind" if ranked_by else ""))
    order = ["attributes.start_time DESC"] if note or not metrics else \
        [f"metrics.`{metrics[0]}` {'ASC' if ascending else 'DESC'}"]
    if headline_default:  # only the runs that have the headline (a user-data tensor run has others)
        found = search(order, max(top, HEADLINE_SAMPLE))
        ranked = [r for r in found if metrics[0] in r.data.metrics]
        runs = ranked[:top]
        others = [r for r in found if metrics[0] not in r.data.metrics]
        if others and not ranked:  # e.g. --filter "attributes.status = 'FAILED'": none got as far as the headline
            runs = search(["attributes.start_time DESC"], top)
            note = f"none of these runs has {metrics[0]}: listed newest first"
            asked = ""  # (not ranked)
            metrics = []  # the metrics they share, below
        elif others and all_runs:  # every run asked for: those without the headline come last, not left out
            runs = (ranked + others)[:top]
            shown = len(runs) - len(ranked[:top])
            if shown:
                note = f"the last {shown} run(s) have no {metrics[0]} (listed newest first, after the ranked ones)"
        elif others:  # e.g. nas: single-objective campaigns have final_best, not final_hypervolume
            # the metric each left-out run is ranked by (its first headline), newest run's first
            # (only a metric a left-out run has: an all-failed campaign's headline is final_hypervolume too,
            # and the hint named the very metric it lacked: a trial)
            theirs = list(dict.fromkeys(h[0][0] for r in others for h in [_headline_list(r)]
                                        if h and h[0][0] in r.data.metrics))
            shows = "them" if len(theirs) == 1 else "the newest kind"
            hint = f"they rank by {', '.join(theirs)}: --metric {theirs[0]} shows {shows}" if theirs \
                else "none has a headline metric (e.g. every evaluation failed): --all-runs lists them too"
            note = (f"{len(others)}{'+' if len(found) == max(top, HEADLINE_SAMPLE) else ''} run(s) without "
                    f"{metrics[0]} left out ({hint})")
    else:
        runs = search(order, top)
        lacking = [r for r in runs if metrics and metrics[0] not in r.data.metrics]
        # as for the default headline: runs without a --metric were listed as nan rows (a trial);
        # ranked by it, they come after every run that has it, so none of those is lost here
        if lacking and len(lacking) < len(runs) and not all_runs and not note:
            more = "+" if len(runs) == top else ""  # (those past --top are not counted)
            runs = [r for r in runs if metrics[0] in r.data.metrics]
            note = f"{len(lacking)}{more} run(s) without {metrics[0]} left out (--all-runs lists them too)"
    if not runs:
        raise _no_runs(client, exp.experiment_id, experiment, user_filter, " and ".join(clauses) if left_out else "")
    valued = [r for r in runs if metrics and metrics[0] in r.data.metrics]  # (a run without it is not ranked)
    # nas: hypervolumes of live-mnist (5.7e9) and NAS-Bench-201 (5.6) ranked as one list; compressed
    # training: accuracies on MNIST and Fashion-MNIST (trials). (video-curation's `dataset` is the
    # name it writes, not what it reads.)
    kinds = [("problem", "problems")] + ([("dataset", "datasets")] if experiment == "compressed-training" else [])
    if experiment == "nas":  # a hypervolume is measured in its objectives' space, from its reference point: a
        # 3-objective campaign's 524 ranked above 2-objective ones' 5.7, unsaid (a trial)
        kinds += [("problem_options", "problem options or objectives"), ("ref_point_used", "reference points")]
    for param, what in kinds:
        values = sorted({r.data.params[param] for r in valued if param in r.data.params})
        if metrics and order[0] != "attributes.start_time DESC" and len(values) > 1:
            shown = [_compact(v) for v in values[:4]]
            # (a JSON value holds double quotes: the filter is quoted for the shell as a whole)
            mixed = (f"ranked across {len(values)} {what} ({', '.join(shown)}"
                     f"{', ...' if len(values) > 4 else ''}), whose {metrics[0]} values do not compare: "
                     f"--filter {_shell_quoted(f'params.{param} = {_sql_quoted(values[0])}')} ranks one")
            note = f"{note}; {mixed}" if note else mixed
            if param == "problem":  # (other problems have other options: one note says it)
                break
    contents = list(dict.fromkeys(r.data.tags[DATA_TAG] for r in valued if DATA_TAG in r.data.tags))
    if metrics and order[0] != "attributes.start_time DESC" and len(contents) > 1:
        # a user's tensor file edited between runs: its old and new contents ranked as one (a trial)
        mixed = (f"ranked across {len(contents)} contents of the data (tag {DATA_TAG}): --filter "
                 f"\"tags.`{DATA_TAG}` = '{contents[0]}'\" ranks one content's runs")
        note = f"{note}; {mixed}" if note else mixed
    if len(runs) == top and len(search(["attributes.start_time DESC"], min(top + 1, MAX_TOP))) > top:  # "10 run(s)" of 12 (a trial)
        more = f"more runs than the {top} shown match: --top N shows more"
        note = f"{note}; {more}" if note else more
    if copies:
        cached = (f"{copies}{'+' if copies == 1000 else ''} cached cop{'y' if copies == 1 else 'ies'} left out "
                  f"(runs repeating an earlier run's result, served from Prefect's task cache: tag "
                  f"{CACHED_FROM_TAG}): --all-runs shows them")
        note = f"{cached}; {note}" if note else cached
    if asked:
        note = f"{asked}; {note}" if note else asked
    if unshown and metrics:  # (tensor-factorization's fit_s headlines were left out unsaid: a trial)
        rest = (f"{len(unshown)} more headline metric(s) not shown ({', '.join(unshown[:3])}"
                f"{', ...' if len(unshown) > 3 else ''}): --metric names the ones to show")
        note = f"{note}; {rest}" if note else rest
    if not metrics:
        shared = set.intersection(*(set(r.data.metrics) for r in runs))
        metrics = sorted(shared)[:MAX_METRICS]
    for m in metrics:
        if not any(m in r.data.metrics for r in runs):
            others = search(["attributes.start_time DESC"], HEADLINE_SAMPLE, NOT_COMPARISON) if user_filter else []
            if any(m in r.data.metrics for r in others):
                # the filter's runs lack it, not the experiment ("no run has it; known: " and an empty
                # list, for failed runs that logged nothing: a trial)
                bare = "" if any(r.data.metrics for r in runs) else "; they logged no metric at all (failed or " \
                                                                     "killed before their first)"
                shown = f" (the --top {top} listed)" if len(runs) >= top else ""
                raise InputError("--metric", m, f"none of the {len(runs)} run(s) --filter selects{shown} has it{bare}; "
                                                f"other runs of {experiment!r} do: widen or drop --filter")
            names = sorted({k for r in [*runs, *recent] for k in r.data.metrics})  # the shown and the newest runs
            raise InputError("--metric", m, f"no run of {experiment!r} has it (give the bare name, no 'metrics.'); "
                                            f"known: {first_few(names, NAMES_SHOWN)}")
    params = sorted({k for r in runs for k in r.data.params})
    varying = [k for k in params if len({_param(r, k) for r in runs}) > 1]
    # a parameter equal to every run's name (compressed training's compressor runs are named after
    # it) repeats the name column and took the room of a --metric at 80 columns (a trial): the
    # Parquet file keeps it
    varying = [k for k in varying if any(r.data.params.get(k) != r.info.run_name for r in runs)]
    # ... and one that names each run's own place (gemm's default output holds its flow run's id):
    # different in every run by construction, it took a column of two gemm runs of other sizes (a trial)
    varying = [k for k in varying if not all(_names_its_own_run(r, k) for r in runs)]
    if len(varying) > MAX_PARAM_COLUMNS:  # e.g. --all-runs of compressed training: parent and child runs
        # differ in ~15; the table shows those with the most distinct values, the Parquet file all
        # where a run wrote (gemm's default output is per run: the most varied, and the least telling)
        # goes last; then the most varied first
        # the parameters that say what was run (model, dataset, ...) are kept before the most varied ones:
        # compressed training's LSTM rows stood beside ResNet rows without a model column (a trial)
        shown = sorted(varying, key=lambda k: (_locations(r.data.params.get(k) for r in runs), k not in WHAT_RAN,
                                               -len({r.data.params.get(k) for r in runs})))[:MAX_PARAM_COLUMNS]
        left = [k for k in varying if k not in shown]
        more = (f"{len(left)} more parameter(s) differ between these runs, in the Parquet file: "
                f"{', '.join(left[:12])}{' ...' if len(left) > 12 else ''}")
        note = f"{note}; {more}" if note else more
        varying = [k for k in varying if k in shown]
    flagged = any("paperline.regression" in r.data.tags for r in runs)
    originals = cached_copies(runs)  # (--all-runs: else none is listed)
    columns = ["run", "name", "status", *(["cached copy of"] if originals else []), *[f"params.{k}" for k in varying],
               *metrics, *(["regression vs best earlier"] if flagged else [])]
    rows = []
    for r in runs:
        rows.append([r.info.run_id[:8], r.info.run_name, r.info.status,
                     *([originals.get(r.info.run_id, "")] if originals else []),
                     *[_param(r, k, "") for k in varying],
                     *[r.data.metrics.get(m, math.nan) for m in metrics],
                     *([r.data.tags.get("paperline.regression", "")] if flagged else [])])
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise InputError("--out", str(out_dir), f"cannot create the directory: {exc.strerror or exc}") from None
    parquet = out_dir / f"{experiment}-runs.parquet"
    _write_parquet(runs, params, parquet)
    plot: Path | None = None
    if metrics:  # runs that share no metric (e.g. --all-runs of nas) get the table and the Parquet
        plot = out_dir / f"{experiment}-metrics.png"
        histories = {(r.info.run_id, m): latest_per_step(client.get_metric_history(r.info.run_id, m))
                     for r in runs for m in metrics}
        _overlay_plot(runs, metrics, histories, plot, experiment)
    comparison_run_id = None
    if log:
        comparison_run_id = tracker.start_run(experiment, run_name="comparison",
                                              tags={"paperline.compare.filter": filter_string or "",
                                                    "paperline.compare.runs": ",".join(r.info.run_id for r in runs)},
                                              params={"metrics": ",".join(metrics), "top": top,
                                                      "ascending": ascending})
        tracker.log_artifact(comparison_run_id, str(parquet))
        if plot is not None:
            tracker.log_artifact(comparison_run_id, str(plot))
        tracker.end_run(comparison_run_id, "FINISHED")
    return {"columns": columns, "rows": rows, "parquet": str(parquet), "plot": str(plot) if plot else None,
            "comparison_run_id": comparison_run_id, "selection": selection, "metrics": metrics, "note": note}


def _not_run_yet(experiment: str) -> str:
    """``: the <name> pipeline has not run here yet ...`` where ``experiment`` is a pipeline's name
    (each pipeline logs to the experiment of its name), else empty."""
    from paperline.flows.pipelines import _entry_points, get_pipeline, pipeline_names
    from paperline.infra.errors import PaperlineError

    if experiment not in pipeline_names():
        return ""
    if experiment in _entry_points():  # a package's
        try:
            get_pipeline(experiment)
        except PaperlineError as exc:  # ("run it first" of a package that cannot run: a trial)
            return f" (the {experiment} pipeline has not run here yet, and it cannot run: {exc})"
    return f" (the {experiment} pipeline has not run here yet: run `paperline run {experiment}` first)"


def _no_runs(client: Any, experiment_id: str, experiment: str, user_filter: str, unkeyed: str) -> InputError:
    """The error for a selection with no run: the experiment has none (no filter given), or none
    match the filter; when the default selection left out runs that ``--all-runs`` would list
    (``unkeyed``: the query without it; failed runs carry no ``paperline.params_key``, cached
    copies carry :data:`CACHED_FROM_TAG`), it says so."""
    found = client.search_runs([experiment_id], filter_string=unkeyed, max_results=100) if unkeyed else []
    if found:
        kinds = [*(["runs that ended before their results: FAILED, or KILLED by a cancel or a crash"]
                   if any(CACHED_FROM_TAG not in r.data.tags for r in found) else []),
                 *(["cached copies of earlier runs' results"] if any(CACHED_FROM_TAG in r.data.tags for r in found)
                   else [])]
        more = f"runs the default selection leaves out ({'; '.join(kinds)}) do: --all-runs lists them"
        if not user_filter:
            return InputError("experiment", experiment, f"no pipeline runs to compare, but {more}")
        return InputError("--filter", user_filter, f"no pipeline runs of experiment {experiment!r} match, but {more}")
    if not user_filter:
        return InputError("experiment", experiment, f"the experiment has no runs{_not_run_yet(experiment)}")
    # (a filter matching only earlier `--log` comparison runs said "no runs match", --all-runs too: a trial)
    comparisons = client.search_runs([experiment_id], filter_string=f"{user_filter} and attributes.run_name = "
                                                                    "'comparison'", max_results=1)
    also = (": only earlier `compare --log` comparison runs do, which compare never lists (the MLflow UI shows "
            "them)") if comparisons else _unknown_keys(client, experiment_id, user_filter)
    return InputError("--filter", user_filter, f"no runs in experiment {experiment!r} match{also}")


def _unknown_keys(client: Any, experiment_id: str, user_filter: str) -> str:
    """``: no run of it has params.x (its params: a, b)`` for the keys the filter names that none of
    the experiment's last 200 runs has (a misspelt name matched nothing, said as an empty match:
    a trial), else empty."""
    import re  # noqa: PLC0415

    named = re.findall(r"\b(params|metrics|tags)\.(?:`([^`]+)`|\"([^\"]+)\"|([\w.-]+))", user_filter)
    if not named:
        return ""
    runs = client.search_runs([experiment_id], max_results=200)
    have = {kind: set().union(*(getattr(r.data, kind).keys() for r in runs)) if runs else set()
            for kind in ("params", "metrics", "tags")}
    unknown = [(kind, next(n for n in names if n)) for kind, *names in named]
    unknown = [(kind, name) for kind, name in unknown if name not in have[kind]]
    if not unknown:
        return ""
    kinds = sorted({kind for kind, _ in unknown})
    # (cut as --metric's list is: a user's tensor runs named ~190 metrics, 12 KB on one line: a trial)
    known = "; ".join(f"its {kind}: "
                      f"{first_few(sorted(k for k in have[kind] if not k.startswith('mlflow.')), NAMES_SHOWN) or 'none'}"
                      for kind in kinds)
    return f": no run of it has {', '.join(f'{k}.{n}' for k, n in unknown)} ({known})"


def _write_parquet(runs: list[Any], params: list[str], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    metric_keys = sorted({k for r in runs for k in r.data.metrics})
    table = {
        "run_id": [r.info.run_id for r in runs],
        "run_name": [r.info.run_name for r in runs],
        "status": [r.info.status for r in runs],
        "start_time": [time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(r.info.start_time / 1000)) for r in runs],
    }
    if any(CACHED_FROM_TAG in r.data.tags for r in runs):  # (--all-runs: the flow run whose result each repeats)
        table["cached_from_flow_run_id"] = [r.data.tags.get(CACHED_FROM_TAG) for r in runs]
    for k in params:
        table[f"params.{k}"] = [_param(r, k) for r in runs]
    for k in metric_keys:
        table[f"metrics.{k}"] = [r.data.metrics.get(k) for r in runs]
    pq.write_table(pa.table(table), path)


LINESTYLES = ("-", "--", "-.", ":")
MARKERS = ("o", "s", "^", "v", "D", "x")


def same_as(series: list[tuple[str, list[tuple[int, float]]]]) -> list[str | None]:
    """For each ``(label, points)`` line, the label of the first earlier line with the same points
    (drawn over it), else None."""
    first: dict[tuple, str] = {}
    same = []
    for label, points in series:
        key = tuple(points)
        same.append(first.get(key))
        first.setdefault(key, label)
    return same


def latest_per_step(history: list[Any]) -> list[tuple[int, float]]:
    """``(step, value)`` of an MLflow metric history, one per step: the one logged last. A run
    that logs a final value again when it goes on (an extended nas campaign's ``final_best`` at
    step 0, twice) was drawn as a vertical line at step 0 (a trial)."""
    latest: dict[int, float] = {}
    for h in sorted(history, key=lambda h: h.timestamp):  # (stable: same-millisecond points keep MLflow's order)
        latest[h.step] = h.value
    return sorted(latest.items())


def _overlay_plot(runs: list[Any], metrics: list[str], histories: dict, path: Path,
                  experiment: str = "") -> dict[str, str]:
    """One panel per metric: lines over the steps (labelled by what the pipeline of ``experiment``
    counts in them, :func:`step_unit`), or, where every run logged the metric once (a
    throughput, a final accuracy), one bar per run in the table's order (a line plot showed a dot
    per run at step 0). Returns each metric's kind of panel, ``"lines"`` or ``"bars"``."""
    from matplotlib.ticker import MaxNLocator

    from paperline.tasks.reporting import _plt

    plt = _plt()
    fig, axes = plt.subplots(1, len(metrics), figsize=(4.2 * len(metrics), 3.2), squeeze=False)
    kinds = {}
    for ax, m in zip(axes[0], metrics):
        series = [(f"{r.info.run_name} ({r.info.run_id[:6]})", sorted(histories[(r.info.run_id, m)])) for r in runs]
        series = [(label, points) for label, points in series if points]
        ax.set_title(m, fontsize=9)
        if series and all(len(points) == 1 for _, points in series):
            kinds[m] = "bars"
            ax.barh(range(len(series)), [points[0][1] for _, points in series])
            ax.set_yticks(range(len(series)), [label for label, _ in series], fontsize=6)
            ax.invert_yaxis()  # the first run of the table on top
            ax.set_xlabel(m)
            continue
        kinds[m] = "lines"
        # a line identical to an earlier one hid it, its legend entry naming a line not seen (a
        # trial: cached copies under --all-runs): each run its own dash and marker, and the legend says
        for i, ((label, points), same) in enumerate(zip(series, same_as(series))):
            ax.plot([p[0] for p in points], [p[1] for p in points], linestyle=LINESTYLES[i % len(LINESTYLES)],
                    marker=MARKERS[i % len(MARKERS)], markersize=4, markerfacecolor="none",
                    label=f"{label} = {same}" if same else label)
        ax.set_xlabel(step_unit(experiment, m))
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # MLflow steps are whole (epochs showed 0.5 ticks)
        ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return kinds
