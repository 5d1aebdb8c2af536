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
                             "dask-cuda-worker", "prefect-worker", "prefect-worker-gpu"}
    for gpu_service in ("dask-cuda-worker", "prefect-worker-gpu"):
        assert SERVICES[gpu_service]["profiles"] == ["gpu"]  # the stack works on CPU-only hosts


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
    assert "--backend-store-uri" not in cmd and "PASSWORD" not in " ".join(cmd)  # no password on a command line
    assert SERVICES["mlflow"]["environment"]["MLFLOW_BACKEND_STORE_URI"].startswith("postgresql://")
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
    # the server requires a login (anyone reaching its port could read the result block's S3
    # secret); the worker sends the same one
    server_login = SERVICES["prefect-server"]["environment"]["PREFECT_SERVER_API_AUTH_STRING"]
    assert server_login.startswith("${PREFECT_API_AUTH_STRING:?") and env["PREFECT_API_AUTH_STRING"] == "${PREFECT_API_AUTH_STRING}"
    mlflow = SERVICES["mlflow"]  # likewise MLflow: its basic-auth app, whose admin login the worker sends
    assert mlflow["command"][mlflow["command"].index("--app-name") + 1] == "basic-auth"
    assert mlflow["environment"]["MLFLOW_AUTH_ADMIN_PASSWORD"].startswith("${MLFLOW_TRACKING_PASSWORD:?")
    assert env["MLFLOW_TRACKING_PASSWORD"] == "${MLFLOW_TRACKING_PASSWORD}"
    assert env["PAPERLINE_DASK_SCHEDULER_ADDRESS"] == "tcp://dask-scheduler:8786"
    assert SERVICES["dask-cuda-worker"]["command"][:3] == ["dask", "cuda", "worker"]
    assert "tcp://dask-scheduler:8786" in SERVICES["dask-cuda-worker"]["command"]
    gpus = SERVICES["dask-cuda-worker"]["deploy"]["resources"]["reservations"]["devices"][0]
    assert gpus["capabilities"] == ["gpu"]
    gpu_pool = yaml.safe_load((INFRA.parent / "prefect.yaml").read_text())["definitions"]["work_pools"]["gpu"]["name"]
    gpu_worker = SERVICES["prefect-worker-gpu"]
    assert gpu_worker["extends"] == {"service": "prefect-worker"}  # the same API, scheduler, S3 and scratch
    assert gpu_worker["depends_on"] == SERVICES["prefect-worker"]["depends_on"]  # not inherited by `extends`
    assert gpu_worker["command"][gpu_worker["command"].index("--pool") + 1] == gpu_pool
    assert gpu_worker["environment"]["PAPERLINE_DEVICE"] == "cuda"
    assert gpu_worker["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]


def test_services_that_others_wait_on_have_health_checks():
    waited = {dep for svc in SERVICES.values() if isinstance(svc.get("depends_on"), dict)
              for dep, cond in svc["depends_on"].items() if cond.get("condition") == "service_healthy"}
    assert {"postgres", "s3", "prefect-server", "mlflow"} <= waited
    for name in waited:
        assert "healthcheck" in SERVICES[name], name


def test_the_example_sets_no_secret_and_says_the_password_must_be_url_safe():
    """The example's `change-me` values passed compose's `:?` check: a copy left unedited ran with
    known secrets (a security review). Empty, each is refused until set."""
    text = (INFRA / "compose.env.example").read_text()
    env = dict(line.split("=", 1) for line in text.splitlines() if line and not line.startswith("#"))
    assert set(env) == {"POSTGRES_PASSWORD", "PAPERLINE_S3_ACCESS_KEY_ID", "PAPERLINE_S3_SECRET_ACCESS_KEY",
                        "PREFECT_API_AUTH_STRING", "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD",
                        "MLFLOW_FLASK_SERVER_SECRET_KEY"}
    assert all(value == "" for value in env.values()), env
    compose = (INFRA / "compose.yaml").read_text()
    for name in env:  # `:?` refuses an empty value as well as a missing one
        assert re.search(r"\$\{" + name + r":\?", compose), name
    assert "URL-safe" in text and "openssl rand -hex 24" in text


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
    # prefect-worker-gpu inherits the volume through `extends`
    assert SERVICES["prefect-worker"]["environment"]["PAPERLINE_STATE_DIR"].startswith("/scratch")


def test_every_image_runs_as_one_uid_that_owns_the_shared_scratch_volume():
    """The Prefect workers' state directory lies in the scratch volume the Dask workers share, and
    paperline refuses a state directory another user owns: the GPU images (the CUDA base has
    ``ubuntu`` at uid 1000) made ``paperline`` 1001 against the CPU images' 1000, and the volume
    was root's."""
    dockerfile = (INFRA / "Dockerfile").read_text()
    assert re.search(r"useradd --create-home --uid (\d+) ", dockerfile).group(1) != "1000"
    assert "chown paperline:paperline /scratch" in dockerfile and dockerfile.rstrip().endswith("USER paperline")
    for name, svc in SERVICES.items():
        if "scratch:/scratch" in svc.get("volumes", []) or name == "prefect-worker-gpu":
            assert svc.get("build", SERVICES["prefect-worker"]["build"])["dockerfile"] == "infra/Dockerfile", name
            assert "user" not in svc, name
