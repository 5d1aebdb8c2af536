"""The local stack on PostgreSQL instead of SQLite (Prefect's database, MLflow's backend store),
against a real PostgreSQL server: `.ci/run` installs Debian's postgresql, starts it and exports
PAPERLINE_TEST_POSTGRES_URL (a role that may create databases). A flow run and an MLflow run land in
PostgreSQL, no SQLite file is created, and the database password shows up in no log, state file
or command line."""

import os
import secrets
import subprocess
import sys

import pytest

pytestmark = pytest.mark.postgres


def _admin_url() -> str:
    url = os.environ.get("PAPERLINE_TEST_POSTGRES_URL")  # postgresql://user:password@host:port/postgres
    if not url:
        if os.environ.get("PAPERLINE_REQUIRE_POSTGRES"):
            pytest.fail("PAPERLINE_TEST_POSTGRES_URL is unset (.ci/run starts PostgreSQL and sets it)")
        pytest.skip("no PostgreSQL server configured (set PAPERLINE_TEST_POSTGRES_URL; .ci/run does)")
    return url


@pytest.fixture(scope="module")
def pg_stack(tmp_path_factory, settings_factory):
    import psycopg

    from paperline.infra.stack import ensure_stack, stop_stack

    admin = _admin_url()
    base = admin.rsplit("/", 1)[0]
    dbs = {k: f"paperline_test_{k}_{secrets.token_hex(4)}" for k in ("prefect", "mlflow")}
    conn = psycopg.connect(admin, autocommit=True)
    with conn.cursor() as cur:
        for db in dbs.values():
            cur.execute(f'CREATE DATABASE "{db}"')
    settings = settings_factory(tmp_path_factory.mktemp("pgstack"),
                                prefect_database_url=f"{base}/{dbs['prefect']}",
                                mlflow_backend_store_uri=f"{base}/{dbs['mlflow']}")
    # as if this state directory's Prefect had run on SQLite before (see the status test)
    (settings.state_dir / "prefect").mkdir(parents=True, exist_ok=True)
    (settings.state_dir / "prefect" / "database").write_text("sqlite:///earlier/prefect.db\n")
    notices: list[str] = []
    try:
        info = ensure_stack(settings, notice=notices.append)
        yield settings, info, base, dbs, notices
    finally:
        stop_stack(settings)
        for db in dbs.values():
            _drop_database(conn, db)
        conn.close()


def _drop_database(conn, db: str, tries: int = 30) -> None:
    """DROP DATABASE ... WITH (FORCE). An autovacuum worker on ``db`` can be ended only by a member of
    pg_signal_backend (`.ci/run` grants it); without that, wait for the worker to finish."""
    import time

    import psycopg

    for attempt in range(tries):
        try:
            with conn.cursor() as cur:
                cur.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
            return
        except psycopg.errors.InsufficientPrivilege:
            if attempt == tries - 1:
                raise
            time.sleep(1)


def _rows(url: str, sql: str, *args):
    import psycopg

    with psycopg.connect(url) as conn, conn.cursor() as cur:
        cur.execute(sql, args)
        return cur.fetchall()


def test_flow_runs_and_mlflow_runs_are_stored_in_postgresql(pg_stack, monkeypatch):
    from paperline.infra.tracking import Tracker

    settings, info, base, dbs, _ = pg_stack
    code = ("from prefect import flow\n"
            "@flow(name='pg-check')\n"
            "def check():\n    return 42\n"
            "from prefect.runtime import flow_run\n"
            "print(check(return_state=True).state_details.flow_run_id)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "PAPERLINE_"))}
    env.update(PREFECT_API_URL=info.prefect_api_url, PREFECT_API_AUTH_STRING=info.prefect_login,
               PREFECT_SERVER_ANALYTICS_ENABLED="false")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    flow_run_id = proc.stdout.strip().splitlines()[-1]
    rows = _rows(f"{base}/{dbs['prefect']}", "SELECT state_type FROM flow_run WHERE id = %s", flow_run_id)
    assert rows == [("COMPLETED",)]

    user, password = info.mlflow_login.split(":", 1)  # this stack's own MLflow login, not the session stack's
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)
    tracker = Tracker(info.mlflow_tracking_uri)
    run_id = tracker.start_run("pg-check", run_name="pg", params={"x": 1})
    tracker.log_metrics(run_id, {"value": 3.5})
    tracker.end_run(run_id)
    rows = _rows(f"{base}/{dbs['mlflow']}", "SELECT status FROM runs WHERE run_uuid = %s", run_id)
    assert rows == [("FINISHED",)]
    assert _rows(f"{base}/{dbs['mlflow']}", "SELECT value FROM metrics WHERE run_uuid = %s", run_id) == [(3.5,)]
    # (but MLflow's login store, its admin user alone: in PostgreSQL its URI, password and all,
    # would have to be written into the auth app's configuration file)
    sqlite = [p for p in settings.state_dir.rglob("*.db") if not p.name.startswith("basic_auth-")]
    assert not sqlite, "SQLite files were created next to PostgreSQL"


def test_the_database_password_is_not_written_or_shown(pg_stack):
    import psutil

    settings, info, base, _, _ = pg_stack
    password = base.split("://", 1)[1].split("@", 1)[0].split(":", 1)[1]
    assert password and password not in repr(settings)
    for path in settings.state_dir.rglob("*"):
        if path.is_file() and path.suffix in {".log", ".json", ".yaml", ".toml", ""} and path.stat().st_size < 50e6:
            assert password not in path.read_text(errors="replace"), path
    for p in psutil.process_iter(["cmdline"]):
        assert password not in " ".join(p.info["cmdline"] or []), p.info["cmdline"]


def test_a_wrong_password_or_a_missing_database_is_named_before_any_server_starts(settings_factory, tmp_path):
    """Both said only "prefect ... server exited with code 3 during start-up", MLflow's after two
    minutes of retries (a trial): PostgreSQL's own reason now, without the password."""
    from urllib.parse import urlsplit, urlunsplit

    from paperline.infra.errors import ServiceError
    from paperline.infra.stack import ensure_stack

    parts = urlsplit(_admin_url())
    wrong = urlunsplit(parts._replace(netloc=f"{parts.username}:not-the-Pw-{secrets.token_hex(2)}@{parts.hostname}:"
                                             f"{parts.port or 5432}"))
    missing = urlunsplit(parts._replace(path=f"/paperline_test_nosuch_{secrets.token_hex(4)}"))
    for field, url, reason in (("prefect_database_url", wrong, f'password authentication failed for user "{parts.username}"'),
                               ("mlflow_backend_store_uri", missing, "does not exist")):
        settings = settings_factory(tmp_path / field, **{field: url})
        with pytest.raises(ServiceError) as exc:
            ensure_stack(settings)
        text = str(exc.value)
        assert "its database cannot be used" in text and reason in text, text
        assert "not-the-Pw" not in text and (parts.password or "") not in text, text


def test_status_names_the_database_and_a_dropped_one_is_refused_by_name(pg_stack):
    """PostgreSQL's database gone under the running stack: `status` said healthy and every run
    failed with Prefect's bare 500 (a trial). Runs last in this module: it drops a database."""
    import psycopg

    from paperline.infra.errors import ServiceError
    from paperline.infra.stack import ensure_stack, stack_status

    settings, info, base, dbs, notices = pg_stack
    user_at = base.rsplit("@", 1)[1]  # host:port: no user in the label (errors leave it out: it may be a token)
    # the earlier SQLite runs are not lost silently (an `up` on the other database seemed to lose them: a trial)
    assert [n for n in notices if n.startswith("prefect: starting on the database")] == [
        f"prefect: starting on the database postgresql://{user_at}/{dbs['prefect']}; this state directory's prefect "
        "server used sqlite:///earlier/prefect.db before, whose runs it does not show: unset "
        "PAPERLINE_PREFECT_DATABASE_URL to see them"], notices
    assert not [n for n in notices if n.startswith("mlflow: starting on")]
    status = {s.name: s for s in stack_status(settings)}
    assert all(s.healthy for s in status.values()), status
    assert status["prefect"].detail == f"runs stored in postgresql://{user_at}/{dbs['prefect']}"
    assert status["mlflow"].detail == f"runs stored in postgresql://{user_at}/{dbs['mlflow']}"

    with psycopg.connect(_admin_url(), autocommit=True) as conn:
        _drop_database(conn, dbs["mlflow"])
    mlflow = {s.name: s for s in stack_status(settings)}["mlflow"]
    assert not mlflow.healthy and mlflow.problem.startswith(
        f"its database cannot be used (PAPERLINE_MLFLOW_BACKEND_STORE_URI=postgresql://{user_at}/{dbs['mlflow']}: "), mlflow
    assert "does not exist" in mlflow.problem
    # from a shell without the variable (the URL unknown): the server's own 5xx tells it (a trial)
    plain = settings.model_copy(update={"prefect_database_url": None, "mlflow_backend_store_uri": None})
    mlflow = {s.name: s for s in stack_status(plain)}["mlflow"]
    assert not mlflow.healthy and mlflow.problem.startswith("it answers requests that read its database with HTTP 5"), \
        mlflow
    # and a run from there stops before its flow run, saying so (it sat 31 s in MLflow's retries)
    with pytest.raises(ServiceError, match="mlflow is not available at .*: it answers requests that read its database"):
        ensure_stack(plain)
    with pytest.raises(ServiceError, match="mlflow.*its database cannot be used.*does not exist"):
        ensure_stack(settings)
