"""The record `paperline serve` keeps of the deployments it paused itself, by which a pause a user
made in the Prefect UI outlives a restart of serve (the runner unpaused every one it served)."""

import json
import uuid
from types import SimpleNamespace

import pytest

from paperline.deployments import (SERVED_PAUSES, local_deployments, paused_by_user, read_serve_pauses,
                                   record_serve_pauses)


def _deployments(**paused: bool) -> dict[str, SimpleNamespace]:
    return {f"{name}/local": SimpleNamespace(id=uuid.uuid4(), paused=p) for name, p in paused.items()}


def test_a_pause_is_the_users_unless_serve_recorded_it_as_its_own(tmp_path):
    existing = _deployments(gemm=True, nas=True, tf=False)
    # no record (a first serve, an older paperline's): none kept
    assert paused_by_user(read_serve_pauses(tmp_path), existing) == []
    record_serve_pauses(tmp_path, [str(existing["gemm/local"].id), str(existing["tf/local"].id)])
    assert paused_by_user(read_serve_pauses(tmp_path), existing) == ["nas/local"]  # paused, and not by serve
    record_serve_pauses(tmp_path, [str(existing["nas/local"].id)], add=True)  # serve's backstop pause, added
    assert paused_by_user(read_serve_pauses(tmp_path), existing) == []
    assert json.loads((tmp_path / SERVED_PAUSES).read_text()) == {
        "paused_by_serve": sorted(str(existing[n].id) for n in ("gemm/local", "nas/local", "tf/local"))}
    record_serve_pauses(tmp_path, [])  # replaced: serve paused none (every one paused was the user's)
    assert paused_by_user(read_serve_pauses(tmp_path), existing) == ["gemm/local", "nas/local"]
    assert [p.name for p in tmp_path.iterdir()] == [SERVED_PAUSES]  # no part file left
    for unreadable in ("{not json", '{"other": []}', "[1, 2]", '{"paused_by_serve": [], "stopped_at": 5}',
                       '{"paused_by_serve": [], "stopped_at": "2026-12-07T10:00:00"}'):  # (naive: compared, it raised)  # read as no record: serve unpauses as before
        (tmp_path / SERVED_PAUSES).write_text(unreadable)
        said: list[str] = []
        assert paused_by_user(read_serve_pauses(tmp_path), existing, say=said.append) == [], unreadable
        assert len(said) == 1 and said[0].startswith(f"{tmp_path / SERVED_PAUSES} is unreadable (") and \
            said[0].endswith("every paused deployment is served unpaused, one paused in the Prefect UI too"), said
    (tmp_path / SERVED_PAUSES).unlink()
    (tmp_path / SERVED_PAUSES).mkdir()  # not writable as a file: the error is raised, no part file left behind
    with pytest.raises(OSError):
        record_serve_pauses(tmp_path, [])
    assert [p.name for p in tmp_path.iterdir()] == [SERVED_PAUSES]


def test_a_deployment_the_user_paused_is_registered_paused():
    served = {f"{d.flow_name}/{d.name}": d.paused for d in local_deployments("b", paused=["nas/local"])}
    assert served["nas/local"] is True and served["gemm/local"] is False, served


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    from paperline.infra.settings import get_settings

    monkeypatch.setenv("PAPERLINE_STATE_DIR", str(tmp_path))
    get_settings.cache_clear()
    yield tmp_path
    get_settings.cache_clear()


def test_a_served_deployment_paused_in_the_ui_takes_a_triggered_run(state_dir):
    """Prefect runs a paused deployment's manual runs: `trigger` said the run would wait for a
    deployment paused in the UI while serve ran, and sent it to the work pool's deployment, which
    no worker ran, where both existed (a trial)."""
    import datetime
    import fcntl

    from paperline.flows.cli import _served_now, _why_it_waits

    now = datetime.datetime.now(datetime.timezone.utc)
    served = SimpleNamespace(work_pool_name=None, last_polled=now - datetime.timedelta(seconds=5), paused=True)
    assert not _served_now(served)  # no serve holds this stack's lock
    with open(state_dir / "serve.pid", "a+") as f:
        f.write("4242\n")
        f.flush()
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running `paperline serve` holds it
        assert _served_now(served) and _why_it_waits(None, served) is None
        assert not _served_now(SimpleNamespace(work_pool_name="paperline-cpu", last_polled=now, paused=False))
        # a serve just started has not polled yet: its deployments are its own (a trigger then went to the work
        # pool's deployment, which no worker ran: a trial)
        assert _served_now(SimpleNamespace(work_pool_name=None, last_polled=None, paused=True))
    stopped = SimpleNamespace(work_pool_name=None, last_polled=now - datetime.timedelta(seconds=60), paused=True,
                              status="NOT_READY")
    assert not _served_now(stopped)
    assert _why_it_waits(None, stopped).startswith("is paused (its `paperline serve` stopped")


def test_a_poll_before_this_stacks_serve_stopped_is_its_own(tmp_path):
    """Resumed in the Prefect UI right after serve stopped, a deployment polled seconds before read as
    served by another process for 30 s: the next serve was refused and `status` named a serving
    process (a trial). Polls up to the recorded stop time are the stopped serve's own."""
    import datetime

    from paperline.deployments import STOP_CLOCK_SLACK_S, polled_by_stopped_serve

    stop = datetime.datetime.now(datetime.timezone.utc)
    before, after = stop - datetime.timedelta(seconds=8), stop + datetime.timedelta(seconds=STOP_CLOCK_SLACK_S + 1)
    assert not polled_by_stopped_serve(read_serve_pauses(tmp_path), before)  # no record
    record_serve_pauses(tmp_path, ["a"])  # a serve running: no stop time
    assert not polled_by_stopped_serve(read_serve_pauses(tmp_path), before)
    record_serve_pauses(tmp_path, [], add=True, stopped_at=stop)
    assert json.loads((tmp_path / SERVED_PAUSES).read_text())["paused_by_serve"] == ["a"]
    assert polled_by_stopped_serve(read_serve_pauses(tmp_path), before) and polled_by_stopped_serve(read_serve_pauses(tmp_path), stop)
    assert not polled_by_stopped_serve(read_serve_pauses(tmp_path), after) and not polled_by_stopped_serve(read_serve_pauses(tmp_path), None)
    record_serve_pauses(tmp_path, ["a"])  # the next serve starts: its polls are its own again
    assert not polled_by_stopped_serve(read_serve_pauses(tmp_path), before)
