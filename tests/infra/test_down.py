"""A second, separate stack: started beside the session's, on taken preferred ports, then stopped."""

from __future__ import annotations

import socket
from urllib.parse import urlparse

import psutil
import pytest

from paperline.infra.stack import ensure_stack, stack_status, stop_stack

pytestmark = pytest.mark.stack


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def test_second_stack_on_taken_ports_stops_completely(settings_factory, tmp_path, stack):
    settings = settings_factory(tmp_path / "state")
    blockers = []
    for port in (settings.s3_port, settings.prefect_port):
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind(("127.0.0.1", port))
        s.listen(1)
        blockers.append(s)
    try:
        info = ensure_stack(settings)
        assert urlparse(info.s3_endpoint_url).port not in (None, settings.s3_port)
        assert urlparse(info.prefect_api_url).port not in (None, settings.prefect_port)
        assert urlparse(info.mlflow_tracking_uri).port == settings.mlflow_port
        # The session stack runs side by side.
        _, first = stack
        assert {s.url for s in info.services}.isdisjoint({s.url for s in first.services})

        procs = []
        for svc in info.services:
            p = psutil.Process(svc.pid)
            procs += [p, *p.children(recursive=True)]
        pids = [p.pid for p in procs]
        assert len(pids) >= 3
    finally:
        stopped = stop_stack(settings)
        for s in blockers:
            s.close()

    assert sorted(stopped) == ["mlflow", "prefect", "s3"]
    assert [pid for pid in pids if not _gone(pid)] == []
    assert not (settings.state_dir / "stack.json").exists()
    assert [s.healthy for s in stack_status(settings)] == [False, False, False]
    assert stop_stack(settings) == []
    # The session's stack was not touched.
    assert all(s.healthy for s in stack_status(stack[0]))
