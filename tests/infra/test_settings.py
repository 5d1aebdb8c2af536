from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from paperline.infra.settings import Settings


def test_env_maps_to_fields(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)  # no stray .env
    monkeypatch.setenv("PAPERLINE_STATE_DIR", str(tmp_path / "st"))
    monkeypatch.setenv("PAPERLINE_S3_ENDPOINT_URL", "http://s3.example:9000")
    monkeypatch.setenv("PAPERLINE_S3_SECRET_ACCESS_KEY", "hunter2")
    monkeypatch.setenv("PAPERLINE_N_WORKERS", "3")
    monkeypatch.setenv("PAPERLINE_DEVICE", "cpu")
    monkeypatch.setenv("PAPERLINE_PREFECT_PORT", "4300")
    s = Settings()
    assert s.state_dir == Path(tmp_path / "st").resolve()
    assert s.s3_endpoint_url == "http://s3.example:9000"
    assert s.s3_secret_access_key.get_secret_value() == "hunter2"
    assert "hunter2" not in repr(s)
    assert (s.n_workers, s.device, s.prefect_port) == (3, "cpu", 4300)
    assert s.uses_local_stack


def test_bad_values_rejected(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PAPERLINE_DEVICE", "tpu")
    with pytest.raises(ValidationError):
        Settings()
    monkeypatch.setenv("PAPERLINE_DEVICE", "auto")
    monkeypatch.setenv("PAPERLINE_N_WORKERS", "0")
    with pytest.raises(ValidationError):
        Settings()
    monkeypatch.setenv("PAPERLINE_N_WORKERS", "2")
    monkeypatch.setenv("PAPERLINE_CRASH_AFTER_S", "45")  # under two heartbeats: live runs would crash
    with pytest.raises(ValidationError, match="crash_after_s"):
        Settings()
