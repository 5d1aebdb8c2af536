"""The record `paperline serve` keeps of the deployments it paused itself, by which a pause a user
made in the Prefect UI outlives a restart of serve (the runner unpaused every one it served)."""

import json
import uuid
from types import SimpleNamespace

from paperline.deployments import SERVED_PAUSES, local_deployments, paused_by_user, record_serve_pauses


def _deployments(**paused: bool) -> dict[str, SimpleNamespace]:
    return {f"{name}/local": SimpleNamespace(id=uuid.uuid4(), paused=p) for name, p in paused.items()}


def test_a_pause_is_the_users_unless_serve_recorded_it_as_its_own(tmp_path):
    existing = _deployments(gemm=True, nas=True, tf=False)
    assert paused_by_user(tmp_path, existing) == []  # no record (a first serve, an older paperline's): none kept
    record_serve_pauses(tmp_path, [str(existing["gemm/local"].id), str(existing["tf/local"].id)])
    assert paused_by_user(tmp_path, existing) == ["nas/local"]  # paused, and not by serve
    record_serve_pauses(tmp_path, [str(existing["nas/local"].id)], add=True)  # serve's backstop pause, added
    assert paused_by_user(tmp_path, existing) == []
    assert json.loads((tmp_path / SERVED_PAUSES).read_text()) == {
        "paused_by_serve": sorted(str(existing[n].id) for n in ("gemm/local", "nas/local", "tf/local"))}
    record_serve_pauses(tmp_path, [])  # replaced: serve paused none (every one paused was the user's)
    assert paused_by_user(tmp_path, existing) == ["gemm/local", "nas/local"]
    assert [p.name for p in tmp_path.iterdir()] == [SERVED_PAUSES]  # no part file left
    for unreadable in ("{not json", '{"other": []}', "[1, 2]"):  # read as no record: serve unpauses as before
        (tmp_path / SERVED_PAUSES).write_text(unreadable)
        assert paused_by_user(tmp_path, existing) == [], unreadable


def test_a_deployment_the_user_paused_is_registered_paused():
    served = {f"{d.flow_name}/{d.name}": d.paused for d in local_deployments("b", paused=["nas/local"])}
    assert served["nas/local"] is True and served["gemm/local"] is False, served
