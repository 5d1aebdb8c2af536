"""The latest run against the best earlier run of the same parameters, with regressions flagged.

Every pipeline names its *headline* metrics (the first one ranks the runs) and a *parameter key*
(a digest of the parameters that define what a run computes: output locations and run names left
out). After a run has logged its metrics, :func:`compare_with_best_earlier` finds the experiment's
other FINISHED runs that carry the same key (every one has ended before the latest run ends; a
resumed nas campaign reopens its own run, which is left out), picks the best one by the first
headline, and compares every headline of the latest run with it. A headline worse than the best by
more than its relative tolerance is a regression.

What it records on the latest run (so that the MLflow UI can filter on it):

* tags ``paperline.params_key``, ``paperline.headlines`` (JSON ``[[metric, higher_is_better]]``),
  ``paperline.best_earlier_run_id`` (empty when there is nothing earlier), ``paperline.regression``
  (``"true"``, ``"false"``, or ``"none"`` when there is nothing earlier) and
  ``paperline.regressed_metrics`` (comma-separated, possibly empty);
* metrics ``vs_best_earlier.<metric>``: latest / best (a ratio, 1 = equal).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field
from typing import Any

from paperline.infra.errors import InputError
from paperline.infra.tracking import Tracker

KEY_TAG = "paperline.params_key"
HEADLINES_TAG = "paperline.headlines"  # [[metric, higher_is_better], ...]: what `paperline compare` shows first
# on a run that repeats another's result (served from Prefect's task cache): not an earlier run of its own
CACHED_FROM_TAG = "paperline.cached_from_flow_run_id"
# set on the log records of :func:`check_latest`: the flow's summary holds the same lines, so the
# terminal of `paperline run` (which prints the summary) leaves these records to the Prefect UI
IN_SUMMARY = "paperline_in_summary"
MAX_EARLIER = 1000  # the most recent earlier runs searched (MLflow's page size)


@dataclass(frozen=True)
class Headline:
    """A metric a pipeline's runs are judged by.

    Args:
        metric: The MLflow metric name (its latest value is compared).
        higher_is_better: True for throughput or accuracy, False for times, losses and errors.
        tolerance: Relative worsening, as a fraction of the best run's value, beyond which the
            latest run is flagged (timings on a shared machine vary by 5-20%).
        timed_by: For a timing (a rate or a duration): the metric holding the seconds of the
            part timed; a latest run whose part took less than ``min_seconds`` is not judged
            (its verdict says so). A 256-cube GEMM (0.05 s) was flagged REGRESSION in 5 of 14
            runs at 0.35-0.9x the best earlier (a fresh-user trial): the host's noise.
        min_seconds: See ``timed_by``.

    Raises:
        InputError: An empty name, a negative tolerance or ``min_seconds``.
    """

    metric: str
    higher_is_better: bool
    tolerance: float = 0.05
    timed_by: str | None = None
    min_seconds: float = 1.0

    def __post_init__(self) -> None:
        if not self.metric:
            raise InputError("metric", self.metric, "must be a metric name")
        if not (self.tolerance >= 0):
            raise InputError("tolerance", self.tolerance, "must be >= 0 (a fraction of the best value)")
        if not (self.min_seconds >= 0):
            raise InputError("min_seconds", self.min_seconds, "must be >= 0")


@dataclass
class MetricComparison:
    """One headline of the latest run against the best earlier run."""

    metric: str
    latest: float
    best: float
    higher_is_better: bool
    tolerance: float
    timed_s: float | None = None  # the seconds the latest run's timed part took (Headline.timed_by)
    min_seconds: float = 0.0

    @property
    def judged(self) -> bool:
        """False for a timing whose latest run took less than ``min_seconds``: noise, not judged."""
        return self.timed_s is None or self.timed_s >= self.min_seconds

    @property
    def ratio(self) -> float:
        """latest / best (nan when best is 0)."""
        return self.latest / self.best if self.best else math.nan

    @property
    def worsening(self) -> float:
        """How much worse the latest is, as a fraction of |best| (negative: better)."""
        if self.best == 0:
            return 0.0 if self.latest == 0 else (math.inf if (self.latest < 0) == self.higher_is_better else -math.inf)
        change = (self.latest - self.best) / abs(self.best)
        return -change if self.higher_is_better else change

    @property
    def regression(self) -> bool:
        """True when the latest is worse than the best by more than ``tolerance``
        (:attr:`worsening`), and :attr:`judged`."""
        return self.judged and self.worsening > self.tolerance

    def text(self) -> str:
        """One line, ``<metric> <latest> vs <best>: <verdict>``; the verdict is
        ``REGRESSION (...)``, ``equal`` (within 0.05%) or ``x.x% better``/``worse``, the last with
        ``, not judged (...)`` for a timing too short to judge."""
        word = "better" if self.worsening < 0 else "worse"
        if self.regression:
            verdict = f"REGRESSION (more than {100 * self.tolerance:g}% worse)"
        elif abs(self.worsening) < 5e-4:
            verdict = "equal"
        else:
            verdict = f"{100 * abs(self.worsening):.1f}% {word}"
            if not self.judged:  # (not after "equal": a cached re-run's equal timings read as they are)
                verdict += (f", not judged (timed over {self.timed_s:.3g} s, under {self.min_seconds:g} s: the host's "
                            "noise; a larger problem is judged)")
        return f"{self.metric} {self.latest:.4g} vs {self.best:.4g}: {verdict}"


@dataclass
class BestEarlier:
    """The outcome of :func:`compare_with_best_earlier`."""

    key: str
    earlier_runs: int
    best_run_id: str | None = None
    best_run_url: str | None = None
    metrics: list[MetricComparison] = field(default_factory=list)
    first_run_note: str = "first finished run with these parameters: no earlier run to compare with"

    @property
    def regression(self) -> bool:
        """True when any headline regressed."""
        return any(m.regression for m in self.metrics)

    @property
    def regressed(self) -> list[str]:
        """The names of the headlines that regressed, in headline order."""
        return [m.metric for m in self.metrics if m.regression]

    def lines(self, label: str = "") -> list[str]:
        """Summary lines for the CLI and the flow log (``label``: e.g. the compressor's name)."""
        who = f"{label}: " if label else ""
        if self.best_run_id is None:
            return [f"{who}{self.first_run_note}"]
        head = (f"{who}{'REGRESSION against' if self.regression else 'no regression against'} the best of "
                f"{self.earlier_runs} earlier run(s) with these parameters ({self.best_run_url or self.best_run_id})")
        changed = [m for m in self.metrics if not m.text().endswith(": equal")]
        equal = [m.metric for m in self.metrics if m not in changed]
        # named when few: a cached re-run prints its own wall-clock rate beside "equal" (the trial
        # read the video run's 19.6 video-s per s against 12.5 as a contradiction)
        names = f": {', '.join(equal)}" if len(equal) <= 3 else ""
        tail = [f"  {'all' if not changed else 'the other'} {len(equal)} metric(s) equal{names}"] if equal else []
        return [head] + [f"  {m.text()}" for m in changed] + tail

    def as_dict(self) -> dict[str, Any]:
        """JSON-able outcome for a flow's summary (``versus_best_earlier``): the parameter
        key, earlier runs, best run id, regression flag and regressed metrics, and per metric its
        latest and best values, ratio, regression flag and whether it was judged (a timing whose
        ``timed_s`` is under ``min_seconds`` is not; ``timed_s`` None: not a timing)."""
        return {"params_key": self.key, "earlier_runs": self.earlier_runs, "best_run_id": self.best_run_id,
                "regression": self.regression, "regressed_metrics": self.regressed,
                "metrics": {m.metric: {"latest": m.latest, "best": m.best, "ratio": m.ratio,
                                       "regression": m.regression, "judged": m.judged, "timed_s": m.timed_s,
                                       "min_seconds": m.min_seconds} for m in self.metrics}}


def params_key(params: dict[str, Any]) -> str:
    """A 16-hex-digit digest of ``params`` (JSON, sorted keys; values stringified when needed)."""
    blob = json.dumps(params, sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def run_key(params: dict[str, Any]) -> str:
    """:func:`params_key` of ``params``, with the configured Dask scheduler's host when there is
    one (``dask_scheduler_address``, its scheme and port aside: a jobqueue scheduler comes up on
    another port each time): a run on a cluster of one's own was compared with the best run on the
    local cluster, and a 16-worker cluster's runs would flag every local run as a regression (an
    infra trial). Runs on the local cluster keep the key they always had."""
    from urllib.parse import urlsplit  # noqa: PLC0415

    from paperline.infra.settings import get_settings  # noqa: PLC0415

    address = get_settings().dask_scheduler_address
    if not address:
        return params_key(params)
    try:
        host = urlsplit(address if "://" in address else f"tcp://{address}").hostname or address
    except ValueError:
        host = address
    return params_key({**params, "dask_scheduler_host": host.lower()})


def _finite(metrics: dict[str, float], name: str) -> float | None:
    v = metrics.get(name)
    return float(v) if v is not None and math.isfinite(v) else None


def compare_with_best_earlier(tracker: Tracker, run_id: str, key: str, headlines: list[Headline]) -> BestEarlier:
    """Compare run ``run_id`` with the best earlier FINISHED run of its experiment with the same key.

    The run is tagged with ``key`` first, so that later runs find it once it has finished. Runs
    that lack the first headline (e.g. failed before logging it) are not candidates; neither is
    ``run_id`` itself (a resumed campaign's reopened run), nor a run tagged
    :data:`CACHED_FROM_TAG` (a repeat of another run's cached result).

    Args:
        tracker: The MLflow tracker.
        run_id: The latest run (its metrics already logged).
        key: Its parameter key (see :func:`params_key`).
        headlines: The metrics to compare; the first ranks the earlier runs, the next ones break
            its ties (equal accuracies of cached runs: the fastest is the best).

    Returns:
        The comparison (also recorded on the run as tags and ``vs_best_earlier.*`` metrics).

    Raises:
        InputError: No headline given.
        ServiceError: The tracking server is unreachable.
    """
    if not headlines:
        raise InputError("headlines", headlines, "name at least one metric")
    tracker.set_tags(run_id, {KEY_TAG: key, HEADLINES_TAG: json.dumps([[h.metric, h.higher_is_better]
                                                                       for h in headlines])})
    run = tracker.get_run(run_id)
    latest = dict(run.data.metrics)
    earlier = tracker.search_runs(
        [run.info.experiment_id], filter_string=f"tags.`{KEY_TAG}` = '{key}' and attributes.status = 'FINISHED'",
        order_by=["attributes.end_time DESC"], max_results=MAX_EARLIER)
    # (a run repeating a cached result is the run that trained it again: the original is the one
    # to compare with, and to name as the best)
    earlier = [r for r in earlier if r.info.run_id != run_id and CACHED_FROM_TAG not in r.data.tags]
    rank = headlines[0]
    candidates = [r for r in earlier if _finite(r.data.metrics, rank.metric) is not None]
    out = BestEarlier(key=key, earlier_runs=len(candidates))
    if not candidates:
        tracker.set_tags(run_id, {"paperline.regression": "none", "paperline.best_earlier_run_id": "",
                                  "paperline.regressed_metrics": ""})
        return out
    def merit(r: Any) -> tuple[float, ...]:  # better is larger; a tie on one headline goes to the next
        values = [_finite(r.data.metrics, h.metric) for h in headlines]
        return tuple(-math.inf if v is None else (v if h.higher_is_better else -v) for h, v in zip(headlines, values))

    best = max(candidates, key=merit)
    out.best_run_id, out.best_run_url = best.info.run_id, tracker.run_url(best.info.run_id)
    for h in headlines:
        a, b = _finite(latest, h.metric), _finite(best.data.metrics, h.metric)
        if a is not None and b is not None:
            timed = _finite(latest, h.timed_by) if h.timed_by else None
            out.metrics.append(MetricComparison(h.metric, a, b, h.higher_is_better, h.tolerance, timed, h.min_seconds))
    tracker.set_tags(run_id, {"paperline.best_earlier_run_id": out.best_run_id,
                              "paperline.regression": "true" if out.regression else "false",
                              "paperline.regressed_metrics": ",".join(out.regressed)})
    ratios = {f"vs_best_earlier.{m.metric}": m.ratio for m in out.metrics if math.isfinite(m.ratio)}
    if ratios:
        tracker.log_metrics(run_id, ratios)
    return out


def check_latest(tracker: Tracker, run_id: str, params: dict[str, Any], headlines: list[Headline],
                 label: str = "", first_run_note: str | None = None) -> BestEarlier:
    """:func:`compare_with_best_earlier` keyed on ``params`` (and the cluster: :func:`run_key`), its lines logged to the flow run's
    log (a regression as a warning, so that it stands out in the Prefect UI), each record marked
    with the attribute :data:`IN_SUMMARY` (the flows put the same lines in their summaries). In a
    deployment's run (its own process: :data:`paperline.infra.flow_runs.FLOW_RUN_ENV` set) only a
    regression is logged here: the flow's summary, which holds these lines, is logged at its end
    (:func:`paperline.infra.pipeline_flow.log_summary`), and its log said "first finished run with
    these parameters" twice (a review).

    Args:
        tracker: The MLflow tracker.
        run_id: The latest run.
        params: The parameters that define what the run computes (no output locations or names).
        headlines: As for :func:`compare_with_best_earlier`.
        label: Prefix of the lines (e.g. the compressor of a child run).
        first_run_note: What to say when there is no earlier run (default: that this is the first).

    Raises:
        InputError: No headline given. ServiceError: The tracking server is unreachable.
    """
    outcome = compare_with_best_earlier(tracker, run_id, run_key(params), headlines)
    if first_run_note is not None:
        outcome.first_run_note = first_run_note
    from paperline.infra.flow_runs import FLOW_RUN_ENV  # noqa: PLC0415

    if os.environ.get(FLOW_RUN_ENV) and not outcome.regression:
        return outcome
    logger = run_logger()
    for line in outcome.lines(label):
        (logger.warning if outcome.regression else logger.info)(line, extra={IN_SUMMARY: True})
    return outcome


def not_in_summary(record: Any) -> bool:
    """A logging filter: False for the records of :func:`check_latest` (for a terminal that prints
    the flow's summary, which holds the same lines)."""
    return not getattr(record, IN_SUMMARY, False)


def run_logger() -> Any:
    """The Prefect run logger of the flow or task run this code runs in (its records go to the
    run's log in the Prefect UI), else the ``paperline`` logger."""
    import logging  # noqa: PLC0415

    try:
        from prefect.exceptions import MissingContextError  # noqa: PLC0415
        from prefect.logging import get_run_logger  # noqa: PLC0415

        return get_run_logger()
    except (ImportError, MissingContextError):
        return logging.getLogger("paperline")
