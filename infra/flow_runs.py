"""The flow runs a `paperline serve` or `paperline worker` process executes, and what becomes of
them when that process is stopped.

Stopping either with Ctrl-C or SIGTERM ends the flow-run subprocesses it started (Prefect's
runner and process worker terminate them), but nothing tells the Prefect server: the runs stayed
Running until the zombie automation (``infra.stack.ensure_zombie_automation``) crashed them for
their missing heartbeats, 90 s later, with a message blaming a dead process (fresh-user trial;
Prefect issue #16746). :func:`watch_flow_runs` records which runs the process's descendants
execute while it serves, and on leaving marks Crashed, at once and saying why, each run whose
process has ended while the server still has it in a non-final state; for `paperline serve`, also
each run it had claimed (Pending) and not yet started, which nothing else would ever start.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import threading
from collections.abc import Collection
from typing import Any, Callable, Iterator

FLOW_RUN_ENV = "PREFECT__FLOW_RUN_ID"  # set by Prefect's runner and process worker in a flow run's process


def flow_run_processes(pid: int) -> dict[str, int]:
    """The flow runs executed below process ``pid``: flow-run id -> PID of the topmost descendant
    whose environment names it (the run's engine process, not its Dask workers, which inherit it).

    Processes that end or deny access while being read are left out.
    """
    import psutil  # noqa: PLC0415

    try:
        children = psutil.Process(pid).children(recursive=True)
    except psutil.Error:
        return {}
    runs: dict[str, int] = {}
    owner: dict[int, str] = {}
    for child in children:  # breadth-first: a parent comes before its children
        try:
            run_id = child.environ().get(FLOW_RUN_ENV)
            parent = child.ppid()
        except psutil.Error:
            continue
        if run_id:
            owner[child.pid] = run_id
            if owner.get(parent) != run_id:
                runs.setdefault(run_id, child.pid)
    return runs


def _pid_alive(pid: int) -> bool:
    import psutil  # noqa: PLC0415

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def crash_lost_runs(seen: dict[str, int], who: str, *, wait_s: float = 10.0,
                    report: Callable[[str], None] | None = None,
                    why: str | None = None) -> tuple[list[str], list[str]]:
    """Mark Crashed each run of ``seen`` (flow-run id -> engine PID) whose process has ended
    (waiting up to ``wait_s`` seconds for it) while the Prefect server (``PREFECT_API_URL``) still
    has it Pending or Running; a run still executing is left to report its own end.

    Args:
        seen: From :func:`flow_run_processes`.
        who: The stopped command, for the state message (e.g. ``paperline serve``).
        report: Called with one line per run it acted on (the terminal).
        why: How the processes ended, for the state message and the lines, instead of ``who``
            stopping (``"its process ended while the Prefect server was away"``).

    Returns:
        (ids marked Crashed, ids still executing). Server errors are reported, not raised: this
        runs while the process exits.
    """
    import time  # noqa: PLC0415

    from prefect.client.orchestration import get_client  # noqa: PLC0415
    from prefect.client.schemas.objects import StateType  # noqa: PLC0415
    from prefect.client.schemas.responses import SetStateStatus  # noqa: PLC0415
    from prefect.states import Crashed  # noqa: PLC0415

    say = report or (lambda _line: None)
    deadline = time.monotonic() + wait_s
    alive = {run_id for run_id, pid in seen.items() if _pid_alive(pid)}
    while alive and time.monotonic() < deadline:
        time.sleep(0.2)
        alive = {run_id for run_id in alive if _pid_alive(seen[run_id])}
    crashed: list[str] = []
    for run_id in sorted(alive) if why is None else ():  # (an outage's check: only the ended ones count)
        say(f"flow run {run_id} is still executing (pid {seen[run_id]}); it reports its own end")
    lost = [run_id for run_id in seen if run_id not in alive]
    if not lost:
        return crashed, sorted(alive)
    try:
        with get_client(sync_client=True) as client:
            for run_id in lost:
                run = client.read_flow_run(run_id)
                # by type: the runner's claim is Pending named "Submitting" (passed over by name: a trial)
                if run.state is None or run.state.type not in (StateType.PENDING, StateType.RUNNING):
                    continue
                message = (f"`{who}` was stopped while this run was executing; its process (pid {seen[run_id]}) "
                           "ended with it." if why is None else
                           f"{_capitalized(why)} (pid {seen[run_id]}, `{who}`); its end was not recorded.")
                # not forced: a run that reported its own end meanwhile keeps it
                result = client.set_flow_run_state(run_id, Crashed(message=message))
                if result.status == SetStateStatus.ACCEPT:
                    crashed.append(run_id)
                    say(f"flow run {run.name!r} ({run_id}) marked Crashed: "
                        + (f"{who} stopped while it was executing" if why is None else why))
    except Exception as exc:  # noqa: BLE001 - the process is exiting; the zombie automation is the backstop
        # (it said "the interrupted flow runs" of a run that had ended minutes before: a trial)
        say(f"could not check whether the {len(lost)} flow run(s) it executed lately ended "
            f"({type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}); one left Running is marked Crashed by the server's "
            "automation, once the server is up, when its heartbeats have stopped")
    return crashed, sorted(alive)


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def crash_unstarted_runs(deployments: list[str], who: str, *, executing: set[str] = frozenset(),
                         report: Callable[[str], None] | None = None, why: str | None = None,
                         before: datetime.datetime | None = None) -> list[str]:
    """Mark Crashed each Pending run of ``deployments`` (``"flow/deployment"`` names) that no
    process executes: what a stopped `paperline serve` had claimed (Pending) but not yet started.
    Nothing else serves those deployments (one serve per stack), so such a run stayed Pending,
    holding its deployment's only concurrency slot, until cancelled by hand.

    Args:
        deployments: The deployments the stopped command served.
        who: The stopped command, for the state message.
        executing: Ids of runs whose process is still there (left alone: they report their end).
        report: Called with one line per run marked.
        why: What became of the claimed runs, for the state message and the lines, instead of
            ``who`` stopping.
        before: Only runs Pending since before this time (timezone-aware): one claimed since is
            about to start.

    Returns:
        The ids marked Crashed. Server errors are reported, not raised (this runs while exiting).
    """
    from prefect.client.orchestration import get_client  # noqa: PLC0415
    from prefect.client.schemas.filters import (  # noqa: PLC0415
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType  # noqa: PLC0415
    from prefect.client.schemas.responses import SetStateStatus  # noqa: PLC0415
    from prefect.exceptions import ObjectNotFound  # noqa: PLC0415
    from prefect.states import Crashed  # noqa: PLC0415

    say = report or (lambda _line: None)
    crashed: list[str] = []
    try:
        with get_client(sync_client=True) as client:
            ids = []
            for name in deployments:
                with contextlib.suppress(ObjectNotFound):
                    ids.append(client.read_deployment_by_name(name).id)
            if not ids:
                return crashed
            runs = client.read_flow_runs(
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=ids)),
                flow_run_filter=FlowRunFilter(state=FlowRunFilterState(type=FlowRunFilterStateType(
                    any_=[StateType.PENDING]))))
            for run in runs:
                if str(run.id) in executing or (before is not None and run.state is not None
                                                and run.state.timestamp >= before):
                    continue
                message = (f"`{who}` was stopped after claiming this run, before its process started; run it again."
                           if why is None else f"{_capitalized(why)} (`{who}`); run it again.")
                result = client.set_flow_run_state(run.id, Crashed(message=message))  # not forced, as above
                if result.status == SetStateStatus.ACCEPT:
                    crashed.append(str(run.id))
                    say(f"flow run {run.name!r} ({run.id}) marked Crashed: "
                        + (f"{who} stopped before it started" if why is None else why))
    except Exception as exc:  # noqa: BLE001 - the process is exiting
        say(f"could not check for claimed flow runs that never started ({type(exc).__name__}: {exc}); "
            "cancel a run left Pending from the Prefect UI")
    return crashed


@contextlib.contextmanager
def watch_flow_runs(who: str, *, interval_s: float = 1.0, recent_s: float = 300.0,
                    report: Callable[[str], None] | None = None,
                    deployments: list[str] | None = None,
                    tracking_uri: str | None = None) -> Iterator[dict[str, int]]:
    """Record, every ``interval_s`` seconds on a daemon thread, the flow runs this process's
    descendants execute; on leaving (also on KeyboardInterrupt), :func:`crash_lost_runs` those
    seen executing in the last ``recent_s`` seconds: the runs the stop ended (a shutdown, even one
    killed after `paperline worker`'s 60 s grace, takes less), not every run of a long serve,
    each of which would cost a request. Older ones are forgotten as the thread goes. With
    ``tracking_uri``, the MLflow runs a run left RUNNING are ended once its process has ended and
    its flow run with it (:func:`paperline.infra.tracking.end_runs_of_ended_flow_runs`: on a
    thread of their own while serving; on leaving, at once for the recent runs whose process has
    ended).

    Args:
        who: The command, for the Crashed state's message (``paperline serve``).
        report: Called with one line per run acted on.
        deployments: Deployments that only this process serves (``"flow/deployment"``): their
            runs it claimed but had not started are marked Crashed too (:func:`crash_unstarted_runs`).
        tracking_uri: The stack's MLflow server, where the runs log.

    Yields:
        The runs seen so far (flow-run id -> engine PID), filled in as they are seen.
    """
    import time  # noqa: PLC0415

    seen: dict[str, int] = {}
    last_seen: dict[str, float] = {}
    stop = threading.Event()
    me = os.getpid()
    executing: set[str] = set()

    def end_mlflow_runs(run_ids: list[str], **kwargs: object) -> None:
        from paperline.infra.tracking import end_runs_of_ended_flow_runs  # noqa: PLC0415

        if tracking_uri is not None and run_ids:
            end_runs_of_ended_flow_runs(run_ids, tracking_uri, report=report, **kwargs)  # type: ignore[arg-type]

    def poll() -> None:
        while not stop.is_set():
            with contextlib.suppress(Exception):  # a process table read racing with exits
                now = time.monotonic()
                current = flow_run_processes(me)
                for run_id, pid in current.items():
                    seen.setdefault(run_id, pid)
                    last_seen[run_id] = now
                ended = sorted(executing - set(current))
                executing.clear()
                executing.update(current)
                if ended and tracking_uri is not None:
                    threading.Thread(target=end_mlflow_runs, args=(ended,), daemon=True,
                                     name="paperline-mlflow-run-end").start()
                for run_id in [r for r, t in last_seen.items() if now - t > recent_s]:
                    del last_seen[run_id], seen[run_id]
            stop.wait(interval_s)

    thread = threading.Thread(target=poll, name="paperline-flow-run-watch", daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join(timeout=5)
        now = time.monotonic()
        recent = {r: pid for r, pid in seen.items() if now - last_seen.get(r, now) <= recent_s}
        crashed, still = crash_lost_runs(recent, who, report=report)
        if deployments:
            with contextlib.suppress(Exception):
                still = [*still, *flow_run_processes(me)]  # one started since the last poll
            crash_unstarted_runs(deployments, who, executing=set(still), report=report)
        # (also those Prefect's runner marked ended, whose thread above had not yet looked: it waits)
        end_mlflow_runs(sorted(set(crashed) | (set(recent) - set(still))), waits_s=(0.0,))


# --------------------------------------------------------------------------------------------------
# What runs the stack's deployments (for `paperline status`)

POLLED_WITHIN_S = 90.0  # served deployments poll every 10 s, workers heartbeat every 30 s (Prefect's defaults)
LATE_AFTER_S = 60.0  # a Scheduled run this far past its start time is waiting for a process to take it


def _fresh(seconds: object) -> bool:
    """Whether a poll or heartbeat ``seconds`` ago (None: never) is recent: within :data:`POLLED_WITHIN_S`."""
    return isinstance(seconds, (int, float)) and seconds <= POLLED_WITHIN_S


def online_workers(workers: dict[str, list[dict[str, object]]], pool: str) -> list[dict[str, object]]:
    """The workers of work pool ``pool`` (``workers`` as :func:`deployment_report` takes them) that
    heartbeat within :data:`POLLED_WITHIN_S` and whose process is not known to have exited."""
    return [w for w in workers.get(pool, []) if _fresh(w.get("heartbeat_s_ago")) and not w.get("exited")]


def executed_now(deployment: dict[str, object], workers: dict[str, list[dict[str, object]]],
                 serve_pid: int | None) -> bool:
    """Whether a process takes ``deployment``'s runs now (its dicts as :func:`deployment_report`
    takes them): a worker of its work pool online, or, with no work pool, this state directory's
    `paperline serve` running or a poll within :data:`POLLED_WITHIN_S` (another serving process)."""
    pool = deployment.get("work_pool")
    if pool:
        return bool(online_workers(workers, str(pool)))
    return serve_pid is not None or _fresh(deployment.get("polled_s_ago"))


def deployment_report(deployments: list[dict[str, object]], workers: dict[str, list[dict[str, object]]],
                      late: dict[str, int], *, serve_pid: int | None = None) -> list[str]:
    """The lines `paperline status` prints about who executes the deployments' runs.

    A deployment does nothing by itself: its runs (scheduled, or triggered from the UI) wait
    Scheduled until a `paperline serve` (the ``<flow>/local`` deployments, no work pool) or a
    worker of its work pool (``prefect deploy --all``) takes them, and `status` said nothing of
    either (fresh-user trial).

    Args:
        deployments: One dict per deployment: ``name`` (``"flow/deployment"``), ``work_pool``
            (None for served ones), ``polled_s_ago`` (seconds since a process last asked for its
            runs; None: never), ``paused`` (the deployment is paused: a stopped serve pauses its
            own), ``schedule_paused`` (one of its schedules was paused, in the UI or with
            ``prefect deployment schedule pause``), ``kept_paused`` (paused in the Prefect UI
            while served: `serve` keeps it paused, :func:`paperline.deployments.paused_by_user`).
        workers: Work pool -> its workers, each ``{"name", "heartbeat_s_ago"}`` (None: never), and
            ``"exited": True`` for a `paperline worker` of this machine whose process is gone.
        late: Deployment name -> how many of its Scheduled runs are past their start time by
            more than :data:`LATE_AFTER_S`.
        serve_pid: The PID holding this state directory's `paperline serve` lock, if any.

    Returns:
        Lines (one saying so when there are no deployments).
    """
    from paperline.infra.stack import WORK_POOLS  # noqa: PLC0415

    def late_note(names: list[str]) -> str:
        n = sum(late.get(name, 0) for name in names)
        return f"; {n} scheduled run(s) past their start time wait for it" if n else ""

    lines: list[str] = []
    explained: set[str] = set()  # paused deployments a line has already said are
    served = [d for d in deployments if not d.get("work_pool")]
    if served:
        names = [str(d["name"]) for d in served]
        # a stopping serve pauses its deployments: one polled seconds ago and paused is not served
        if serve_pid is not None or any(_fresh(d.get("polled_s_ago")) and not d.get("paused") for d in served):
            who = f"`paperline serve` (pid {serve_pid})" if serve_pid is not None else "a serving process"
            # a paused one is not served (a package's pipeline uninstalled, its deployment left paused by
            # the serve before: counted here, and named paused below, a trial): counted apart
            # (one paused in the UI and kept so is served too: its triggered runs execute)
            now = [d for d in served if not d.get("paused") or d.get("kept_paused")] or served
            lines.append(f"deployments: {len(now)} served by {who}{late_note([str(d['name']) for d in now])}")
        elif all(d.get("paused") for d in served):
            # (said as two lines, "their runs wait Scheduled" then "paused deployments", they read as a
            # contradiction: a paused deployment schedules no runs; an upgrade trial)
            lines.append(f"deployments: {len(served)} without a work pool ({', '.join(sorted(names)[:3])}"
                         f"{', ...' if len(names) > 3 else ''}), not served now and paused (as a stopping "
                         "`paperline serve` leaves them): their schedules make no runs, and a run triggered now "
                         f"waits Scheduled until `paperline serve` runs, which unpauses those it paused itself{late_note(names)}")
            explained.update(n for n, d in zip(names, served) if not d.get("kept_paused"))
        else:
            lines.append(f"deployments: {len(served)} without a work pool ({', '.join(sorted(names)[:3])}"
                         f"{', ...' if len(names) > 3 else ''}), not served now: their runs wait Scheduled until "
                         f"`paperline serve` runs{late_note(names)}")
    pools = sorted({str(d["work_pool"]) for d in deployments if d.get("work_pool")})
    for pool in pools:
        names = [str(d["name"]) for d in deployments if d.get("work_pool") == pool]
        online = online_workers(workers, pool)
        if online:
            shown = ", ".join(f"{w['name']} (heartbeat {w['heartbeat_s_ago']:.0f} s ago)" for w in online[:3])
            lines.append(f"work pool {pool}: {len(names)} deployment(s), {len(online)} worker(s) online: "
                         f"{shown}{late_note(names)}")
        else:
            kind = next((k for k, name in WORK_POOLS.items() if name == pool), None)
            start = f"`paperline worker --pool {kind}`" if kind else "a worker of the pool"
            lines.append(f"work pool {pool}: {len(names)} deployment(s), no worker online: their runs wait "
                         f"Scheduled until {start} runs{late_note(names)}")
    # (a stopped serve pauses its deployments, which `prefect deployment schedule ls` does not show:
    # "paused schedules" named them, and a trial found every schedule active)
    kept = sorted(str(d["name"]) for d in deployments if d.get("paused") and d.get("kept_paused"))
    if kept:  # (said as paused by a stopping serve, which would unpause them: a trial)
        lines.append(f"paused in the Prefect UI while served, and kept paused by `paperline serve`: {', '.join(kept)} "
                     "(their schedules make no runs; a run triggered while served executes)")
    paused = sorted(str(d["name"]) for d in deployments
                    if d.get("paused") and d["name"] not in explained and d["name"] not in kept)
    if paused:
        lines.append(f"paused deployments: {', '.join(paused)}")
    schedules = sorted(str(d["name"]) for d in deployments if d.get("schedule_paused"))
    if schedules:
        lines.append(f"paused schedules (kept so by `paperline serve`): {', '.join(schedules)}")
    if not deployments:
        lines.append(f"deployments: `paperline serve` (pid {serve_pid}) is starting" if serve_pid is not None else
                     "deployments: none (`paperline serve`, or `prefect deploy --all` with `paperline worker`: "
                     "README \"Deployments\")")
    return lines


def serve_lock_holder(state_dir: os.PathLike[str] | str) -> int | None:
    """The PID of the `paperline serve` holding ``state_dir``'s ``serve.pid`` lock, or None when
    no process holds it (a file left by a stopped serve is not held)."""
    import fcntl  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    path = Path(state_dir) / "serve.pid"
    try:
        f = open(path)  # noqa: SIM115 - closed below; flock needs no write access
    except OSError:
        return None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            text = f.read().strip()
            return int(text) if text.isdigit() else -1
        fcntl.flock(f, fcntl.LOCK_UN)
    return None


def local_worker_name(pid: int) -> str:
    """The Prefect worker name `paperline worker` (process ``pid``) starts its worker under:
    ``paperline-<host>-<pid>``."""
    import socket  # noqa: PLC0415

    return f"paperline-{socket.gethostname()}-{pid}"


def _local_worker_pid(name: str) -> int | None:
    """The PID in ``name`` when it is a :func:`local_worker_name` of this machine; else None."""
    import socket  # noqa: PLC0415

    prefix = f"paperline-{socket.gethostname()}-"
    pid = name[len(prefix):] if name.startswith(prefix) else ""
    return int(pid) if pid.isdigit() else None


def _local_worker_exited(name: str) -> bool:
    """Whether ``name`` is a :func:`local_worker_name` of this machine whose `paperline worker`
    process is gone (its last heartbeat counts as online for 90 s more)."""
    pid = _local_worker_pid(name)
    return pid is not None and _worker_pid_gone(pid)


def _worker_pid_gone(pid: int) -> bool:
    """Whether no `paperline worker` process runs as ``pid`` (gone, or the PID used again)."""
    import psutil  # noqa: PLC0415

    try:
        cmdline = psutil.Process(pid).cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return True
    except psutil.Error:
        return False
    return not ("worker" in cmdline and any("paperline" in part for part in cmdline))  # a PID used again


def local_worker_pids(api_url: str, login: str | None) -> list[int]:
    """The PIDs of this machine's `paperline worker` processes that run for the Prefect server at
    ``api_url`` (their Prefect workers, named by :func:`local_worker_name`, in paperline's work
    pools), for ``paperline down`` to name what keeps running without its stack (it said nothing,
    and the worker went on silently: a trial). Empty when the server does not answer."""
    from prefect.client.orchestration import get_client  # noqa: PLC0415
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings  # noqa: PLC0415

    from paperline.infra.stack import WORK_POOLS  # noqa: PLC0415

    overrides = {PREFECT_API_URL: api_url, **({PREFECT_API_AUTH_STRING: login} if login is not None else {})}
    names: set[str] = set()
    with contextlib.suppress(Exception), temporary_settings(overrides), get_client(sync_client=True) as client:
        for pool in WORK_POOLS.values():
            with contextlib.suppress(Exception):  # (a pool deleted by its user)
                names.update(w.name for w in client.read_workers_for_work_pool(pool))
    return sorted(pid for pid in map(_local_worker_pid, names) if pid is not None and not _worker_pid_gone(pid))


def deployment_status(api_url: str, login: str | None, state_dir: os.PathLike[str] | str) -> list[str]:
    """:func:`deployment_report` and :func:`executing_report` for the Prefect server at ``api_url``,
    sending ``login`` (None: the environment's, as it is). Server errors give one line saying so;
    nothing raised."""
    from prefect.client.orchestration import get_client  # noqa: PLC0415
    from prefect.client.schemas.filters import (  # noqa: PLC0415
        DeploymentFilter,
        DeploymentFilterId,
        FlowRunFilter,
        FlowRunFilterExpectedStartTime,
        FlowRunFilterState,
        FlowRunFilterStateType,
    )
    from prefect.client.schemas.objects import StateType  # noqa: PLC0415
    from prefect.client.schemas.sorting import FlowRunSort  # noqa: PLC0415
    from prefect.exceptions import ObjectNotFound  # noqa: PLC0415
    from prefect.settings import PREFECT_API_AUTH_STRING, PREFECT_API_URL, temporary_settings  # noqa: PLC0415

    now = datetime.datetime.now(datetime.timezone.utc)
    overrides = {PREFECT_API_URL: api_url, **({PREFECT_API_AUTH_STRING: login} if login is not None else {})}

    def ago(when: datetime.datetime | None) -> float | None:
        return None if when is None else (now - when).total_seconds()

    from paperline.deployments import paused_by_user, polled_by_stopped_serve, read_serve_pauses  # noqa: PLC0415

    serve_pid = serve_lock_holder(state_dir)
    try:
        with temporary_settings(overrides), get_client(sync_client=True) as client:
            flows = {f.id: f.name for f in client.read_flows(limit=200)}
            found = client.read_deployments(limit=200)
            by_id = {d.id: f"{flows.get(d.flow_id, '?')}/{d.name}" for d in found}
            pauses = read_serve_pauses(state_dir)
            kept = set(paused_by_user(pauses, {by_id[d.id]: d for d in found if not d.work_pool_name}))
            if serve_pid is not None:  # paused while this serve runs (its record lists it as served unpaused: a
                # trial's status said "4 served" and "paused deployments: nas/local"), and polled by it
                kept.update(by_id[d.id] for d in found if not d.work_pool_name and d.paused and
                            (age := ago(d.last_polled)) is not None and age <= POLLED_WITHIN_S)
            # a poll by this stack's serve before it stopped is not a serving process's (resumed in the UI
            # just after the stop, one was said to be served: a trial)
            deployments = [{"name": by_id[d.id], "work_pool": d.work_pool_name,
                            "polled_s_ago": None if serve_pid is None and polled_by_stopped_serve(pauses, d.last_polled)
                            else ago(d.last_polled),
                            "paused": d.paused, "schedule_paused": any(not s.active for s in d.schedules),
                            "kept_paused": by_id[d.id] in kept}
                           for d in found]
            workers: dict[str, list[dict[str, object]]] = {}
            for pool in {d.work_pool_name for d in found if d.work_pool_name}:
                with contextlib.suppress(ObjectNotFound):  # a pool deleted under its deployments: none online
                    workers[pool] = [{"name": w.name, "heartbeat_s_ago": ago(w.last_heartbeat_time),
                                      "exited": _local_worker_exited(w.name)}
                                     for w in client.read_workers_for_work_pool(pool)]
            waiting = client.read_flow_runs(flow_run_filter=FlowRunFilter(
                state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
                expected_start_time=FlowRunFilterExpectedStartTime(
                    before_=now - datetime.timedelta(seconds=LATE_AFTER_S))), limit=200)
            executing = flow_runs_in_states(client, StateType.PENDING, StateType.RUNNING, StateType.CANCELLING)
            # the soonest of the unpaused deployments' (a paused one's runs wait for its serve; read
            # among every deployment's, 20 runs of a paused one hid the line: a trial)
            unpaused = [d.id for d in found if not d.paused]
            upcoming = client.read_flow_runs(
                flow_run_filter=FlowRunFilter(
                    state=FlowRunFilterState(type=FlowRunFilterStateType(any_=[StateType.SCHEDULED])),
                    expected_start_time=FlowRunFilterExpectedStartTime(after_=now)),
                deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=unpaused)),
                sort=FlowRunSort.EXPECTED_START_TIME_ASC, limit=UPCOMING_READ) if unpaused else []
    except Exception as exc:  # noqa: BLE001 - httpx/prefect errors: status reports, it does not fail on this
        from paperline.infra.errors import redact_text  # noqa: PLC0415

        # (httpx's message quotes the URL, with any password in a configured one: a review)
        return [f"deployments: could not read them from Prefect ({type(exc).__name__}: {redact_text(str(exc))})"]
    late: dict[str, int] = {}
    for run in waiting:
        if run.deployment_id in by_id:
            late[by_id[run.deployment_id]] = late.get(by_id[run.deployment_id], 0) + 1
    runs = [{"flow": flows.get(run.flow_id, "?"), "name": run.name, "deployment": by_id.get(run.deployment_id),
             "state": run.state.name if run.state else "?", "started_s_ago": ago(run.start_time)}
            for run in executing]
    soonest = [{"deployment": by_id[run.deployment_id], "seconds": (run.expected_start_time - now).total_seconds(),
                "at": run.expected_start_time} for run in upcoming
               if run.deployment_id in by_id and run.expected_start_time]
    taken = {str(d["name"]) for d in deployments if executed_now(d, workers, serve_pid)}
    return (deployment_report(deployments, workers, late, serve_pid=serve_pid) + next_run_report(soonest, taken)
            + executing_report(runs))


def next_run_report(soonest: list[dict[str, Any]], taken: Collection[str] | None = None) -> list[str]:
    """The line `paperline status` prints about the next scheduled run of an unpaused deployment
    (it named who serves the deployments, not when any would run: a user schedules them): the
    soonest of a deployment in ``taken``, else the soonest (the deployment lines say why it waits).
    The work pool's ``gemm/gemm``, no worker online, was named over the served ``gemm/local``'s
    run at the same time (a trial).

    Args:
        soonest: Upcoming runs, ``{"deployment", "seconds" (until it starts), "at" (datetime, UTC)}``.
        taken: The deployments whose runs a process takes now (:func:`executed_now`); None: all.

    Returns:
        ``["next scheduled run: gemm/local at 2026-12-08 03:30 UTC (in 18.9 h)"]`` (with ``; no
        process takes its runs now (above: what would)`` where none in ``taken`` has one), or nothing.
    """
    if not soonest:
        return []
    run = min(soonest, key=lambda r: (taken is not None and r["deployment"] not in taken, r["seconds"]))
    at = run["at"].astimezone(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    # none taken: said so on the line (it read as a run that would happen: a trial)
    idle = "; no process takes its runs now (above: what would)" if taken is not None and run["deployment"] not in taken else ""
    return [f"next scheduled run: {run['deployment']} at {at} (in {_duration(float(run['seconds']))}){idle}"]


SHOWN_RUNS = 5  # executing flow runs `status` names
UPCOMING_READ = 20  # scheduled runs read for `status`'s next one (the soonest that a process will take)
RUNS_READ = 200  # the most flow runs one read returns (the server's page)


def flow_runs_in_states(client: Any, *states: Any, limit: int = RUNS_READ) -> list[Any]:
    """The flow runs the Prefect server (``client``, sync) has in any of ``states`` (``StateType``),
    at most ``limit``."""
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterState, FlowRunFilterStateType  # noqa: PLC0415

    return client.read_flow_runs(flow_run_filter=FlowRunFilter(
        state=FlowRunFilterState(type=FlowRunFilterStateType(any_=list(states)))), limit=limit)


def executing_report(runs: list[dict[str, object]]) -> list[str]:
    """The line `paperline status` prints about the flow runs executing now (Pending, Running or
    Cancelling): `status` said who would execute a deployment's runs, not what ran (a trial).

    Args:
        runs: One dict per run: ``flow``, ``name`` (Prefect's run name), ``deployment``
            (``"flow/deployment"``; None for a run that `paperline run` or a script started),
            ``state`` (its name: ``Running``, ``Pending``, ...), ``started_s_ago`` (None: not started).

    Returns:
        One line: ``flow runs executing: none``, or their count and up to :data:`SHOWN_RUNS` of
        them, the longest running first.
    """
    if not runs:
        return ["flow runs executing: none"]
    ordered = sorted(runs, key=lambda r: -r["started_s_ago"] if isinstance(r["started_s_ago"], (int, float)) else 0)

    def one(r: dict[str, object]) -> str:
        started = r["started_s_ago"]
        since = f", for {_duration(started)}" if isinstance(started, (int, float)) else ""
        return f"{r['flow']} '{r['name']}' ({r['deployment'] or 'no deployment'}, {r['state']}{since})"

    more = f"; and {len(runs) - SHOWN_RUNS} more" if len(runs) > SHOWN_RUNS else ""
    count = f"{len(runs)}+" if len(runs) >= RUNS_READ else str(len(runs))  # (one read's page: there may be more)
    return [f"flow runs executing: {count}: " + "; ".join(one(r) for r in ordered[:SHOWN_RUNS]) + more]


def _duration(seconds: float) -> str:
    """``42 s``, ``3 min``, ``2.5 h``, ``5.9 d`` (from two days: a weekly schedule's next run)."""
    if seconds < 120:
        return f"{max(seconds, 0):.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    if seconds < 172800:
        return f"{seconds / 3600:.1f} h"
    return f"{seconds / 86400:.1f} d"
