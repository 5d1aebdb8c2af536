"""The collector paused through start-up and the start-up heap frozen (infra/heap.py): in a
subprocess where a real ``gc.freeze`` happens (it would freeze the test process's heap for good),
and through ``_run_one`` on the session stack with ``gc.freeze`` recorded."""

import subprocess
import sys

import pytest

SCRIPT = """
import gc
from paperline.infra import heap

assert gc.isenabled() and gc.get_freeze_count() == 0 and not heap.frozen()
with heap.paused_for_startup():
    assert not gc.isenabled()
    made = [[i] for i in range(1000)]  # tracked by the collector (lists are)
    assert heap.freeze_startup() is True and heap.frozen()
    assert gc.isenabled(), "collection back on after the freeze"
    assert gc.get_freeze_count() >= 1000, gc.get_freeze_count()
    count = gc.get_freeze_count()
    assert heap.freeze_startup() is False and gc.get_freeze_count() == count, "froze twice"
assert gc.isenabled()

try:  # an error inside: collection on again
    with heap.paused_for_startup():
        raise ValueError("x")
except ValueError:
    pass
assert gc.isenabled()

gc.disable()  # off by someone else: stays off, even after a freeze_startup
with heap.paused_for_startup():
    heap.freeze_startup()
    assert not gc.isenabled()
assert not gc.isenabled()
print("ok")
"""


def test_paused_then_frozen_once_and_collection_restored():
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


@pytest.mark.stack
def test_a_console_script_run_freezes_start_up_and_collects_during_the_flow(stack, monkeypatch):
    """`paperline run` (the console script's process) starts with the collector off, freezes the
    heap before the flow run and collects during it: a collector left off through a long
    training run would grow its memory without bound."""
    import gc
    import types

    from prefect import flow
    from prefect.task_runners import ThreadPoolTaskRunner

    from paperline.flows import cli
    from paperline.infra import heap
    from paperline.infra.settings import get_settings

    settings, _ = stack
    seen: dict[str, bool] = {}

    def freeze() -> None:
        seen["collector_on_at_freeze"] = gc.isenabled()

    @flow(name="gc-probe")
    def probe(params: dict) -> dict:
        seen["collector_on_in_flow"] = gc.isenabled()
        return {"table": {"columns": ["x"], "title": "probe", "rows": [[1]]}, "lines": [],
                "prefect_flow_run_url": "-", "mlflow_run_url": "-"}

    # the session stack's, not the default state directory's (that started a stack in ~/.paperline,
    # whose login the next tests of this process then sent to the session stack's MLflow: 401s)
    monkeypatch.setenv("PAPERLINE_STATE_DIR", str(settings.state_dir))
    get_settings.cache_clear()
    monkeypatch.setattr(gc, "freeze", freeze)
    monkeypatch.setitem(heap._STATE, "frozen", False)
    monkeypatch.setitem(cli._state, "own_process", True)
    monkeypatch.setattr("paperline.infra.cluster.task_runner", lambda settings, started=None: ThreadPoolTaskRunner())
    spec = types.SimpleNamespace(name="gc-probe", flow=probe)
    assert gc.isenabled()
    try:
        with cli._startup_gc_paused():
            assert not gc.isenabled()
            summary = cli._run_one(spec, {}, None)
    finally:
        gc.enable()
        get_settings.cache_clear()
    assert summary["table"]["title"] == "probe"
    assert seen == {"collector_on_at_freeze": False, "collector_on_in_flow": True}
    assert heap.frozen()
    with cli._startup_gc_paused():  # once frozen, a second run in the same process (demo) is not paused
        assert gc.isenabled()
    monkeypatch.setitem(cli._state, "own_process", False)
    monkeypatch.setitem(heap._STATE, "frozen", False)
    with cli._startup_gc_paused():  # in-process callers (a notebook, these tests) are left alone
        assert gc.isenabled()
