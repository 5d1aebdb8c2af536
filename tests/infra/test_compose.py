"""infra/compose.yaml, checked statically (no container engine here): the services a production
stack needs, wired to each other, PostgreSQL behind Prefect and MLflow, MLflow artifacts in S3,
ports on 127.0.0.1 only, and no secret written in the file."""

import re
from pathlib import Path

import yaml

INFRA = Path(__file__).resolve().parents[2] / "infra"
COMPOSE = yaml.safe_load((INFRA / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]


def test_the_production_services_are_all_there():
    assert set(SERVICES) == {"postgres", "s3", "prefect-server", "mlflow", "dask-scheduler", "dask-worker",
                             "dask-cuda-worker", "prefect-worker"}
    assert SERVICES["dask-cuda-worker"]["profiles"] == ["gpu"]  # the stack works on CPU-only hosts


def test_published_ports_bind_loopback_only():
    for name, svc in SERVICES.items():
        for port in svc.get("ports", []):
            assert str(port).startswith("127.0.0.1:"), (name, port)
    published = {str(p).split(":")[1] for svc in SERVICES.values() for p in svc.get("ports", [])}
    assert {"5432", "9000", "4200", "5000", "8786"} <= published


def test_prefect_and_mlflow_use_postgres_and_mlflow_stores_artifacts_in_s3():
    prefect_db = SERVICES["prefect-server"]["environment"]["PREFECT_API_DATABASE_CONNECTION_URL"]
    assert prefect_db.startswith("postgresql+asyncpg://") and "@postgres:5432/" in prefect_db
    cmd = SERVICES["mlflow"]["command"]
    assert cmd[cmd.index("--backend-store-uri") + 1].startswith("postgresql://")
    assert cmd[cmd.index("--artifacts-destination") + 1].startswith("s3://")
    assert SERVICES["mlflow"]["environment"]["MLFLOW_S3_ENDPOINT_URL"] == "http://s3:9000"
    for svc in ("prefect-server", "mlflow"):
        assert SERVICES[svc]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert "CREATE DATABASE mlflow" in (INFRA / "compose-initdb.sql").read_text()


def test_workers_point_at_the_scheduler_the_api_and_the_pools_prefect_yaml_uses():
    pool = yaml.safe_load((INFRA.parent / "prefect.yaml").read_text())["definitions"]["work_pools"]["cpu"]["name"]
    worker = SERVICES["prefect-worker"]
    assert worker["command"][worker["command"].index("--pool") + 1] == pool
    env = worker["environment"]
    assert env["PREFECT_API_URL"] == "http://prefect-server:4200/api"
    assert env["PAPERLINE_DASK_SCHEDULER_ADDRESS"] == "tcp://dask-scheduler:8786"
    assert SERVICES["dask-cuda-worker"]["command"][:3] == ["dask", "cuda", "worker"]
    assert "tcp://dask-scheduler:8786" in SERVICES["dask-cuda-worker"]["command"]
    gpus = SERVICES["dask-cuda-worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpus["capabilities"] == ["gpu"]


def test_no_secret_is_written_in_the_file():
    text = (INFRA / "compose.yaml").read_text()
    found = re.findall(r"^\s*([A-Z0-9_]*(?:PASSWORD|SECRET|ACCESS_KEY)[A-Z0-9_]*):\s*(\S+)", text, flags=re.M)
    assert len(found) >= 6
    for key, value in found:
        assert value.startswith("${"), (key, value)
    assert ":?" in text  # compose refuses to start without them


def test_mlflow_accepts_in_network_clients_and_secrets_stay_out_of_images():
    cmd = SERVICES["mlflow"]["command"]
    assert "mlflow:5000" in cmd[cmd.index("--allowed-hosts") + 1].split(",")
    ignored = (INFRA.parent / ".dockerignore").read_text().split()
    assert ".env" in ignored and ".venv/" in ignored and ".git/" in ignored


def test_flow_and_dask_workers_share_the_scratch_volume():
    for name in ("prefect-worker", "dask-worker", "dask-cuda-worker"):
        assert any(v.startswith("scratch:") for v in SERVICES[name]["volumes"]), name
    assert SERVICES["prefect-worker"]["environment"]["PAPERLINE_STATE_DIR"].startswith("/scratch")
