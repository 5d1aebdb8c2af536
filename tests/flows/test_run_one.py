"""`paperline run`'s own process on the session stack (``flows/cli.py``'s ``_run_one``): what it
prints when the Prefect server is lost as the run finishes."""

import json

import pytest


@pytest.mark.stack
def test_a_run_whose_prefect_server_goes_as_it_finishes_prints_its_results(stack, monkeypatch, capsys, tmp_path):
    """A Prefect server killed after a run's work was done (its MLflow run FINISHED, its result in
    S3) ended the command `error: prefect ...` with no results printed (a trial): the flow's return
    value is kept past Prefect's failed final state report, printed and written to --summary-json,
    and the error says the work is done. The server's loss is the final report failing to connect."""
    import types

    import httpx
    from prefect import flow
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.task_runners import ThreadPoolTaskRunner

    from paperline.flows import cli
    from paperline.infra.errors import ServiceError
    from paperline.infra.settings import get_settings

    settings, info = stack
    body_done: list[bool] = []

    @flow(name="prefect-gone-probe")
    def probe(params: dict) -> dict:
        body_done.append(True)
        return {"table": {"columns": ["x"], "title": "probe", "rows": [[41]]}, "lines": ["probe line"],
                "prefect_flow_run_url": "-", "mlflow_run_url": "-"}

    real_set_state = SyncPrefectClient.set_flow_run_state

    def set_state(self, flow_run_id, state, *args, **kwargs):
        if body_done:  # the server gone once the body returned: the final report cannot connect
            raise httpx.ConnectError("[Errno 111] Connection refused", request=httpx.Request(
                "POST", f"{info.prefect_api_url}/flow_runs/{flow_run_id}/set_state"))
        return real_set_state(self, flow_run_id, state, *args, **kwargs)

    monkeypatch.setattr(SyncPrefectClient, "set_flow_run_state", set_state)
    monkeypatch.setenv("PAPERLINE_STATE_DIR", str(settings.state_dir))
    monkeypatch.setattr("paperline.infra.cluster.task_runner", lambda settings, started=None: ThreadPoolTaskRunner())
    monkeypatch.setitem(cli._state, "prefect_gone", False)
    get_settings.cache_clear()
    out = tmp_path / "summary.json"
    try:
        with pytest.raises(ServiceError) as raised:
            cli._run_one(types.SimpleNamespace(name="prefect-gone-probe", flow=probe), {}, out)
    finally:
        get_settings.cache_clear()
    assert body_done and cli._state["prefect_gone"]
    assert "stopped answering before the run's end was recorded (ConnectError" in str(raised.value)
    assert "its work is done (the results above, in MLflow and S3)" in str(raised.value)
    assert "also down" not in str(raised.value)  # the session stack's S3 and MLflow are up
    printed = capsys.readouterr().out
    assert "probe line" in printed and "41" in printed, printed
    assert json.loads(out.read_text())["table"]["rows"] == [[41]]


@pytest.mark.stack
@pytest.mark.parametrize("when", ["prefect-ends-the-run", "results-gathered", "turned-into-an-error"])
def test_a_ctrl_c_as_a_run_finishes_prints_its_results(stack, monkeypatch, capsys, tmp_path, when):
    """A Ctrl-C within a second of "Finished in state Completed()" said "interrupted before the
    flow run started: nothing ran" and printed no results, of a run Completed in Prefect and
    FINISHED in MLflow (a trial, twice). The interrupt lands as Prefect records the run's end, or
    as its retried tasks are looked up (or there, turned by a library into its own error: it was
    swallowed with the lookup's errors, the command exiting 0)."""
    import types

    from prefect import flow
    from prefect.client.orchestration import SyncPrefectClient
    from prefect.task_runners import ThreadPoolTaskRunner

    from paperline.flows import cli
    from paperline.infra.settings import get_settings

    settings, _ = stack
    body_done: list[bool] = []

    @flow(name="ctrl-c-at-the-end-probe")
    def probe(params: dict) -> dict:
        body_done.append(True)
        return {"table": {"columns": ["x"], "title": "probe", "rows": [[43]]}, "lines": ["probe line"],
                "prefect_flow_run_url": "-", "mlflow_run_url": "-"}

    if when == "prefect-ends-the-run":
        real_set_state = SyncPrefectClient.set_flow_run_state

        def set_state(self, flow_run_id, state, *args, **kwargs):
            if body_done and state.is_final():
                raise KeyboardInterrupt
            return real_set_state(self, flow_run_id, state, *args, **kwargs)

        monkeypatch.setattr(SyncPrefectClient, "set_flow_run_state", set_state)
    elif when == "results-gathered":
        def interrupted(_flow_run_id):
            raise KeyboardInterrupt

        monkeypatch.setattr(cli, "_retried_tasks", interrupted)
    else:
        from paperline.infra import interrupts

        def read_task_runs(self, *args, **kwargs):
            interrupts._RECEIVED["count"] += 1  # as the SIGINT handler counts it
            raise RuntimeError("cancelled")  # what a library made of the KeyboardInterrupt

        monkeypatch.setitem(interrupts._RECEIVED, "count", 0)  # restored after (see test_heap's CI lesson)
        monkeypatch.setattr(SyncPrefectClient, "read_task_runs", read_task_runs)
    monkeypatch.setenv("PAPERLINE_STATE_DIR", str(settings.state_dir))
    monkeypatch.setattr("paperline.infra.cluster.task_runner", lambda settings, started=None: ThreadPoolTaskRunner())
    monkeypatch.setitem(cli._state, "interrupt_said", False)
    out = tmp_path / "summary.json"
    get_settings.cache_clear()
    try:
        with pytest.raises(KeyboardInterrupt), cli._said_if_interrupted():
            cli._run_one(types.SimpleNamespace(name="gemm", flow=probe), {}, out)
    finally:
        get_settings.cache_clear()
    printed = " ".join(capsys.readouterr().out.split())
    assert "probe line" in printed and "43" in printed, printed
    assert "interrupted as the run finished: its work is done and tracked (the results above" in printed, printed
    assert "nothing ran" not in printed and "runs the multiply again" not in printed, printed
    assert json.loads(out.read_text())["table"]["rows"] == [[43]]


@pytest.mark.stack
def test_a_task_retried_after_a_failure_is_said_with_the_failure(stack, monkeypatch, capsys):
    """After a lost worker a retried task's results were printed as any others, nothing saying a
    task had failed (a trial): each task run that ran more than once gets a line naming the
    failure from its log (waited for: logs are sent in batches); a run without retries gets none."""
    import types

    from prefect import flow, task
    from prefect.task_runners import ThreadPoolTaskRunner

    from paperline.flows import cli
    from paperline.infra.settings import get_settings

    settings, _ = stack
    attempts: dict[int, int] = {}

    @task(name="flaky-probe", retries=2, persist_result=False)
    def flaky(i: int, fail: bool) -> int:
        attempts[i] = attempts.get(i, 0) + 1
        if fail and attempts[i] == 1:
            raise ConnectionError("worker tcp://127.0.0.1:1 lost")
        return 41

    @flow(name="retry-probe")
    def probe(params: dict) -> dict:
        values = [f.result() for f in [flaky.submit(i, params["fail"]) for i in range(params["tasks"])]]
        return {"table": {"columns": ["x"], "title": "probe", "rows": [[values[0]]]}, "lines": [],
                "prefect_flow_run_url": "-", "mlflow_run_url": "-"}

    monkeypatch.setenv("PAPERLINE_STATE_DIR", str(settings.state_dir))
    monkeypatch.setattr("paperline.infra.cluster.task_runner", lambda settings, started=None: ThreadPoolTaskRunner())
    get_settings.cache_clear()
    spec = types.SimpleNamespace(name="retry-probe", flow=probe)
    try:
        summary = cli._run_one(spec, {"fail": True, "tasks": 1}, None)
        assert attempts == {0: 2}
        line = "retried: flaky-probe"
        said = [x for x in summary["lines"] if x.startswith(line)]
        assert len(said) == 1 and "ran 2 times (a run before failed: ConnectionError('worker tcp://127.0.0.1:1 " \
            "lost')): the results above are its last run's" in said[0], said
        assert line in capsys.readouterr().out
        attempts.clear()
        assert not [x for x in cli._run_one(spec, {"fail": False, "tasks": 1}, None)["lines"] if x.startswith("retried")]
        # many retried (a lost worker under a nas campaign): a few named, the rest counted
        attempts.clear()
        many = cli.RETRIED_SHOWN + 2
        lines = [x for x in cli._run_one(spec, {"fail": True, "tasks": many}, None)["lines"] if x.startswith("retried")]
        assert len(lines) == cli.RETRIED_SHOWN and all(x.startswith(line) for x in lines[:-1]), lines
        assert lines[-1] == f"retried: {many - cli.RETRIED_SHOWN + 1} more task runs (the Prefect flow run's page lists them)"
    finally:
        get_settings.cache_clear()


@pytest.mark.stack
def test_a_run_whose_server_dies_is_stopped_with_the_server_named(stack, monkeypatch, settings_factory, tmp_path):
    """A stack's servers killed under a run: it went on failing call by call for 76 s, each client
    retrying its dead server (a trial). The run's watch stops it once a recorded server has been
    gone for its grace, and the error names the server, its log and what to do. Here the watched
    "server" is a process recorded in a stack.json of its own (the session stack stays up)."""
    import signal
    import subprocess
    import sys
    import threading
    import time
    import types

    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    from paperline.flows import cli
    from paperline.infra import interrupts, watch
    from paperline.infra.settings import get_settings
    from paperline.infra.stack import _record, _write_state

    settings, _ = stack
    watched = settings_factory(tmp_path / "watched")
    watched.state_dir.mkdir(parents=True)
    server = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    log = tmp_path / "mlflow.log"
    _write_state(watched, {"version": 1, "services": {"mlflow": _record(server, "http://127.0.0.1:1", log)}})
    real = watch.ServerWatch
    monkeypatch.setattr(watch, "ServerWatch", lambda _settings, on_dead, services, on_gone: real(
        watched, on_dead, services=services, grace_s=1.0, poll_s=0.2, on_gone=on_gone))

    @flow(name="server-dies-probe")
    def probe(params: dict) -> dict:
        threading.Timer(1.0, lambda: (server.kill(), server.wait())).start()
        for _ in range(600):  # a minute's work, unless stopped
            time.sleep(0.1)
        return {"table": {"columns": ["x"], "title": "probe", "rows": [[1]]}, "lines": []}

    monkeypatch.setenv("PAPERLINE_STATE_DIR", str(settings.state_dir))
    monkeypatch.setattr("paperline.infra.cluster.task_runner", lambda settings, started=None: ThreadPoolTaskRunner())
    monkeypatch.setitem(cli._state, "prefect_gone", False)
    get_settings.cache_clear()
    # as `paperline run` starts: SIGINT raising (as in a terminal), and an interrupt that lands in a
    # finalizer or gc callback delivered again. Without them the watch's interrupt was lost once in
    # a loaded suite (the probe ran its minute out): its redelivery had been left to whichever
    # earlier in-process command this xdist worker happened to run.
    monkeypatch.setattr(sys, "unraisablehook", sys.unraisablehook)  # (restored after)
    # (restored after too: the watch's SIGINT counted here made the next test's _run_one raise
    # KeyboardInterrupt at raise_if_interrupted, which took its xdist worker down)
    monkeypatch.setitem(interrupts._RECEIVED, "count", interrupts._RECEIVED["count"])
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    interrupts.install()
    started = time.monotonic()
    try:
        with pytest.raises(watch.ServersDied) as raised:
            cli._run_one(types.SimpleNamespace(name="gemm", flow=probe), {}, None)
    finally:
        signal.signal(signal.SIGINT, previous)
        get_settings.cache_clear()
        server.kill()
    assert time.monotonic() - started < 30
    text = str(raised.value)
    assert f"the stack's server mlflow (pid {server.pid}) died during the run, not stopped by `paperline down` " \
           f"(killed, crashed or out of memory: the end of {log} may say); the run was stopped and its end may " \
           "not be recorded;" in text, text
    assert text.endswith("`paperline up` starts it again, then the same command runs the multiply again (staged "
                         "random operands are reused)"), text
    assert watch.down_reason("mlflow") is None and not cli._state["prefect_gone"]  # prefect stayed up


def test_a_run_whose_work_was_done_as_servers_died_prints_its_results(capsys, tmp_path, monkeypatch):
    """Prefect dying as a run finished: its results were printed (_keeping_result); the run watch's
    error must not lose them (a review of the watch)."""
    import types

    from paperline.flows import cli

    monkeypatch.setitem(cli._state, "prefect_gone", False)
    out = tmp_path / "summary.json"
    done = {"summary": {"table": {"columns": ["x"], "title": "probe", "rows": [[42]]}, "lines": ["probe line"],
                        "prefect_flow_run_url": "-", "mlflow_run_url": "-"}}
    err = cli._servers_died({"prefect": {"pid": 7}}, types.SimpleNamespace(name="nas"), {}, done, out, "the run failed")
    printed = capsys.readouterr().out
    assert "probe line" in printed and "42" in printed and json.loads(out.read_text())["table"]["rows"] == [[42]]
    assert str(err).startswith("the stack's server prefect (pid 7) died during the run, not stopped by `paperline "
                               "down` (killed, crashed or out of memory); its work is done (the results above)")
    assert cli._state["prefect_gone"]  # the exit does not wait on Prefect's drains


def test_servers_stopped_by_down_and_died_are_said_apart(monkeypatch):
    import types

    from paperline.flows import cli

    monkeypatch.setitem(cli._state, "prefect_gone", False)
    spec = types.SimpleNamespace(name="gemm")
    err = cli._servers_died({"s3": {"pid": 5, "stopped": True}, "prefect": {"pid": 6, "stopped": True}}, spec, {}, {},
                            None, "the run was stopped")
    assert str(err).startswith("the stack (s3, prefect) was stopped by `paperline down` during the run; the run was "
                               "stopped and its end may not be recorded; `paperline up` starts them again, then the "
                               "same command runs the multiply again"), str(err)
    err = cli._servers_died({"s3": {"pid": 5, "log_path": "/l/s3.log"}, "mlflow": {"pid": 7, "stopped": True}}, spec,
                            {}, {}, None, "the run failed (X: y)")
    assert str(err).startswith("the stack's server s3 (pid 5) died during the run, not stopped by `paperline down` "
                               "(killed, crashed or out of memory: the end of /l/s3.log may say) and (mlflow) was "
                               "stopped by `paperline down` during the run; the run failed (X: y)"), str(err)
    # the task cache lives in S3: with it down, what finished was not cached (a trial's nas run said it was)
    nas = types.SimpleNamespace(name="nas")
    assert str(cli._servers_died({"s3": {"pid": 5, "stopped": True}}, nas, {}, {}, None, "stopped")).endswith(
        "the evaluations finished since are cached) (not those that finished with S3 down: they run again)")
    assert "S3 down" not in str(cli._servers_died({"mlflow": {"pid": 7, "stopped": True}}, nas, {}, {}, None, "x"))


def test_prefects_interrupt_lines_are_dropped_when_the_watch_or_the_user_stopped_the_run(monkeypatch):
    import logging

    from paperline.flows import cli

    def record(msg: str) -> logging.LogRecord:
        return logging.LogRecord("prefect.flow_runs", logging.ERROR, __file__, 1, msg, (), None)

    crash = "Crash detected! Execution was aborted by an interrupt signal."
    finished = "Finished in state Crashed('Execution was aborted by an interrupt signal.')"
    from paperline.infra import interrupts

    monkeypatch.setitem(cli._state, "watch_stopped", False)
    monkeypatch.setitem(interrupts._RECEIVED, "count", 0)  # no interrupt at all: Prefect's lines stay
    assert cli._no_crash_line_for_the_watch(record(crash)) and cli._no_crash_line_for_the_watch(record(finished))
    # SIGTERM: Prefect's engine logs before `run`'s handler counts it (a red ERROR line on SIGTERM: a
    # trial), dropped where that handler is in place (else nothing would say why the run stopped)
    monkeypatch.setattr(interrupts, "_HANDLED", set())
    assert cli._no_crash_line_for_the_watch(record("Crash detected! Execution was aborted by a termination signal."))
    monkeypatch.setattr(interrupts, "_HANDLED", {"SIGTERM"})
    assert not cli._no_crash_line_for_the_watch(record("Crash detected! Execution was aborted by a termination "
                                                       "signal."))
    assert not cli._no_crash_line_for_the_watch(record("Finished in state Crashed('Execution was aborted by a "
                                                       "termination signal.')"))
    monkeypatch.setitem(cli._state, "watch_stopped", True)
    assert not cli._no_crash_line_for_the_watch(record(crash)) and not cli._no_crash_line_for_the_watch(record(finished))
    assert cli._no_crash_line_for_the_watch(record("Finished in state Failed('x')"))
    # a user's Ctrl-C: the command's "interrupted: ..." line says it (three ERROR lines came first: a trial)
    monkeypatch.setitem(cli._state, "watch_stopped", False)
    monkeypatch.setitem(interrupts._RECEIVED, "count", 1)
    assert not cli._no_crash_line_for_the_watch(record(crash)) and not cli._no_crash_line_for_the_watch(record(finished))
    assert cli._no_crash_line_for_the_watch(record("Finished in state Failed('x')"))


def test_a_retry_after_a_lost_dask_worker_says_so_in_words():
    """A tensor-factorization retry after a lost worker read "a run before failed:
    FutureCancelledError()", nothing said of the worker (a trial)."""
    from paperline.flows import cli

    assert cli._with_dask_words("FutureCancelledError()") == (
        "FutureCancelledError(): Dask cancelled it, as it does when the worker running it is lost or restarted")
    assert cli._with_dask_words("distributed.client.FutureCancelledError('fit-1 cancelled for reason: "
                                "unknown.')").endswith(": Dask cancelled it, as it does when the worker running "
                                                       "it is lost or restarted")
    assert cli._with_dask_words("KilledWorker('fit-1', <WorkerState 'tcp://127.0.0.1:1'>, 3)").endswith(
        ": the workers running it died each time (Dask's limit on that)")
    assert cli._with_dask_words("ValueError('bad rank')") == "ValueError('bad rank')"
    assert cli._with_dask_words("") == ""


def test_urllib3s_retries_are_said_once_a_minute(monkeypatch):
    """A configured MLflow that died under a run: about 28 "Retrying (Retry(...)) after connection
    broken by ..." warnings came before the run's error (a trial); one a minute now."""
    import logging

    from paperline.flows import cli

    monkeypatch.setitem(cli._RETRY_SAID, "at", None)

    def retrying(path: str) -> logging.LogRecord:
        return logging.LogRecord("urllib3.connectionpool", logging.WARNING, __file__, 1,
                                 "Retrying (%r) after connection broken by '%r': %s",
                                 ("Retry(total=3)", "NewConnectionError()", path), None)

    said = [cli._retries_said_once_a_minute(retrying(p)) for p in ("/api/a", "/api/a", "/api/b")]
    assert said == [True, False, False]
    monkeypatch.setitem(cli._RETRY_SAID, "at", cli._RETRY_SAID["at"] - cli.RETRY_QUIET_S)  # a minute on
    assert cli._retries_said_once_a_minute(retrying("/api/b"))
    other = logging.LogRecord("urllib3.connectionpool", logging.WARNING, __file__, 1, "Connection pool is full", (),
                              None)
    assert cli._retries_said_once_a_minute(other)

