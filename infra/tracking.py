"""MLflow tracking with explicit run ids.

The global active run of ``mlflow.start_run`` is neither thread- nor process-safe, so paperline never
uses it: :class:`Tracker` wraps ``MlflowClient`` and every call names its run id. A Tracker is picklable
(the client is created lazily), so it can travel to Dask workers.

Artifacts go through the tracking server (``--artifacts-destination s3://...``): clients need no S3
credentials.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import threading
import time
from typing import Any, Callable

from paperline.infra.errors import ServiceError, redact_text, redact_url
from paperline.infra.watch import down_reason

_FALLBACK_LIMITS = {"MAX_METRICS_PER_BATCH": 1000, "MAX_PARAMS_TAGS_PER_BATCH": 100,  # mlflow 3.17's values
                    "MAX_PARAM_VAL_LENGTH": 6000, "MAX_TAG_VAL_LENGTH": 8000}

STATUS_HINT = "`paperline status` shows what is down"  # the server was killed mid-run: where to look


def _shortened(text: str, limit: int) -> str:
    """``text`` cut to about ``limit`` characters at a word boundary, with "..." where cut (a
    message ended "Failed to est" mid-word: a trial)."""
    if len(text) <= limit:
        return text
    cut = text[:limit].rsplit(" ", 1)[0]
    return (cut if len(cut) > limit // 2 else text[:limit]) + " ..."


@functools.cache
def _limit(name: str) -> int:
    """MLflow's own limit ``name`` (``mlflow.utils.validation``), read when first needed: importing
    MLflow takes 0.8 s here, and every flow module imports this one, so a `paperline run` refused
    for a bad --set waited for it."""
    try:
        import mlflow.utils.validation as validation  # noqa: PLC0415
    except ImportError:  # pragma: no cover
        return _FALLBACK_LIMITS[name]
    return int(getattr(validation, name, _FALLBACK_LIMITS[name]))

_CONNECTION_HINTS = (
    "Max retries exceeded",
    "Connection refused",
    "ConnectionError",
    "Failed to establish a new connection",
    "Read timed out",
)


def _connection_cause(text: str) -> str:
    """The cause at the bottom of a failed request's text (MLflow's wrapping of urllib3's
    ``MaxRetryError``): ``[Errno 111] Connection refused``, ``read timed out``, ``the server closed
    the connection without a response``; else the text shortened to 300 characters. A tracking
    server that died mid-run ended the run with ~300 characters of urllib3's wrapping (an infra trial)."""
    import re  # noqa: PLC0415

    if errno := re.search(r"\[Errno -?\d+\] [^'\"()\]]+", text):
        return errno.group(0).rstrip()
    if "Read timed out" in text:
        return "read timed out (no answer)"
    if "RemoteDisconnected" in text or "Connection aborted" in text:
        return "the server closed the connection without a response"
    return _shortened(text, 300)


def _truncate(value: Any, limit: int) -> str:
    if isinstance(value, str):
        text = value
    elif isinstance(value, (dict, list, tuple)):
        text = json.dumps(value, default=str)
    else:
        text = str(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


class Tracker:
    """An MLflow tracking client bound to one tracking server.

    Args:
        tracking_uri: e.g. ``http://127.0.0.1:5000`` (see ``StackInfo.mlflow_tracking_uri``).
    """

    def __init__(self, tracking_uri: str):
        self.tracking_uri = tracking_uri.rstrip("/")
        self._client: Any = None
        self._lock = threading.Lock()
        self._experiment_of_run: dict[str, str] = {}
        self._swept = False  # whether start_run ended the orphaned runs of every experiment

    def __repr__(self) -> str:
        return f"Tracker({redact_url(self.tracking_uri)!r})"

    def __getstate__(self) -> dict[str, Any]:
        return {"tracking_uri": self.tracking_uri, "_experiment_of_run": dict(self._experiment_of_run)}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.tracking_uri = state["tracking_uri"]
        self._experiment_of_run = dict(state.get("_experiment_of_run", {}))
        self._client = None
        self._lock = threading.Lock()
        self._swept = False

    # -- plumbing -------------------------------------------------------------------------------------

    @property
    def client(self) -> Any:
        """The ``mlflow.tracking.MlflowClient`` (created on first use after a quick health check).

        Raises:
            ServiceError: The tracking server does not answer ``GET /health``, or this process's
                run watch found the local server dead (:func:`paperline.infra.watch.down_reason`:
                at once, where MLflow's retries held a stopped run ~30 s a call).
        """
        if (why := down_reason("mlflow")) is not None:
            raise ServiceError("mlflow", why, url=self.tracking_uri)
        if self._client is None:
            with self._lock:
                if self._client is None:
                    self.check()
                    from mlflow.tracking import MlflowClient  # noqa: PLC0415

                    # MLflow writes two "View run" lines to stdout per ended run; paperline prints
                    # the run URLs itself (a campaign ends one child run per evaluation).
                    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
                    # A tracking server that died mid-run: MLflow's 7 retries (backoff factor 2,
                    # sized for hosted servers' rate limits) held a run ~4 minutes per call, 8 in
                    # all, before it failed (a fresh-user trial); 4 retries give up after ~30 s.
                    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "4")
                    self._client = MlflowClient(tracking_uri=self.tracking_uri)
        return self._client

    def check(self) -> None:
        """Fail fast when the tracking server is down (MLflow's own client retries for minutes).

        Raises:
            ServiceError: ``GET {tracking_uri}/health`` did not return 200.
        """
        if not self.tracking_uri.startswith(("http://", "https://")):
            return  # a local file/sqlite store: nothing to reach
        import httpx  # noqa: PLC0415

        try:
            resp = httpx.get(f"{self.tracking_uri}/health", timeout=5.0)
        except httpx.HTTPError as exc:
            raise ServiceError("mlflow", f"GET /health failed: {exc}; {STATUS_HINT}", url=self.tracking_uri) from exc
        if resp.status_code != 200:
            raise ServiceError("mlflow", f"GET /health returned {resp.status_code}; {STATUS_HINT}", url=self.tracking_uri)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call the client, turning connection failures into ServiceError."""
        try:
            return fn(*args, **kwargs)
        except ServiceError:
            raise
        except Exception as exc:
            text = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, (ConnectionError, TimeoutError)) or any(h in text for h in _CONNECTION_HINTS):
                # killed mid-run, it ended the run with this alone (a trial): say where to look
                raise ServiceError("mlflow", f"{what} failed: {_connection_cause(text)}; {STATUS_HINT}",
                                   url=self.tracking_uri) from exc
            raise

    def _experiment_id(self, name: str) -> str:
        from mlflow.exceptions import MlflowException  # noqa: PLC0415

        exp = self._call("get experiment", self.client.get_experiment_by_name, name)
        if exp is not None:
            if exp.lifecycle_stage == "deleted":
                self._call("restore experiment", self.client.restore_experiment, exp.experiment_id)
            return exp.experiment_id
        try:
            return self._call("create experiment", self.client.create_experiment, name)
        except MlflowException as exc:  # created concurrently by another worker
            if "RESOURCE_ALREADY_EXISTS" not in str(getattr(exc, "error_code", "")) and "already exists" not in str(exc):
                raise
            return self._call("get experiment", self.client.get_experiment_by_name, name).experiment_id

    # -- runs -----------------------------------------------------------------------------------------

    def start_run(
        self,
        experiment: str,
        *,
        run_name: str,
        tags: dict[str, str] | None = None,
        params: dict[str, Any] | None = None,
        parent_run_id: str | None = None,
    ) -> str:
        """Create a run (and the experiment if missing) and log its parameters.

        Args:
            experiment: Experiment name.
            run_name: The run's display name.
            tags: Run tags (values truncated to MLflow's 8000 characters).
            params: Parameters; values are stringified (dicts/lists as JSON) and truncated to MLflow's
                6000 characters.
            parent_run_id: Makes this a child run of that run (``mlflow.parentRunId`` tag).

        Returns:
            The run id.

        Raises:
            ServiceError: The tracking server is unreachable.
        """
        exp_id = self._experiment_id(experiment)
        if not parent_run_id and not self._swept:
            self._swept = True
            self.end_orphaned_runs()
        all_tags = {k: _truncate(v, _limit("MAX_TAG_VAL_LENGTH")) for k, v in (tags or {}).items()}
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        run = self._call("create run", self.client.create_run, exp_id, tags=all_tags, run_name=run_name)
        run_id = run.info.run_id
        self._experiment_of_run[run_id] = exp_id
        self.log_params(run_id, params or {})
        return run_id

    def log_params(self, run_id: str, params: dict[str, Any]) -> None:
        """Log parameters on a run, as :meth:`start_run` does (values stringified, dicts and lists
        as JSON, truncated to MLflow's 6000 characters): ones known only once the run has worked
        (e.g. the Dask workers a GEMM ran on). A parameter already logged with another value is
        refused by MLflow (parameters are immutable).

        Raises:
            ServiceError: The tracking server is unreachable.
        """
        from mlflow.entities import Param  # noqa: PLC0415

        items = [Param(str(k), _truncate(v, _limit("MAX_PARAM_VAL_LENGTH"))) for k, v in params.items()]
        batch = _limit("MAX_PARAMS_TAGS_PER_BATCH")
        for i in range(0, len(items), batch):
            self._call("log params", self.client.log_batch, run_id, params=items[i : i + batch])

    def set_tags(self, run_id: str, tags: dict[str, Any]) -> None:
        """Set tags on a run (e.g. the Prefect flow-run id and URL).

        Raises:
            ServiceError: The tracking server is unreachable.
        """
        from mlflow.entities import RunTag  # noqa: PLC0415

        items = [RunTag(str(k), _truncate(v, _limit("MAX_TAG_VAL_LENGTH"))) for k, v in tags.items()]
        batch = _limit("MAX_PARAMS_TAGS_PER_BATCH")
        for i in range(0, len(items), batch):
            self._call("set tags", self.client.log_batch, run_id, tags=items[i : i + batch])

    def log_metrics(self, run_id: str, metrics: dict[str, float], step: int | None = None) -> None:
        """Log metrics in batches (one request per 1000 metrics).

        Args:
            run_id: The run.
            metrics: Name -> value.
            step: Step (e.g. epoch or evaluation index); None logs step 0.

        Raises:
            ServiceError: The tracking server is unreachable.
        """
        from mlflow.entities import Metric  # noqa: PLC0415

        ts = int(time.time() * 1000)
        items = [Metric(str(k), float(v), ts, step or 0) for k, v in metrics.items()]
        batch = _limit("MAX_METRICS_PER_BATCH")
        for i in range(0, len(items), batch):
            self._call("log metrics", self.client.log_batch, run_id, metrics=items[i : i + batch])

    def log_metric_steps(self, run_id: str, steps: list[tuple[int, dict[str, float]]]) -> None:
        """Log many steps' metrics (e.g. a whole training history) in as few requests as possible.

        Args:
            run_id: The run.
            steps: ``(step, {name: value})`` pairs.

        Raises:
            ServiceError: The tracking server is unreachable.
        """
        from mlflow.entities import Metric  # noqa: PLC0415

        ts = int(time.time() * 1000)
        items = [Metric(str(k), float(v), ts, int(step)) for step, metrics in steps for k, v in metrics.items()]
        batch = _limit("MAX_METRICS_PER_BATCH")
        for i in range(0, len(items), batch):
            self._call("log metrics", self.client.log_batch, run_id, metrics=items[i : i + batch])

    def log_artifact(self, run_id: str, local_path: str, artifact_path: str | None = None) -> None:
        """Upload a local file (or directory) as an artifact of the run.

        Args:
            run_id: The run.
            local_path: File or directory to upload.
            artifact_path: Directory inside the run's artifacts; None for the root.

        Raises:
            FileNotFoundError: ``local_path`` does not exist.
            ServiceError: The tracking server is unreachable.
        """
        from pathlib import Path  # noqa: PLC0415

        path = Path(local_path)
        if not path.exists():
            raise FileNotFoundError(f"artifact {local_path} does not exist")
        if path.is_dir():
            self._call("log artifacts", self.client.log_artifacts, run_id, str(path), artifact_path)
        else:
            self._call("log artifact", self.client.log_artifact, run_id, str(path), artifact_path)

    def log_text(self, run_id: str, text: str, artifact_file: str) -> None:
        """Store text as the artifact ``artifact_file`` (e.g. ``"reports/summary.md"``).

        Raises:
            ServiceError: The tracking server is unreachable.
        """
        self._call("log text", self.client.log_text, run_id, text, artifact_file)

    def log_dict(self, run_id: str, data: dict[str, Any], artifact_file: str) -> None:
        """Store a dict as a JSON (or YAML, by extension) artifact.

        Raises:
            ServiceError: The tracking server is unreachable.
        """
        self._call("log dict", self.client.log_dict, run_id, data, artifact_file)

    def end_run(self, run_id: str, status: str = "FINISHED") -> None:
        """Mark the run as ended.

        Args:
            run_id: The run.
            status: ``"FINISHED"``, ``"FAILED"`` or ``"KILLED"``.

        Raises:
            InputError: Unknown status.
            ServiceError: The tracking server is unreachable.
        """
        if status not in {"FINISHED", "FAILED", "KILLED"}:
            from paperline.infra.errors import InputError  # noqa: PLC0415

            raise InputError("status", status, "must be FINISHED, FAILED or KILLED")
        self._call("end run", self.client.set_terminated, run_id, status=status)

    def end_orphaned_runs(self, experiment_ids: list[str] | None = None) -> list[str]:
        """End the runs that MLflow still shows RUNNING while the Prefect flow run that logged them
        (tag ``prefect.flow_run_id``) has ended: a flow process killed outright (SIGKILL, OOM, a
        lost machine) never ends its MLflow run, and Prefect marks it Crashed later (`paperline
        up`'s heartbeat automation, ~90 s after its heartbeats stop). Crashed or cancelled flow runs
        end theirs KILLED, failed ones FAILED, with tag ``paperline.ended_by``; a run whose flow run
        Prefect still shows running ends KILLED when the process that logged it (tag
        :data:`PROCESS_TAG`, ``<pid>@<host>@<machine id>``) was of this machine and is gone. Called by :meth:`start_run` once per tracker for
        every experiment (a killed nas run was left RUNNING in the MLflow UI until the next nas
        run), by ``paperline compare`` for its experiment, and by `paperline serve` and `paperline
        worker` for a run whose process ended (:func:`end_runs_of_ended_flow_runs`); best effort:
        Prefect unreachable, or a flow run it does not know, leaves the run as it is.

        Args:
            experiment_ids: The experiments to sweep; None for every active one.

        Returns:
            The run ids ended.
        """
        return [ended[0] for ended in self._end_orphaned(experiment_ids, None)[0]]

    def _end_orphaned(self, experiment_ids: list[str] | None, flow_run_ids: list[str] | None
                      ) -> tuple[list[tuple[str, str, str, str]], list[str]]:
        """:meth:`end_orphaned_runs`, of the runs ``flow_run_ids`` logged (parents and children;
        None: every one): ((run id, flow-run id, status, flow-run state) of each run ended, the runs
        left RUNNING whose flow run has not ended yet)."""
        import logging  # noqa: PLC0415
        import uuid  # noqa: PLC0415

        log = logging.getLogger(__name__)
        running = "attributes.status = 'RUNNING' and "
        if flow_run_ids is None:
            filters = [running + "tags.`prefect.flow_run_id` LIKE '%'"]
        else:  # (ids from a process environment: only UUIDs get into a filter)
            filters = [running + f"tags.`prefect.flow_run_id` = '{uuid.UUID(i)}'" for i in flow_run_ids]
        try:
            if experiment_ids is None:
                experiment_ids = [e.experiment_id for e in self.client.search_experiments()]
            runs = [run for f in filters for run in self.client.search_runs(experiment_ids, filter_string=f,
                                                                             max_results=200)] \
                if experiment_ids else []
        except Exception as exc:  # noqa: BLE001 - best effort
            log.debug("orphaned-run sweep skipped: %s", exc)
            return [], []
        if not runs:
            return [], []
        ended: list[tuple[str, str, str, str]] = []
        left: list[str] = []
        try:
            from prefect.client.orchestration import get_client  # noqa: PLC0415

            with get_client(sync_client=True) as prefect:
                for run in runs:
                    flow_run_id = run.data.tags["prefect.flow_run_id"]
                    try:
                        state = prefect.read_flow_run(uuid.UUID(flow_run_id)).state
                    except Exception:  # noqa: BLE001 - unknown to this Prefect server: not ours to judge
                        continue
                    kind = state.type.value if state is not None else ""
                    process = run.data.tags.get(PROCESS_TAG, "")
                    if kind in ("CRASHED", "CANCELLED", "FAILED"):
                        status = "FAILED" if kind == "FAILED" else "KILLED"
                        why, said = f"Prefect flow run {state.name}", f"ended {state.name} with its process"
                    elif kind in ("PENDING", "RUNNING", "") and process_gone(process):
                        # killed outright on this host: Prefect marks it Crashed only when its
                        # heartbeats have stopped for ~90 s, and a run started meanwhile left the
                        # MLflow run RUNNING (an infra trial)
                        status, shown = "KILLED", state.name if state is not None else "unknown"
                        pid_host = "@".join(process.split("@")[:2])  # (the machine id is for the check)
                        why = (f"its process {pid_host} ended without ending it (killed outright: kill -9, out of "
                               f"memory) while Prefect showed the flow run {shown}")
                        said = f"lost its process {pid_host} (Prefect shows it {shown})"
                    else:
                        if kind in ("PENDING", "RUNNING", ""):
                            left.append(run.info.run_id)
                        continue
                    # as it is now: a nas campaign resumed meanwhile reopens its run, under its
                    # new flow run (ended here, it was shown KILLED while it logged: a review)
                    now = self.client.get_run(run.info.run_id)
                    if now.info.status != "RUNNING" or now.data.tags.get("prefect.flow_run_id") != flow_run_id \
                            or now.data.tags.get(PROCESS_TAG, "") != process:
                        continue
                    self.set_tags(run.info.run_id, {"paperline.ended_by": why})
                    self.end_run(run.info.run_id, status)
                    ended.append((run.info.run_id, flow_run_id, status, said))
        except Exception as exc:  # noqa: BLE001 - best effort
            log.debug("orphaned-run sweep stopped: %s", exc)
        return ended, left

    def end_failed(self, run_id: str, exc: BaseException) -> None:
        """End the run of a flow that raised ``exc``, saying why in tag ``paperline.ended_by``: a
        stop (Ctrl-C, SIGTERM, SIGHUP, or a cancellation from Prefect, which sends the flow's process
        SIGTERM: ``TerminationSignal``) ends it KILLED, anything else FAILED with the exception's
        first line (credentials redacted). A cancelled run read as a failure, with no reason (a trial).
        A run that failed because MLflow itself stopped answering is left for the next run's sweep
        (:meth:`end_orphaned_runs`).
        """
        from prefect.exceptions import TerminationSignal  # noqa: PLC0415

        if isinstance(exc, KeyboardInterrupt | TerminationSignal):
            status, why = "KILLED", ("stopped: cancelled from Prefect, or its process was sent SIGTERM"
                                     if isinstance(exc, TerminationSignal) else "stopped: interrupted (Ctrl-C, SIGTERM "
                                                                                "or SIGHUP)")
        else:
            status, why = "FAILED", f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        if isinstance(exc, ServiceError) and exc.service == "mlflow":  # its retries would hold the run ~30 s
            return  # more per call (a trial: minutes after `paperline down`); the next run ends it KILLED
        self.end_run(run_id, status)  # first: with MLflow gone, one call's retries, not two
        with contextlib.suppress(Exception):  # the tag is the extra; the ending is what matters
            self.set_tags(run_id, {"paperline.ended_by": redact_text(why)})

    def reopen_run(self, run_id: str) -> None:
        """Mark an ended run as running again (a resumed campaign goes on logging to its run),
        dropping the ``paperline.ended_by`` tag an interrupted attempt was ended with.

        Raises:
            ServiceError: The tracking server is unreachable.
        """
        run = self._call("read run", self.client.get_run, run_id)
        if "paperline.ended_by" in run.data.tags:
            self._call("delete tag", self.client.delete_tag, run_id, "paperline.ended_by")
        self._call("reopen run", self.client.update_run, run_id, status="RUNNING")

    def run_exists(self, run_id: str) -> bool:
        """Whether the run exists and is not deleted.

        Raises:
            ServiceError: The tracking server is unreachable.
        """
        from mlflow.exceptions import MlflowException  # noqa: PLC0415

        try:
            run = self.get_run(run_id)
        except MlflowException:
            return False
        return run.info.lifecycle_stage != "deleted"

    def get_run(self, run_id: str) -> Any:
        """The ``mlflow.entities.Run`` with its parameters, metrics and tags.

        Raises:
            ServiceError: The tracking server is unreachable. MlflowException: no such run.
        """
        return self._call("get run", self.client.get_run, run_id)

    def search_runs(self, experiment_ids: list[str], filter_string: str = "", order_by: list[str] | None = None,
                    max_results: int = 1000) -> list[Any]:
        """Runs matching an MLflow search filter (one page of at most ``max_results``).

        Raises:
            ServiceError: The tracking server is unreachable.
        """
        return list(self._call("search runs", self.client.search_runs, experiment_ids, filter_string=filter_string,
                               order_by=order_by, max_results=max_results))

    def child_run_tags(self, experiment: str, parent_run_id: str) -> list[dict[str, str]]:
        """The tags of every child run of ``parent_run_id`` in ``experiment`` (all pages).

        Raises:
            ServiceError: The tracking server is unreachable.
        """
        exp_id = self._experiment_id(experiment)
        out: list[dict[str, str]] = []
        token = None
        while True:
            page = self._call("search runs", self.client.search_runs, [exp_id],
                              filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'", max_results=1000,
                              page_token=token)
            out += [dict(r.data.tags) for r in page]
            token = page.token
            if not token:
                return out

    def run_url(self, run_id: str) -> str:
        """The run's page in the MLflow UI: ``{uri}/#/experiments/{experiment_id}/runs/{run_id}``
        (without a password in the URI: it is printed and logged).

        Raises:
            ServiceError: The tracking server is unreachable (only if the run was not started here).
        """
        exp_id = self._experiment_of_run.get(run_id)
        if exp_id is None:
            exp_id = self._call("get run", self.client.get_run, run_id).info.experiment_id
            self._experiment_of_run[run_id] = exp_id
        return redact_url(f"{self.tracking_uri}/#/experiments/{exp_id}/runs/{run_id}")


def end_runs_of_ended_flow_runs(flow_run_ids: list[str], tracking_uri: str, *, waits_s: tuple[float, ...] = (5.0, 55.0),
                                report: Callable[[str], None] | None = None) -> list[str]:
    """End the MLflow runs that the Prefect flow runs ``flow_run_ids``, whose processes have ended,
    left RUNNING (:meth:`Tracker.end_orphaned_runs`): a served run killed outright (SIGKILL, OOM)
    is marked Crashed by Prefect's runner at once, but its MLflow runs showed RUNNING in the MLflow
    UI until the next run of any pipeline started. Tries after each wait of ``waits_s`` (seconds)
    while some of those runs are left with their flow run not yet ended (the runner or worker
    reports the exit within a second or two; the heartbeat automation within ~90 s). Best effort:
    nothing is raised (it runs on a watch's thread).

    Returns:
        The MLflow run ids ended.
    """
    import time  # noqa: PLC0415

    tracker = Tracker(tracking_uri)
    ended: list[tuple[str, str, str, str]] = []
    for wait in waits_s:
        time.sleep(wait)
        try:
            now_ended, left = tracker._end_orphaned(None, list(flow_run_ids))
        except Exception:  # noqa: BLE001 - best effort (MLflow or Prefect away): the next run's sweep ends them
            break
        ended += now_ended
        if not left:
            break
    if report is not None:
        for flow_run_id in dict.fromkeys(e[1] for e in ended):
            mine = [e for e in ended if e[1] == flow_run_id]
            report(f"flow run {flow_run_id} {mine[0][3]}: {len(mine)} MLflow run(s) it left RUNNING marked {mine[0][2]}")
    return [e[0] for e in ended]


DEPLOYMENT_TAG = "prefect.deployment"  # "<flow>/<deployment>" of a deployment's run
PROCESS_TAG = "paperline.process"  # "<pid>@<host>@<machine id>" of the process that logs the run


def this_process() -> str:
    """``<pid>@<host>@<machine id>`` of this process (:func:`paperline.infra.storage.this_machine`),
    the value of :data:`PROCESS_TAG`: the machine id keeps two machines of one host name apart."""
    from paperline.infra.storage import this_machine  # noqa: PLC0415

    host, machine_id = this_machine()
    return f"{os.getpid()}@{host}@{machine_id}"


def process_gone(process: str) -> bool:
    """True when ``process`` (:func:`this_process`'s value) names a process of this machine that no
    longer exists (:func:`paperline.infra.storage.gone_from_this_machine`). False for a live one (a
    PID reused since reads as live: the run is left to Prefect's crash detection), another
    machine's, or a malformed value."""
    from paperline.infra.storage import gone_from_this_machine  # noqa: PLC0415

    pid, _, rest = process.partition("@")
    host, _, machine_id = rest.partition("@")
    return pid.isdigit() and gone_from_this_machine(int(pid), host, machine_id)


def prefect_run_tags(info: Any) -> dict[str, str]:
    """The MLflow tags that tie a run to the Prefect flow run this code runs in: its id, its page
    (``info``: the stack's :class:`~paperline.infra.stack.StackInfo`) and, for a deployment's
    run, :data:`DEPLOYMENT_TAG` (``gemm/local``): runs of serve's and of a worker's deployment
    could not be told apart in MLflow (a trial). A deployment that cannot be read leaves the tag
    out (it is not worth failing a run for)."""
    from prefect.context import FlowRunContext  # noqa: PLC0415
    from prefect.runtime import deployment, flow_run  # noqa: PLC0415

    tags = {"prefect.flow_run_id": str(flow_run.id), "prefect.flow_run_url": info.flow_run_url(flow_run.id),
            PROCESS_TAG: this_process()}
    context = FlowRunContext.get()
    if context is not None and context.flow_run is not None and context.flow_run.deployment_id is None:
        return tags  # (`paperline run`, a script: no deployment, and no call to the server to be told)
    try:
        name = deployment.name
    except Exception:  # noqa: BLE001 - (the server away a moment: the run goes on without it)
        name = None
    if name:
        tags[DEPLOYMENT_TAG] = f"{flow_run.flow_name}/{name}"
    return tags
