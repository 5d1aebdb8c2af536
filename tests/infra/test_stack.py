"""The embedded local stack against the real servers (no mocks)."""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import re
import signal
import subprocess
import sys
import time
import uuid

import pytest

from paperline.infra.errors import InputError, ServiceError
from paperline.infra.stack import ensure_stack, load_stack_info, stack_status
from paperline.infra.storage import NotCommittedError, ObjectChangedError, ObjectNotFoundError, ObjectStore
from paperline.infra.tracking import Tracker

pytestmark = pytest.mark.stack


def test_s3_round_trip_is_content_addressed(stack, tmp_path):
    _, info = stack
    store = ObjectStore.from_stack(info)
    data = b"paperline round trip " + uuid.uuid4().bytes
    sha = hashlib.sha256(data).hexdigest()

    ref = store.put_bytes(data, bucket=info.data_bucket, prefix="tests/rt", suffix=".bin")
    assert ref.uri == f"s3://{info.data_bucket}/tests/rt/{sha}.bin"
    assert (ref.sha256, ref.size_bytes) == (sha, len(data))
    assert store.put_bytes(data, bucket=info.data_bucket, prefix="tests/rt", suffix=".bin") == ref
    assert store.get_bytes(ref.uri, sha256=sha) == data
    assert store.exists(ref.uri)
    assert ref.uri in store.list(f"s3://{info.data_bucket}/tests/rt/")

    src = tmp_path / "blob.dat"
    src.write_bytes(data * 3)
    fref = store.put_file(src, bucket=info.data_bucket, prefix="tests/files")
    assert fref.uri.endswith(".dat") and fref.size_bytes == 3 * len(data)
    assert store.get_file(fref.uri, tmp_path / "out" / "copy.dat").read_bytes() == data * 3
    # at a version: that version's bytes, or ObjectChangedError and no file (nor temporary file) left
    etag = store.head(fref.uri)["ETag"]
    assert store.get_file(fref.uri, tmp_path / "v" / "copy.dat", etag=etag).read_bytes() == data * 3
    with pytest.raises(ObjectChangedError, match=f"{fref.uri}: the object was overwritten"):
        store.get_file(fref.uri, tmp_path / "w" / "copy.dat", etag='"0123456789abcdef0123456789abcdef"')
    assert list((tmp_path / "w").iterdir()) == []

    with pytest.raises(ObjectNotFoundError):
        store.get_bytes(f"s3://{info.data_bucket}/tests/rt/missing")
    assert not store.exists(f"s3://{info.data_bucket}/tests/rt/missing")

    # Travels to Dask workers: picklable, and the secret stays out of repr.
    clone = pickle.loads(pickle.dumps(store))
    assert clone.get_bytes(ref.uri) == data
    assert info.s3_secret_access_key not in repr(store)
    assert info.s3_secret_access_key not in repr(info)


def test_a_users_uri_in_a_missing_bucket_is_refused_naming_it(stack):
    _, info = stack
    store = ObjectStore.from_stack(info)
    store.require_bucket("data", f"s3://{info.data_bucket}/not/yet/written.parquet")  # the object may be missing
    with pytest.raises(InputError, match=r"^source='s3://no-such-bucket-9/in/': no such bucket 'no-such-bucket-9'"):
        store.require_bucket("source", "s3://no-such-bucket-9/in/")


def test_s3_enforces_signatures(stack):
    import boto3
    from botocore import UNSIGNED
    from botocore.config import Config
    from botocore.exceptions import ClientError

    _, info = stack
    good = ObjectStore.from_stack(info)
    ref = good.put_bytes(b"secret data", bucket=info.data_bucket, prefix="tests/auth")

    bad = ObjectStore(info.s3_endpoint_url, info.s3_access_key_id, "not-the-secret", info.s3_region)
    with pytest.raises(ServiceError, match="SignatureDoesNotMatch|credentials rejected"):
        bad.get_bytes(ref.uri)

    anonymous = boto3.client(
        "s3", endpoint_url=info.s3_endpoint_url, region_name=info.s3_region,
        config=Config(signature_version=UNSIGNED, s3={"addressing_style": "path"}),
    )
    bucket, key = ref.uri[5:].split("/", 1)
    with pytest.raises(ClientError) as exc:
        anonymous.get_object(Bucket=bucket, Key=key)
    assert exc.value.response["ResponseMetadata"]["HTTPStatusCode"] in (401, 403)
    # SeaweedFS's master, filer and volume server take no S3 signature: they served and took every
    # object to anyone on the machine (or a web page: CORS *) until they required signed tokens, and
    # the master handed tokens out and deleted a bucket on a GET until it required a client certificate
    import socket
    import ssl

    import httpx

    from paperline.infra.stack import _read_state

    settings, _ = stack
    ports = _read_state(settings)["services"]["s3"]["ports"]
    filer, volume, master = (f"127.0.0.1:{ports[k]}" for k in ("filer", "volume", "master"))
    tls = settings.state_dir / "s3" / "tls"
    for hostport in (filer, volume, master):
        assert httpx.get(f"http://{hostport}/").status_code == 400  # "Client sent an HTTP request to an HTTPS server"
        with pytest.raises(httpx.HTTPError):  # no client certificate: the handshake (or first read) fails
            httpx.get(f"https://{hostport}/", verify=False)
    delete = f"https://{master}/col/delete?collection={bucket}"
    with pytest.raises(httpx.HTTPError):
        httpx.get(delete, verify=False)
    for name in ("master", "volume", "filer", "s3"):  # gRPC (HTTP/2 over mutual TLS) refuses the same way
        context = ssl.create_default_context(cafile=tls / "ca.crt")
        context.set_alpn_protocols(["h2"])
        with socket.create_connection(("127.0.0.1", ports[name] + 10000), timeout=10) as raw:
            with pytest.raises((ssl.SSLError, ConnectionError)):
                with context.wrap_socket(raw, server_hostname="127.0.0.1") as conn:
                    conn.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                    if not conn.recv(1):  # closed without a word (TLS 1.3 reports the refusal late)
                        raise ConnectionError("closed")
    # the stack's own certificate opens them (so the refusals above are the certificate's doing),
    # and the filer and volume server still want a signed token on top
    context = ssl.create_default_context(cafile=tls / "ca.crt")
    context.load_cert_chain(tls / "tls.crt", tls / "tls.key")
    owner = httpx.Client(verify=context)
    assert owner.get(f"https://{master}/cluster/status").status_code == 200
    assert owner.get(f"https://{filer}/buckets/{bucket}/{key}").status_code == 401
    assert owner.get(f"https://{filer}/buckets/", headers={"Accept": "application/json"}).status_code == 401
    assert owner.post(f"https://{filer}/buckets/{bucket}/planted.txt", files={"file": b"x"}).status_code == 401
    fid = owner.get(f"https://{master}/dir/assign").json()["fid"]
    assert owner.post(f"https://{volume}/{fid}", files={"file": b"x"}).status_code == 401
    assert good.get_bytes(ref.uri) == b"secret data" and not good.list(f"s3://{bucket}/planted")


def test_prefects_api_answers_no_other_web_origin(stack):
    """Prefect allowed every origin (CORS *): a web page open in the user's browser could read its
    API, the result block's S3 secret included (a security review). Its own UI's origins remain."""
    import httpx

    _, info = stack
    port = info.prefect_api_url.rsplit(":", 1)[1].split("/")[0]
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "content-type"}
    url = f"{info.prefect_api_url}/block_documents/filter"
    evil = httpx.options(url, headers={"Origin": "https://evil.example", **preflight})
    assert "access-control-allow-origin" not in evil.headers, evil.headers
    for origin in (f"http://localhost:{port}", f"http://127.0.0.1:{port}"):
        ui = httpx.options(url, headers={"Origin": origin, **preflight})
        assert ui.headers.get("access-control-allow-origin") == origin, (origin, ui.headers)
    # a request that needs no preflight (a POST without Content-Type) is refused without a CSRF token,
    # which Prefect's own client and UI fetch: it created a flow and cancelled a run (a trial)
    # (with the login, which a page cannot send: the browser keeps no basic-auth login for the API)
    simple = httpx.post(f"{info.prefect_api_url}/flows/", content=b'{"name": "csrf-probe"}',
                        headers={"Origin": "https://evil.example", "Content-Type": ""},
                        auth=tuple(info.prefect_login.split(":", 1)))
    assert simple.status_code == 403, (simple.status_code, simple.text)


def test_the_local_prefect_api_needs_its_login(stack):
    """Every local user could use the Prefect API: read the result block's S3 secret back, plant
    cached task results (cloudpickle: code run by the next flow that loads them), cancel runs (a
    security review). The local server takes a login made once per state directory, which only its
    owner can read; health checks stay open, the UI asks for it, websockets need it too."""
    import json
    import stat

    import httpx
    from websockets.exceptions import ConnectionClosed
    from websockets.sync.client import connect as ws_connect

    from paperline.infra.stack import LOGIN_FILES

    settings, info = stack
    login = info.prefect_login
    path = settings.state_dir / LOGIN_FILES["prefect"]
    assert login and path.read_text().strip() == login and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert login not in repr(info) and login.split(":", 1)[1] not in (settings.state_dir / "stack.json").read_text()
    assert load_stack_info(settings).prefect_login == login
    block = f"{info.prefect_api_url}/block_types/slug/s3-bucket/block_documents/name/" + \
        info.result_storage_block.split("/")[1]
    user, password = login.split(":", 1)
    assert httpx.get(block).status_code == 401
    assert httpx.get(block, auth=(user, password[:-1])).status_code == 401
    assert httpx.get(block, auth=(user, password)).status_code == 200
    assert httpx.get(f"{info.prefect_api_url}/health").status_code == 200  # `status` and probes need none
    assert httpx.get(f"{info.prefect_ui_url}/ui-settings").json()["auth"] == "BASIC"  # the UI's login page
    events = info.prefect_api_url.replace("http://", "ws://") + "/events/out"
    for token in (None, "bm9wZQ=="):  # no login, a wrong one: closed before any event is sent
        with pytest.raises(ConnectionClosed), ws_connect(events, subprotocols=["prefect"], open_timeout=10) as ws:
            ws.send(json.dumps({"type": "auth", "token": token}))
            ws.recv(timeout=10)


def test_a_login_file_is_made_once_and_an_edited_one_is_refused(settings_factory, tmp_path):
    """The local servers' logins: made once (0600), kept, made again when emptied; one that is not
    `user:password` on a line is refused naming the file (MLflow refused to start with an empty
    password, Prefect would have required an empty login), never printed; the user's own is kept."""
    import stat

    from paperline.infra.errors import PaperlineError
    from paperline.infra.stack import LOGIN_FILES, _local_login, login_problem

    settings = settings_factory(tmp_path / "state")
    assert _local_login(settings, "prefect") is None  # nothing is made without create
    login = _local_login(settings, "prefect", create=True)
    user, password = login.split(":")
    assert user == "paperline" and len(password) >= 32 and _local_login(settings, "prefect", create=True) == login
    path = settings.state_dir / LOGIN_FILES["prefect"]
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and _local_login(settings, "mlflow") is None
    path.write_text("\n")
    assert _local_login(settings, "prefect") is None
    assert _local_login(settings, "prefect", create=True) not in (None, login)
    for bad in ("s3cret-without-user\n", ":s3cret\n", "alice:\n", "alice:s3cret\nmore\n"):
        path.write_text(bad)
        with pytest.raises(PaperlineError, match="^prefect: its login file .* holds no login .*; delete it to make a "
                                                 "new one") as err:
            _local_login(settings, "prefect", create=True)
        assert str(path) in str(err.value) and "s3cret" not in str(err.value)
        assert login_problem(settings, "prefect").endswith("holds no login (`user:password` on one line): "
                                                           "delete it, then `paperline up` makes a new one")
    assert login_problem(settings, "mlflow") == (f"its login file {settings.state_dir / LOGIN_FILES['mlflow']} is "
                                                 "missing: `paperline up` makes a new login (restarting the server)")
    path.write_text("alice:chosen-password\n")
    assert _local_login(settings, "prefect", create=True) == "alice:chosen-password"


def test_the_local_mlflow_needs_its_login(stack):
    """Every local user could use MLflow's API: delete experiments, overwrite runs' artifacts. The
    local server runs MLflow's basic-auth app with an admin login made once per state directory;
    /health stays open, the UI gets the browser's login prompt."""
    import stat

    import httpx

    from paperline.infra.stack import LOGIN_FILES

    settings, info = stack
    login = info.mlflow_login
    path = settings.state_dir / LOGIN_FILES["mlflow"]
    assert login and path.read_text().strip() == login and stat.S_IMODE(path.stat().st_mode) == 0o600
    assert login not in repr(info) and load_stack_info(settings).mlflow_login == login
    user, password = login.split(":", 1)
    search = f"{info.mlflow_tracking_uri}/api/2.0/mlflow/experiments/search?max_results=1"
    refused = httpx.get(search)
    assert refused.status_code == 401 and refused.headers["www-authenticate"].startswith("Basic")  # the prompt
    assert httpx.get(search, auth=(user, password[:-1])).status_code == 401
    assert httpx.get(search, auth=(user, password)).status_code == 200
    assert httpx.get(f"{info.mlflow_tracking_uri}/health").status_code == 200
    assert password not in (settings.state_dir / "mlflow" / "basic_auth.ini").read_text()


def test_ensure_stack_is_idempotent(stack):
    settings, info = stack
    again = ensure_stack(settings)
    assert [(s.name, s.pid, s.url) for s in again.services] == [(s.name, s.pid, s.url) for s in info.services]
    assert again.s3_access_key_id == info.s3_access_key_id
    loaded = load_stack_info(settings)
    assert loaded is not None and loaded.prefect_api_url == info.prefect_api_url
    # no credential in the state file, not even the access key id (it named the result block)
    assert info.s3_access_key_id not in (settings.state_dir / "stack.json").read_text()


def test_a_step_of_the_wall_clock_leaves_the_running_stack_alone(stack):
    """On Linux a process's wall-clock start time is derived from the boot time, which moves with
    every step of the clock: 26 s into a test run, `status` called all three live servers dead
    ("its server process (N) died, but process(es) N ... still run") and the next `up` restarted
    them under the runs using them. Here every recorded start time is 26 s off, as after such a
    step; the servers are known by their start since boot."""
    import json

    settings, info = stack
    path = settings.state_dir / "stack.json"
    saved = path.read_text()
    state = json.loads(saved)
    assert all(isinstance(rec["start_ticks"], int) for rec in state["services"].values()), state
    for rec in state["services"].values():
        rec["create_time"] += 26.0
    path.write_text(json.dumps(state))
    try:
        assert [(s.name, s.healthy, s.problem) for s in stack_status(settings)] == [
            (name, True, None) for name in ("s3", "prefect", "mlflow")]
        again = ensure_stack(settings)
        assert again.started == () and [s.pid for s in again.services] == [s.pid for s in info.services]
    finally:
        path.write_text(saved)


def test_a_recycled_pid_is_not_taken_for_the_recorded_server(tmp_path):
    """The other side of the same check: a process that has the recorded PID and even the recorded
    wall-clock start, but started at another tick since boot, is not the server."""
    import psutil

    from paperline.infra.stack import _live_process, _orphans, _record

    proc = subprocess.Popen(["sleep", "60"], start_new_session=True)
    try:
        rec = _record(proc, "http://127.0.0.1:1", tmp_path / "log")
        assert rec["create_time"] == psutil.Process(proc.pid).create_time() and rec["start_ticks"] > 0
        assert _live_process(rec) is not None and _orphans(rec) == []
        assert _live_process({**rec, "create_time": rec["create_time"] - 26.0}) is not None  # the clock moved
        assert _live_process({**rec, "start_ticks": rec["start_ticks"] - 1}) is None  # another process
        old = {k: v for k, v in rec.items() if k != "start_ticks"}  # recorded by an earlier version
        assert _live_process(old) is not None and _live_process({**old, "create_time": 0.0}) is None
    finally:
        proc.kill()
        proc.wait()


def test_up_on_a_running_stack_says_it_started_nothing(stack_cli, stack):
    res = stack_cli("up")
    assert res.exit_code == 0, res.output
    assert f"the stack in {stack[0].state_dir} is already up: nothing started" in " ".join(res.output.split())
    assert stack[1].prefect_ui_url in res.output
    flat = "".join(res.output.split())  # where each UI's login is, not the login
    assert "prefect/auth_string" in flat and "mlflow/auth_string" in flat, res.output
    assert stack[1].prefect_login.split(":")[1] not in flat and stack[1].mlflow_login.split(":")[1] not in flat


def test_a_configured_endpoint_leaves_the_local_servers_records_alone(stack, free_port):
    """A run with an unreachable PAPERLINE_PREFECT_API_URL (or MLFLOW_TRACKING_URI) dropped the
    running local server from stack.json: the next run started a second Prefect server and
    `paperline down` left both running (found by a fresh-user trial). A configured endpoint
    that works is used, and the local servers stay recorded for `down` and for later runs."""
    settings, info = stack
    before = {s.name: s.pid for s in info.services}
    dead = f"http://127.0.0.1:{free_port()}"
    for override, service in (({"prefect_api_url": f"{dead}/api"}, "prefect"), ({"mlflow_tracking_uri": dead}, "mlflow")):
        with pytest.raises(ServiceError, match=f"^{service} is not available at {dead}"):
            ensure_stack(settings.model_copy(update=override))
        assert {s.name: s.pid for s in stack_status(settings) if s.pid} == before
    shadowed = ensure_stack(settings.model_copy(update={"mlflow_tracking_uri": info.mlflow_tracking_uri}))
    assert [s.managed for s in shadowed.services] == [True, True, False]
    again = ensure_stack(settings)
    assert {s.name: s.pid for s in again.services} == before  # reused, nothing started


def test_running_local_stack_is_known_without_a_health_check(stack, tmp_path):
    from paperline.infra.stack import running_local_stack

    settings, info = stack
    guess = running_local_stack(settings)
    assert guess is not None
    assert (guess.prefect_api_url, guess.mlflow_tracking_uri, guess.s3_endpoint_url) == (
        info.prefect_api_url, info.mlflow_tracking_uri, info.s3_endpoint_url)
    assert running_local_stack(settings.model_copy(update={"state_dir": tmp_path})) is None  # never started
    configured = settings.model_copy(update={"mlflow_tracking_uri": info.mlflow_tracking_uri})
    assert running_local_stack(configured) is None  # a configured endpoint is not ours to vouch for


def test_status_shows_three_healthy_loopback_services(stack):
    settings, _ = stack
    services = stack_status(settings)
    assert [s.name for s in services] == ["s3", "prefect", "mlflow"]
    for s in services:
        assert s.healthy, s
        assert s.managed and s.pid
        assert s.url.startswith("http://127.0.0.1:"), s.url
    # SeaweedFS's volumes, read from its master over the stack's TLS: a full count fails writes with
    # 500 (a trial), so `status` shows how many are in use
    used, _, most = services[0].detail.partition(" volumes in use")[0].partition(" of ")
    assert 0 <= int(used) <= int(most) and int(most) > 0, services[0].detail
    # and where Prefect's and MLflow's runs are (an `up` on SQLite after PostgreSQL seemed to lose them: a trial)
    assert [s.detail for s in services[1:]] == [f"runs stored in sqlite:///{settings.state_dir / name / name}.db"
                                               for name in ("prefect", "mlflow")]


def test_a_state_directory_started_on_another_database_says_where_its_runs_are(settings_factory, tmp_path):
    """The other direction is tested end to end on PostgreSQL (tests/infra/test_postgres.py)."""
    from paperline.infra.stack import _note_database, _record_database

    said: list[str] = []
    sqlite = settings_factory(tmp_path / "state")
    label = _note_database(sqlite, "mlflow", said.append)
    assert label == f"sqlite:///{tmp_path / 'state' / 'mlflow' / 'mlflow.db'}" and said == []
    _record_database(sqlite, "mlflow", label)  # (what ensure_stack does once the server is healthy)
    assert _note_database(sqlite, "mlflow", said.append) == label and said == []
    pg = settings_factory(tmp_path / "state", mlflow_backend_store_uri="postgresql+psycopg://alice:s3cret@db:5432/ml")
    pg_label = _note_database(pg, "mlflow", said.append)
    assert pg_label == "postgresql://db:5432/ml"  # no user (errors leave it out)
    assert said == [f"mlflow: starting on the database {pg_label}; this state directory's mlflow server used "
                    f"{label} before, whose runs it does not show: unset PAPERLINE_MLFLOW_BACKEND_STORE_URI to see them"]
    said.clear()  # a server that then failed to start is not recorded: the next start on SQLite is no news
    assert _note_database(sqlite, "mlflow", said.append) == label and said == []
    _record_database(pg, "mlflow", pg_label)
    assert _note_database(sqlite, "mlflow", said.append) == label
    assert said == [f"mlflow: starting on the database {label}; this state directory's mlflow server used "
                    "postgresql://db:5432/ml before, whose runs it does not show: set "
                    "PAPERLINE_MLFLOW_BACKEND_STORE_URI to that database again (on every `paperline up` and run) "
                    "to see them"]
    assert "s3cret" not in (tmp_path / "state" / "mlflow" / "database").read_text()


def test_a_running_server_on_another_database_than_the_settings_name_is_said(stack):
    """With the PostgreSQL variables set, `up` and `run` reused a stack running on SQLite without a
    word, and the runs went to SQLite (a trial)."""
    from pydantic import SecretStr

    settings, _ = stack
    pg = settings.model_copy(update={"mlflow_backend_store_uri": SecretStr("postgresql://u:pw@127.0.0.1:9/elsewhere")})
    sqlite = f"sqlite:///{settings.state_dir / 'mlflow' / 'mlflow.db'}"
    said = (f"PAPERLINE_MLFLOW_BACKEND_STORE_URI names postgresql://127.0.0.1:9/elsewhere, but the running mlflow "
            f"server stores its runs in {sqlite}: runs go there until `paperline down` and an `up` with these settings")
    notices: list[str] = []
    assert ensure_stack(pg, notice=notices.append).started == ()
    assert notices == [f"mlflow: {said}"]
    mlflow = {s.name: s for s in stack_status(pg)}["mlflow"]
    assert mlflow.healthy and mlflow.detail == f"runs stored in {sqlite}; {said}"


def test_status_calls_a_seaweedfs_without_free_volumes_unhealthy():
    from paperline.infra.stack import volumes_report

    assert volumes_report(7, 52)[1] is None
    assert volumes_report(7, 52)[0].startswith("45 of 52 volumes in use")
    detail, problem = volumes_report(0, 52)
    assert detail.startswith("52 of 52 volumes in use")
    assert "no free volume left (all 52 in use)" in problem and "`paperline down` and `paperline up`" in problem


def test_flow_runs_heartbeat_within_the_crash_window(stack):
    """Every flow run of an activated process heartbeats every FLOW_HEARTBEAT_S seconds: Prefect's
    default (180 s) is longer than the zombie automation's window (crash_after_s, 60-90 s), and
    only serve's and worker's runs had it set."""
    from prefect.settings import get_current_settings

    from paperline.infra.stack import FLOW_HEARTBEAT_S

    settings, _ = stack
    assert get_current_settings().flows.heartbeat_frequency == FLOW_HEARTBEAT_S
    assert 2 * FLOW_HEARTBEAT_S <= settings.crash_after_s


def test_a_dead_local_prefect_is_given_up_on_in_seconds_not_a_minute(stack):
    """Prefect's client retried a refused connection 5 times (2+4+8+16+32 s): a run whose local
    server was killed sat 78 s silent before ending; 29 s with 3 retries (a trial, measured)."""
    from prefect.settings import get_current_settings

    from paperline.infra.stack import LOCAL_PREFECT_RETRIES

    assert get_current_settings().client.max_retries == LOCAL_PREFECT_RETRIES < 5  # Prefect's own default: 5


def test_prefect_task_results_are_cached_in_s3(stack):
    from prefect import flow, task
    from prefect.cache_policies import INPUTS, TASK_SOURCE
    from prefect.client.orchestration import get_client
    from prefect.settings import PREFECT_API_URL

    _, info = stack
    assert PREFECT_API_URL.value() == info.prefect_api_url  # activate() reached the imported prefect
    token = uuid.uuid4().hex

    @task(cache_policy=INPUTS + TASK_SOURCE, result_storage=info.result_storage_block, persist_result=True)
    def square(x: int, token: str) -> int:
        return x * x

    @flow
    def pipeline(token: str) -> tuple[str, int]:
        state = square(7, token, return_state=True)
        return state.name, state.result()

    assert pipeline(token) == ("Completed", 49)
    assert pipeline(token) == ("Cached", 49)
    with get_client(sync_client=True) as client:
        assert str(client.api_url).rstrip("/") == info.prefect_api_url
        assert len(client.read_flow_runs()) >= 2  # recorded by the stack's server, not an ephemeral one
    assert ObjectStore.from_stack(info).list(f"s3://{info.results_bucket}/")


def test_mlflow_artifacts_land_in_s3(stack, tmp_path):
    from mlflow.tracking import MlflowClient

    _, info = stack
    tracker = Tracker(info.mlflow_tracking_uri)
    run_id = tracker.start_run(
        "paperline-tests", run_name="artifact-check", tags={"suite": "infra"},
        params={"n": 3, "long": "x" * 10_000, "nested": {"a": [1, 2]}},
    )
    tracker.log_metrics(run_id, {"loss": 0.5, "acc": 1}, step=1)
    tracker.log_text(run_id, "hello from paperline\n", "notes/hello.txt")
    f = tmp_path / "table.csv"
    f.write_text("a,b\n1,2\n")
    tracker.log_artifact(run_id, str(f), "tables")
    tracker.end_run(run_id)
    assert tracker.run_url(run_id).startswith(f"{info.mlflow_tracking_uri}/#/experiments/")
    assert tracker.run_url(run_id).endswith(f"/runs/{run_id}")

    run = MlflowClient(info.mlflow_tracking_uri).get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.metrics == {"loss": 0.5, "acc": 1.0}
    assert len(run.data.params["long"]) <= 6000 and run.data.params["nested"] == '{"a": [1, 2]}'

    store = ObjectStore.from_stack(info)
    objects = store.list(f"s3://{info.artifacts_bucket}/mlflow/")
    hello = [u for u in objects if u.endswith(f"{run_id}/artifacts/notes/hello.txt")]
    assert hello, objects
    assert store.get_bytes(hello[0]) == b"hello from paperline\n"
    assert any(u.endswith(f"{run_id}/artifacts/tables/table.csv") for u in objects)
    pickle.loads(pickle.dumps(tracker))  # travels to workers


def test_commit_writes_the_manifest_last(stack):
    _, info = stack
    store = ObjectStore.from_stack(info)
    prefix = f"s3://{info.data_bucket}/tests/commit/{uuid.uuid4().hex}"
    with pytest.raises(NotCommittedError):
        store.read_manifest(prefix)

    ref = store.commit(prefix, {"frames.bin": b"\x00" * 1000, "labels.json": b"[1, 2]"}, {"source": "test"})
    assert ref.uri == f"{prefix}/manifest.json"
    manifest = store.read_manifest(prefix)
    assert manifest["meta"] == {"source": "test"}
    assert set(manifest["parts"]) == {"frames.bin", "labels.json"}
    for part in manifest["parts"].values():
        assert part["uri"].startswith(f"{prefix}/parts/")
        assert hashlib.sha256(store.get_bytes(part["uri"])).hexdigest() == part["sha256"]
    assert store.commit(prefix, {"frames.bin": b"\x00" * 1000, "labels.json": b"[1, 2]"}, {"source": "test"}) == ref


def test_failed_part_leaves_no_manifest(stack):
    _, info = stack
    store = ObjectStore.from_stack(info)
    prefix = f"s3://{info.data_bucket}/tests/commit/{uuid.uuid4().hex}"
    with pytest.raises(TypeError):
        store.commit(prefix, {"good.bin": b"ok", "broken.bin": None}, {})  # type: ignore[dict-item]
    assert store.list(f"{prefix}/parts/"), "the first part was uploaded"
    assert not store.is_committed(prefix)
    with pytest.raises(NotCommittedError, match="not committed"):
        store.read_manifest(prefix)


def test_a_write_lease_has_one_holder_at_a_time_and_a_dead_holders_is_taken_over(stack):
    """Two runs committing one dataset both reported success while the second rewrote the
    first's shards (a trial): a write holds the dataset's lease object, one holder at a time."""
    import threading
    import time

    from paperline.infra.errors import PaperlineError

    _, info = stack
    store = ObjectStore.from_stack(info)
    uri = f"s3://{info.data_bucket}/tests/lease/{uuid.uuid4().hex}/.write-lease.json"
    events, waits = [], []

    def write(name, hold_s):
        with store.lease(uri, name, on_wait=waits.append, renew_s=0.3, poll_s=0.1) as still_held:
            events.append((name, "in"))
            time.sleep(hold_s)  # (renewed meanwhile: the waiter sees a live lease, not a stale one)
            still_held()
            events.append((name, "out"))

    first = threading.Thread(target=write, args=("run A", 2.0))
    first.start()
    while not events:
        time.sleep(0.05)
    write("run B", 0.0)
    first.join()
    assert events == [("run A", "in"), ("run A", "out"), ("run B", "in"), ("run B", "out")]
    assert len(waits) == 1 and waits[0].startswith("run A (pid ")
    assert not store.exists(uri)  # released
    # a holder that died without releasing: its lease is taken over once unchanged for stale_s
    bucket, key = uri[len("s3://"):].split("/", 1)
    store.client.put_object(Bucket=bucket, Key=key, Body=b'{"owner": "a killed run", "pid": 1, "host": "h"}')
    started, taken = time.monotonic(), []
    with store.lease(uri, "run C", renew_s=0.3, stale_s=1.0, poll_s=0.1, on_wait=waits.append,
                     on_takeover=taken.append):
        assert time.monotonic() - started >= 1.0
    assert waits[-1] == "a killed run (pid 1 on h)"
    assert len(taken) == 1 and taken[0].startswith("a killed run (pid 1 on h): not renewed for the 1 s since")
    # on this machine, a holder whose process is gone is taken over at once (a trial waited 60 s
    # for a writer killed with kill -9 on the same host)
    import socket

    dead = subprocess.Popen(["true"])
    dead.wait()
    store.client.put_object(Bucket=bucket, Key=key, Body=json.dumps(
        {"owner": "a killed run", "pid": dead.pid, "host": socket.gethostname()}).encode())
    started = time.monotonic()
    with store.lease(uri, "run C2", on_takeover=taken.append):
        assert time.monotonic() - started < 5
    assert taken[-1].endswith(": its process is gone")
    # a holder whose lease was taken over meanwhile is told so before it writes on
    with store.lease(uri, "run D", renew_s=5) as still_held:
        store.client.delete_object(Bucket=bucket, Key=key)
        store.client.put_object(Bucket=bucket, Key=key, Body=b'{"owner": "run E"}')
        with pytest.raises(PaperlineError, match="lost the write lease") as lost:
            still_held()
        assert lost.value.taken_over  # (a nas run leaves the campaign's MLflow run to its new holder)
    assert store.get_bytes(uri) == b'{"owner": "run E"}'  # (not released by run D: run E's)
    store.delete(uri)
    # a renewal whose response was lost and whose retry then met its own landed write (412) is
    # this holder's own lease still (a review): the token in the object tells
    with store.lease(uri, "run F", renew_s=0.3, stale_s=5.0) as still_held:
        mine = json.loads(store.get_bytes(uri))
        store.client.put_object(Bucket=bucket, Key=key, Body=json.dumps({**mine, "renewal": 99}).encode())
        time.sleep(1.0)  # (renewals meet 412, find the token theirs, go on)
        still_held()
        assert json.loads(store.get_bytes(uri))["renewal"] != 99
    assert not store.exists(uri)
    # a holder cut off from S3 stops writing before a waiter may take its lease over (a review)
    cut_off = ObjectStore.from_stack(info)
    with cut_off.lease(uri, "run G", renew_s=0.2, stale_s=1.0) as still_held:
        def unreachable(**kwargs):
            raise ConnectionError("injected: no route to S3")

        cut_off.client.put_object = unreachable  # (its renewals fail from here on; HEADs still answer)
        time.sleep(0.8)
        with pytest.raises(PaperlineError, match=r"could not renew the write lease .* stopped before another writer "
                                                 r"may take it over") as lost:
            still_held()
        assert not lost.value.taken_over
    store.delete(uri)


def test_a_create_only_put_has_one_winner(stack):
    """A dataset's commit is create-only: of racing writers one wins, the others are told, and a
    retried PUT that finds its own bytes counts as written."""
    import threading

    from paperline.infra.storage import ObjectExistsError

    _, info = stack
    store = ObjectStore.from_stack(info)
    uri = f"s3://{info.data_bucket}/tests/create-only/{uuid.uuid4().hex}/manifest.json"
    results: dict[int, str] = {}

    def create(i):
        try:
            store.put_bytes_to(f"writer {i}".encode(), uri, if_absent=True)
            results[i] = "won"
        except ObjectExistsError as exc:
            results[i] = str(exc)

    threads = [threading.Thread(target=create, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    winners = [i for i, r in results.items() if r == "won"]
    assert len(results) == 6 and len(winners) == 1, results
    assert store.get_bytes(uri) == f"writer {winners[0]}".encode()
    assert all(r.endswith("already exists (written by another writer)") for r in results.values() if r != "won")
    store.put_bytes_to(f"writer {winners[0]}".encode(), uri, if_absent=True)  # (its own bytes: written)
    store.put_bytes_to(b"replaced", uri)  # (an ordinary put still replaces)
    assert store.get_bytes(uri) == b"replaced"
    store.delete(uri)


def test_dead_endpoints_raise_service_errors(free_port):
    port = free_port()
    store = ObjectStore(f"http://127.0.0.1:{port}", "k", "s", "us-east-1")
    with pytest.raises(ServiceError, match="s3 is not available.*; `paperline status` shows what is down"):
        store.get_bytes("s3://bucket/key")
    with pytest.raises(ServiceError, match="mlflow is not available.*; `paperline status` shows what is down"):
        Tracker(f"http://127.0.0.1:{port}").start_run("x", run_name="y")


def test_an_s3_server_failing_is_named_with_its_log(tmp_path, monkeypatch):
    """A SeaweedFS whose disk filled answered PutObject with HTTP 500 "InternalError ... please try
    again": the run ended with a bare ClientError naming neither S3's log nor the disk (a trial)."""
    import http.server
    import threading

    from botocore.retries.standard import ExponentialBackoff

    # boto3 still retries each call (4 attempts), without its backoff sleeps: 24 s -> 1 s
    monkeypatch.setattr(ExponentialBackoff, "delay_amount", lambda self, context: 0.0)

    class Failing(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # answers boto3's "Expect: 100-continue" at once (it waited 1 s a request)

        def _fail(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length") or 0))
            body = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>InternalError</Code><Message>We "
                    b"encountered an internal error, please try again.</Message></Error>")
            self.send_response(500)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_PUT = do_GET = do_HEAD = _fail

        def log_message(self, *args) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Failing)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        log = str(tmp_path / "s3.log")
        store = ObjectStore(url, "k", "s", "us-east-1", log_path=log)
        with pytest.raises(ServiceError) as e:
            store.put_bytes_to(b"x", "s3://bucket/a/b.bin")
        text = str(e.value)
        assert text.startswith(f"s3 is not available at {url}: ") and "the server failed (HTTP 500, InternalError" in text
        assert re.search(r"a full disk \(\d+ MiB free now\) stops SeaweedFS's writes, as does running out of "
                         r"volumes .*free at least 1 GiB", text), text
        assert text.endswith(f"(log: {log})")
        # boto3's upload_file wraps the same answer in its S3UploadFailedError: it went by unexplained (a trial)
        (tmp_path / "up.bin").write_bytes(b"x")
        with pytest.raises(ServiceError, match=r"the server failed \(HTTP 500, InternalError.*a full disk"):
            store.upload_file_to(tmp_path / "up.bin", "s3://bucket/a/up.bin")
        # a configured endpoint (no local log): no word of SeaweedFS
        with pytest.raises(ServiceError, match="the server failed") as e:
            ObjectStore(url, "k", "s", "us-east-1").put_bytes_to(b"x", "s3://bucket/a/b.bin")
        assert "SeaweedFS" not in str(e.value)
    finally:
        server.shutdown()


def test_a_server_that_lost_its_port_to_another_is_not_taken_as_started(free_port, tmp_path):
    """Two stacks starting at once can pick the same free port: the health check is then answered
    by the *other* server while ours exits with "address in use". Start-up waits for our process
    to listen on the port, so it fails loudly instead of recording a server it does not own."""
    import http.server
    import subprocess
    import sys
    import threading

    from paperline.infra.stack import _http_ok, _wait_healthy

    port = free_port()
    other = http.server.ThreadingHTTPServer(("127.0.0.1", port), http.server.SimpleHTTPRequestHandler)
    threading.Thread(target=other.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{port}"
    log = tmp_path / "server.log"
    try:
        assert _http_ok(url + "/")  # the other server answers the health check
        with open(log, "wb") as out:
            ours = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                                    stdout=out, stderr=subprocess.STDOUT, cwd=tmp_path)
        with pytest.raises(ServiceError, match="exited"):
            _wait_healthy({"web": (ours, lambda: _http_ok(url + "/"), url, str(log))}, 30)
    finally:
        other.shutdown()
        other.server_close()
    # a server that did bind its port is healthy as before
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    ours = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=tmp_path)
    try:
        _wait_healthy({"web": (ours, lambda: _http_ok(url + "/"), url, str(log))}, 30)
    finally:
        ours.terminate()
        ours.wait(10)


def test_a_test_stack_whose_session_is_gone_is_stopped_and_a_live_sessions_is_not(orphan_sweeper, tmp_path):
    """An interrupted `make test` left a worker's servers running; the next session's stack
    fixture stops them (here: `sleep` processes recorded as the stacks' servers)."""
    import json
    import os
    import subprocess

    import psutil

    root = tmp_path / "pytest-of-someone"
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pytest process that has ended
    servers = {}
    for state_dir, owner in ((root / "pytest-7" / "popen-gw0" / "stack0", gone.pid),
                             (root / "pytest-8" / "stack0", os.getpid())):
        state_dir.mkdir(parents=True)
        server = subprocess.Popen(["sleep", "300"], start_new_session=True)
        servers[state_dir] = server
        record = {"pid": server.pid, "create_time": psutil.Process(server.pid).create_time()}
        (state_dir / "stack.json").write_text(json.dumps({"version": 1, "services": {"s3": record}}))
        (state_dir / "pytest-owner.pid").write_text(str(owner))
    try:
        orphan, live = servers
        assert orphan_sweeper(root / "pytest-9" / "popen-gw1") == [orphan]
        assert servers[orphan].wait(timeout=30) is not None and not (orphan / "stack.json").exists()
        assert servers[live].poll() is None and (live / "pytest-owner.pid").exists()
        assert orphan_sweeper(tmp_path / "my-basetemp") == []  # a --basetemp of the user's: nothing looked for
    finally:
        for server in servers.values():
            server.kill()
            server.wait()


def test_half_a_key_pair_or_a_bad_region_names_its_own_setting(free_port):
    """Both were said as "check PAPERLINE_S3_ENDPOINT_URL" (a trial); botocore refuses them before
    any request, so no server is needed."""
    from paperline.infra.stack import _s3_problem

    url = f"http://127.0.0.1:{free_port()}"
    assert _s3_problem(url, "key-id", None, "us-east-1").endswith(
        "missing: aws_secret_access_key; set PAPERLINE_S3_SECRET_ACCESS_KEY too (the key ID and its secret go together)")
    assert _s3_problem(url, None, "secret", "us-east-1").endswith("set PAPERLINE_S3_ACCESS_KEY_ID too (the key ID and "
                                                                  "its secret go together)")
    assert _s3_problem(url, "key-id", "secret", "not a region!") == (
        "InvalidRegionError: Provided region_name 'not a region!' doesn't match a supported format; check "
        "PAPERLINE_S3_REGION")


def test_a_configured_endpoint_that_fails_says_why_and_names_the_setting(stack, free_port):
    """Every failure of a configured S3 endpoint was one line, `list_buckets failed (endpoint or
    credentials)`, and Prefect's and MLflow's `GET /health failed` (a fresh-user trial)."""
    from pydantic import SecretStr

    settings, info = stack
    s3 = {"s3_endpoint_url": info.s3_endpoint_url, "s3_access_key_id": info.s3_access_key_id,
          "s3_secret_access_key": SecretStr(info.s3_secret_access_key)}
    dead = f"http://127.0.0.1:{free_port()}"
    for override, pattern in (
            ({**s3, "s3_secret_access_key": SecretStr("not-the-secret")}, "SignatureDoesNotMatch.*PAPERLINE_S3_SECRET_ACCESS_KEY"),
            ({**s3, "s3_access_key_id": "nobody"}, "InvalidAccessKeyId.*PAPERLINE_S3_ACCESS_KEY_ID"),
            ({**s3, "s3_endpoint_url": dead}, "cannot connect.*PAPERLINE_S3_ENDPOINT_URL"),
            ({"prefect_api_url": f"{dead}/api"}, "GET /api/health failed: ConnectError.*PAPERLINE_PREFECT_API_URL"),
            ({**s3, "s3_endpoint_url": info.mlflow_tracking_uri}, "not an S3 endpoint.*PAPERLINE_S3_ENDPOINT_URL"),
            ({"mlflow_tracking_uri": dead}, "GET /health failed: ConnectError.*PAPERLINE_MLFLOW_TRACKING_URI"),
            ({"mlflow_tracking_uri": "http://127.0.0.1:notaport"}, "InvalidURL.*PAPERLINE_MLFLOW_TRACKING_URI")):
        with pytest.raises(ServiceError, match=pattern):
            ensure_stack(settings.model_copy(update=override))
    # status says it too, and does not send the user to `paperline up` (which starts nothing for it)
    (mlflow,) = [s for s in stack_status(settings.model_copy(update={"mlflow_tracking_uri": dead})) if s.name == "mlflow"]
    assert not mlflow.healthy and not mlflow.managed and "PAPERLINE_MLFLOW_TRACKING_URI" in mlflow.problem
    # and that the local server it replaces still runs (a typo'd setting had started it; fixed, it
    # was no longer listed)
    mlflow_pid = next(s.pid for s in stack_status(settings) if s.name == "mlflow")
    assert mlflow.detail == (f"the local mlflow server of this state directory still runs (pid {mlflow_pid}, "
                             f"{info.mlflow_tracking_uri}), unused while PAPERLINE_MLFLOW_TRACKING_URI is set: "
                             "`paperline down` stops it")
    # a setting that names the local server itself (copied from `paperline env`) was called unused
    same = info.mlflow_tracking_uri.replace("127.0.0.1", "localhost")
    (mlflow,) = [s for s in stack_status(settings.model_copy(update={"mlflow_tracking_uri": same})) if s.name == "mlflow"]
    assert mlflow.healthy and mlflow.detail == (f"the local mlflow server of this state directory (pid {mlflow_pid}), "
                                                "which `paperline up` started: `paperline down` stops it")
    # ... and without its login (a shell without `paperline env`'s exports): said as that server's
    with pytest.MonkeyPatch.context() as mp:
        for variable in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "MLFLOW_TRACKING_TOKEN"):
            mp.delenv(variable, raising=False)
        (mlflow,) = [s for s in stack_status(settings.model_copy(update={"mlflow_tracking_uri": same}))
                     if s.name == "mlflow"]
    assert not mlflow.healthy and "not authorized (HTTP 401)" in mlflow.problem, mlflow
    assert mlflow.problem.endswith("it is this state directory's local mlflow server, which takes the login "
                                   f"`paperline up` made ({settings.state_dir / 'mlflow' / 'auth_string'}): unset "
                                   "PAPERLINE_MLFLOW_TRACKING_URI (paperline then uses it with that login)"), mlflow
    # (used, the local server's line is where its runs are)
    assert [s.detail for s in stack_status(settings) if s.name == "mlflow"] == [
        f"runs stored in sqlite:///{settings.state_dir / 'mlflow' / 'mlflow.db'}"]


def test_mlflow_telemetry_is_off_in_paperline_and_its_mlflow_server(stack):
    """MLflow's telemetry was on (only DO_NOT_TRACK=true turns it off, not the 1 set for
    Prefect): usage data sent off the machine, and its background thread's removal of an
    environment variable failed a concurrent MLflow request, and so a flow run, with KeyError
    '_MLFLOW_TELEMETRY_SESSION_ID'. A process importing paperline (here with no CI or pytest
    variable, which turn it off too) and the local MLflow server run with it off."""
    import psutil

    ci = {"PYTEST_CURRENT_TEST", "GITHUB_ACTIONS", "CI", "CIRCLECI", "GITLAB_CI", "JENKINS_URL", "TRAVIS", "TF_BUILD",
          "BITBUCKET_BUILD_NUMBER", "CODEBUILD_BUILD_ARN", "BUILDKITE", "TEAMCITY_VERSION", "CLOUD_RUN_EXECUTION",
          "RUNBOT_HOST_URL", "RUNBOT_BUILD_NAME", "RUNBOT_WORKER_ID", "MLFLOW_DISABLE_TELEMETRY", "DO_NOT_TRACK"}
    env = {k: v for k, v in os.environ.items() if k not in ci}
    code = ("import paperline, mlflow\n"
            "from mlflow.telemetry.client import get_telemetry_client\n"
            "from mlflow.telemetry.utils import is_telemetry_disabled\n"
            "print(is_telemetry_disabled(), get_telemetry_client())\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["True", "None"], out.stdout + out.stderr
    (mlflow,) = [s for s in stack_status(stack[0]) if s.name == "mlflow"]
    assert psutil.Process(mlflow.pid).environ().get("MLFLOW_DISABLE_TELEMETRY") == "true"


def test_a_password_in_the_tracking_uri_is_never_printed(stack, monkeypatch):
    """`status`, `env`, the MLflow run links and the regression line printed
    `http://alice:s3cretpw@...` (and the last went to Prefect's logs: a fresh-user trial)."""
    from typer.testing import CliRunner

    from paperline.flows.cli import app
    from paperline.infra.settings import get_settings

    settings, info = stack
    user, password = info.mlflow_login.split(":", 1)  # the servers' own logins, given in their URLs
    with_password = info.mlflow_tracking_uri.replace("http://", f"http://{user}:{password}@")
    login = info.prefect_login
    prefect_with_password = info.prefect_api_url.replace("http://", f"http://{login}@")  # printed by `env`
    env = {"PAPERLINE_STATE_DIR": str(settings.state_dir), "PAPERLINE_MLFLOW_TRACKING_URI": with_password,
           "PAPERLINE_PREFECT_API_URL": prefect_with_password}
    get_settings.cache_clear()
    try:
        status, exports = (CliRunner().invoke(app, [cmd], env=env) for cmd in ("status", "env"))
    finally:
        get_settings.cache_clear()
    assert status.exit_code == 0 and exports.exit_code == 0, status.output + exports.output
    assert f"{user}@127.0.0.1" in status.output and password not in status.output + exports.output
    assert "\ns3: " in status.output and " volumes in use (SeaweedFS allows" in status.output, status.output
    assert login.split(":")[1] not in status.output + exports.output
    assert f"export MLFLOW_TRACKING_URI={info.mlflow_tracking_uri}\n" in exports.output
    assert "MLFLOW_TRACKING_PASSWORD" in exports.output  # how to give MLflow's own CLI the credentials
    assert f"export PREFECT_API_URL={info.prefect_api_url}\n" in exports.output
    assert "export PREFECT_API_AUTH_STRING" in exports.output
    # where data and work go, as comments (an infra trial: `env` said neither)
    assert f"\n# S3: {info.s3_endpoint_url}, data bucket {info.data_bucket} (" in exports.output, exports.output
    assert "\n# Dask: local CPU cluster (" in exports.output
    for variable in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"):
        monkeypatch.delenv(variable)  # the URI's login alone is enough
    tracker = Tracker(with_password)
    run_id = tracker.start_run("redaction-test", run_name="r")
    tracker.end_run(run_id)
    assert password not in tracker.run_url(run_id) + repr(tracker) and f"http://{user}@" in tracker.run_url(run_id)


def test_prefects_links_carry_no_password(stack, tmp_path):
    """Prefect derived its UI URL, the "View at" link every run prints, from PREFECT_API_URL, a
    password in it included (a security review): activate() sets PREFECT_UI_URL without it."""
    import subprocess
    import sys

    from prefect.settings import get_current_settings

    settings, info = stack
    assert get_current_settings().ui_url == info.prefect_ui_url
    script = (
        "import dataclasses\n"
        "from paperline.infra.settings import get_settings\n"
        "from paperline.infra.stack import activate, load_stack_info\n"
        "info = load_stack_info(get_settings())\n"
        "url = info.prefect_api_url.replace('http://', 'http://bob:s3cretpw@')\n"
        "activate(dataclasses.replace(info, prefect_api_url=url, prefect_ui_url=url.removesuffix('/api')))\n"
        "from prefect.settings import get_current_settings\n"
        "print(get_current_settings().ui_url)\n"
    )
    env = {**os.environ, "PAPERLINE_STATE_DIR": str(settings.state_dir)}
    env.pop("PREFECT_UI_URL", None)
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == info.prefect_ui_url.replace("http://", "http://bob@"), out.stdout + out.stderr


def test_a_bucket_created_on_a_configured_s3_endpoint_is_announced(stack):
    """A mistyped PAPERLINE_DATA_BUCKET made a new bucket on the user's S3 without a word."""
    import uuid

    from typer.testing import CliRunner

    from paperline.flows.cli import app
    from paperline.infra.settings import get_settings

    settings, info = stack
    typo = f"paperline-typo-{uuid.uuid4().hex[:8]}"
    env = {"PAPERLINE_STATE_DIR": str(settings.state_dir), "PAPERLINE_S3_ENDPOINT_URL": info.s3_endpoint_url,
           "PAPERLINE_S3_ACCESS_KEY_ID": info.s3_access_key_id, "PAPERLINE_S3_SECRET_ACCESS_KEY": info.s3_secret_access_key,
           "PAPERLINE_DATA_BUCKET": typo}
    get_settings.cache_clear()
    try:
        first, second = (CliRunner().invoke(app, ["up"], env=env) for _ in range(2))
    finally:
        get_settings.cache_clear()
    assert first.exit_code == 0, first.output
    assert f"s3: created bucket(s) {typo} (PAPERLINE_DATA_BUCKET) at {info.s3_endpoint_url}" in " ".join(first.output.split())
    assert "created bucket" not in second.output  # it exists now
    assert ObjectStore.from_stack(info).bucket_exists(typo)


def test_up_with_every_service_configured_says_so(stack, tmp_path):
    """It said "the stack in DIR is already up: nothing started", of a state directory that had
    never held a server (a trial)."""
    from typer.testing import CliRunner

    from paperline.flows.cli import app
    from paperline.infra.settings import get_settings

    _, info = stack
    user, password = info.mlflow_login.split(":", 1)
    env = {"PAPERLINE_STATE_DIR": str(tmp_path / "st"), "PAPERLINE_S3_ENDPOINT_URL": info.s3_endpoint_url,
           "PAPERLINE_S3_ACCESS_KEY_ID": info.s3_access_key_id, "PAPERLINE_S3_SECRET_ACCESS_KEY": info.s3_secret_access_key,
           "PAPERLINE_PREFECT_API_URL": info.prefect_api_url, "PREFECT_API_AUTH_STRING": info.prefect_login,
           "PAPERLINE_MLFLOW_TRACKING_URI": info.mlflow_tracking_uri, "MLFLOW_TRACKING_USERNAME": user,
           "MLFLOW_TRACKING_PASSWORD": password}
    get_settings.cache_clear()
    try:
        res = CliRunner().invoke(app, ["up"], env=env)
    finally:
        get_settings.cache_clear()
    out = " ".join(res.output.split())
    assert res.exit_code == 0, res.output
    assert "every service is a configured endpoint (checked; nothing local to start)" in out, out
    assert "already up" not in out and "started the local stack" not in out, out


def test_a_prefect_server_with_a_login_is_used_with_prefects_own_variable(stack, free_port, tmp_path, monkeypatch,
                                                                          cli_env):
    """A configured Prefect server that needs basic auth: without PREFECT_API_AUTH_STRING the
    check says so (its health check is open, so that alone passed and the run failed later on a
    401); with it, the stack is set up on that server (block, work pools) by Prefect's client;
    with the login in PAPERLINE_PREFECT_API_URL instead, a flow runs there and the password is
    neither printed nor kept in stack.json."""
    import subprocess
    import sys

    import httpx

    from paperline.infra.stack import _http_ok, _wait_healthy

    settings, info = stack
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    env.update(PREFECT_HOME=str(tmp_path), PREFECT_SERVER_ANALYTICS_ENABLED="false",
               PREFECT_SERVER_DATABASE_CONNECTION_URL=f"sqlite+aiosqlite:///{tmp_path / 'prefect.db'}",
               PREFECT_SERVER_API_AUTH_STRING="admin:s3cret")
    log = open(tmp_path / "prefect.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
                             str(port), "--analytics-off"], env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    api = f"http://127.0.0.1:{port}/api"
    try:
        _wait_healthy({"prefect": (proc, lambda: _http_ok(f"{api}/health"), api, str(tmp_path / "prefect.log"))}, 120)
        configured = settings.model_copy(update={"prefect_api_url": api})
        monkeypatch.delenv("PREFECT_API_AUTH_STRING", raising=False)
        monkeypatch.delenv("PREFECT_API_KEY", raising=False)
        with pytest.raises(ServiceError, match=r"^prefect is not available at .*: not authorized \(HTTP 401\): set "
                                               r"PREFECT_API_AUTH_STRING"):
            ensure_stack(configured)
        (prefect,) = [s for s in stack_status(configured) if s.name == "prefect"]
        assert not prefect.healthy and "PREFECT_API_AUTH_STRING" in prefect.problem
        monkeypatch.setenv("PREFECT_API_AUTH_STRING", "admin:wrong")
        with pytest.raises(ServiceError, match=r"not authorized \(HTTP 401\): the server refused the login given"):
            ensure_stack(configured)
        monkeypatch.setenv("PREFECT_API_AUTH_STRING", "admin:s3cret")
        _refresh_prefect_settings()
        there = ensure_stack(configured)
        pools = httpx.post(f"{api}/work_pools/filter", json={}, auth=("admin", "s3cret"), timeout=10).json()
        assert {"paperline-cpu", "paperline-gpu"} <= {p["name"] for p in pools}
        blocks = httpx.post(f"{api}/block_documents/filter", json={}, auth=("admin", "s3cret"), timeout=10).json()
        assert there.result_storage_block.split("/")[1] in {b["name"] for b in blocks}

        # the login in the URL (a security review: it went into PREFECT_API_URL as it was, and
        # Prefect's events client, failing to log in over its websocket, printed the URL in a
        # warning; stack.json kept it too): Prefect is given it as PREFECT_API_AUTH_STRING
        script = ("import os\n"
                  "from prefect import flow\n"
                  "from paperline.infra.settings import get_settings\n"
                  "from paperline.infra.stack import activate, ensure_stack\n"
                  "activate(ensure_stack(get_settings()))\n"
                  "print(os.environ['PREFECT_API_URL'], os.environ.get('PREFECT_API_AUTH_STRING') == 'admin:s3cret')\n"
                  "@flow(name='url-login-probe')\n"
                  "def probe():\n"
                  "    return 42\n"
                  "print(probe())\n")
        env = {k: v for k, v in cli_env.items() if k != "PREFECT_API_URL"}
        env["PAPERLINE_PREFECT_API_URL"] = api.replace("http://", "http://admin:s3cret@")
        # a login exported for another server (`paperline env` of the local stack): the URL's is used, as
        # by ensure_stack's check and set-up (the run sent the exported one: a review)
        env["PREFECT_API_AUTH_STRING"] = "paperline:the-local-stacks-login"
        ran = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=180)
        assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-3000:]
        assert "s3cret" not in ran.stderr and "Unable to connect" not in ran.stderr, ran.stderr[-3000:]
        assert ran.stdout.split("\n")[0] == f"{api} True" and ran.stdout.split()[-1] == "42", ran.stdout
        assert "s3cret" not in (settings.state_dir / "stack.json").read_text()
        runs = httpx.post(f"{api}/flow_runs/filter", json={}, auth=("admin", "s3cret"), timeout=10).json()
        assert [r["state"]["type"] for r in runs] == ["COMPLETED"], runs
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
        log.close()
        monkeypatch.undo()
        _refresh_prefect_settings()


def _refresh_prefect_settings() -> None:
    """Prefect reads its settings from the environment once: after a change, again."""
    import prefect.context

    prefect.context.refresh_global_settings_context()


def test_a_web_server_that_is_not_mlflow_is_refused_as_one(stack, free_port, tmp_path):
    """Another web server answering `/health` passed the check, and the run failed halfway with
    its HTML page in the error (a fresh-user trial)."""
    import subprocess
    import sys

    from paperline.infra.stack import _http_ok, _wait_healthy

    settings, _ = stack
    (tmp_path / "health").write_text("ok")
    port = free_port()
    web = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"], cwd=tmp_path,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy({"web": (web, lambda: _http_ok(f"{url}/health"), url, "(stderr discarded)")}, 30)
        with pytest.raises(ServiceError, match=r"not an MLflow tracking server \(GET /api/2.0/mlflow/experiments/"
                                               r"search returned 404.*PAPERLINE_MLFLOW_TRACKING_URI"):
            ensure_stack(settings.model_copy(update={"mlflow_tracking_uri": url}))
    finally:
        web.terminate()
        web.wait(timeout=10)


def test_no_stack_names_connect_where_prefect_is_not_pointed_at_one(tmp_path):
    """A script calling a flow without connect() and no stack running was told only to run
    `paperline up` (its flow run was on Prefect's temporary server): it is also told connect()."""
    from prefect.settings import PREFECT_API_URL, temporary_settings

    from paperline.infra.settings import Settings
    from paperline.infra.stack import require_stack

    settings = Settings(state_dir=tmp_path)
    with temporary_settings(updates={PREFECT_API_URL: None}):
        with pytest.raises(ServiceError, match=f"no running stack in {tmp_path} .*run `paperline up` first; from "
                                               "Python, call paperline.infra.stack.connect\\(\\) before the flow"):
            require_stack(settings)
    with temporary_settings(updates={PREFECT_API_URL: "http://127.0.0.1:4200/api"}):
        with pytest.raises(ServiceError, match="run `paperline up` first$"):
            require_stack(settings)
    # connect(start=False) was told to call connect() because "it starts the stack" (a trial)
    from paperline.infra.stack import connect

    with temporary_settings(updates={PREFECT_API_URL: None}):
        with pytest.raises(ServiceError, match=r"connect\(start=False\) starts none: run `paperline up` first, or "
                                               r"call connect\(\) to start it$"):
            connect(settings, start=False)


def test_the_state_directory_is_its_owners_alone(stack, tmp_path):
    """The state directory (S3 credentials; Prefect's database with the key that decrypts the
    result block's S3 secret; the objects) was 0755 and its databases 0644: any local user could
    decrypt the secret (a security review)."""
    import stat

    from paperline.infra.settings import Settings
    from paperline.infra.stack import _private_state_dir

    settings, _ = stack
    assert stat.S_IMODE(settings.state_dir.stat().st_mode) == 0o700
    databases = list(settings.state_dir.rglob("*.db"))
    assert databases, sorted(p.name for p in settings.state_dir.iterdir())
    for path in databases:  # written by the servers, spawned with umask 077
        assert stat.S_IMODE(path.stat().st_mode) & 0o077 == 0, (path, oct(path.stat().st_mode))
    # Prefect's UI build is made in the state directory: in the environment, made with umask 077,
    # it left every other user's Prefect of that environment unable to start (a review)
    assert list((settings.state_dir / "prefect" / "ui").rglob("index.html")), "no UI build in the state directory"
    logs = list((settings.state_dir / "logs").glob("*.log"))
    assert len(logs) == 3 and all(stat.S_IMODE(p.stat().st_mode) == 0o600 for p in logs), logs  # they were 0644
    # SeaweedFS also wrote log files of its own into /tmp (its log is the state directory's s3.log)
    import glob
    import tempfile

    weed = load_stack_info(settings).service("s3").pid
    assert not glob.glob(os.path.join(tempfile.gettempdir(), f"weed.*.{weed}")), weed
    existing = tmp_path / "state"
    existing.mkdir(mode=0o755)
    (existing / "keep").write_text("x")
    _private_state_dir(Settings(state_dir=existing))
    assert stat.S_IMODE(existing.stat().st_mode) == 0o700 and (existing / "keep").read_text() == "x"
    _private_state_dir(Settings(state_dir=tmp_path / "new" / "state"))
    assert stat.S_IMODE((tmp_path / "new" / "state").stat().st_mode) == 0o700


def test_a_command_waiting_for_the_stack_lock_says_who_holds_it(tmp_path, capfd):
    """`paperline run` behind a slow (or stopped) `up` sat silent in flock (a trial)."""
    import subprocess
    import sys
    import threading

    import psutil

    from paperline.infra.settings import Settings
    from paperline.infra.stack import _locked

    script = ("import sys\nfrom paperline.infra.settings import Settings\nfrom paperline.infra.stack import _locked\n"
              f"with _locked(Settings(state_dir={str(tmp_path)!r})):\n    print('held', flush=True)\n    sys.stdin.read()\n")
    holder = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        got = []

        def wait() -> None:
            with _locked(Settings(state_dir=tmp_path)):
                got.append(True)

        waiter = threading.Thread(target=wait)
        waiter.start()
        waiter.join(1.0)
        assert not got  # still waiting
        # `status` meanwhile says a command holds the stack (it said "not running ... `paperline up` starts
        # the local stack" during an `up`: a trial)
        from typer.testing import CliRunner

        from paperline.flows.cli import app
        from paperline.infra.settings import get_settings
        from paperline.infra.stack import _holder_said, stack_lock_holder

        assert stack_lock_holder(Settings(state_dir=tmp_path)) == f" (pid {holder.pid})"
        get_settings.cache_clear()
        try:
            shown = CliRunner().invoke(app, ["status"], env={"PAPERLINE_STATE_DIR": str(tmp_path)})
        finally:
            get_settings.cache_clear()
        said = " ".join(shown.output.split())
        assert f"another paperline command (pid {holder.pid}) is starting, checking or stopping this stack now" in said
        assert "`paperline up` starts the local stack" not in said, said
        holder.stdin.close()
        waiter.join(30)
        assert got
    finally:
        holder.kill()
        holder.wait()
    err = capfd.readouterr().err
    assert f"waiting for another paperline command (pid {holder.pid}) that is starting, checking or stopping this " \
           "stack" in err
    assert str(tmp_path / ".stack.lock") in err
    # a paperline command is named by its subcommand (a `run` checking the stack was taken for an `up`)
    named = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "/venv/bin/paperline", "run", "gemm"])
    try:
        deadline = time.time() + 30
        while "run" not in psutil.Process(named.pid).cmdline():  # (before its exec: the forked pytest)
            assert time.time() < deadline
            time.sleep(0.01)
        assert _holder_said(f"{named.pid}\n") == f" (pid {named.pid}: `paperline run`)"
    finally:
        named.kill()
        named.wait()
    assert _holder_said("") == ""


def test_long_service_messages_are_cut_at_a_word():
    from paperline.infra.tracking import _shortened

    text = "HTTPConnectionPool(host='127.0.0.1'): Max retries exceeded " + "word " * 80
    short = _shortened(text, 120)
    assert len(short) <= 124 and short.endswith("word ...") and _shortened("short", 120) == "short"


def test_a_tracking_server_gone_mid_run_is_said_by_its_cause(monkeypatch):
    """A tracking server that died mid-run ended the run with ~300 characters of urllib3's
    wrapping (an infra trial): a failed call says its cause; MLflow's retries are off here."""
    from mlflow.tracking import MlflowClient

    from paperline.infra.errors import ServiceError
    from paperline.infra.tracking import Tracker, _connection_cause

    tracker = Tracker("http://127.0.0.1:1")
    tracker._client = MlflowClient(tracking_uri="http://127.0.0.1:1")  # (as if made while it was up)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    with pytest.raises(ServiceError) as caught:
        tracker.get_run("abc")
    assert str(caught.value) == ("mlflow is not available at http://127.0.0.1:1: get run failed: [Errno 111] "
                                 "Connection refused; `paperline status` shows what is down")
    timeout = ("MlflowException: API request to http://h/api failed with exception HTTPConnectionPool(host='h', "
               "port=5000): Max retries exceeded with url: /api (Caused by ReadTimeoutError(\"... Read timed out.\"))")
    assert _connection_cause(timeout) == "read timed out (no answer)"
    assert _connection_cause("ConnectionError: something else " + "x " * 200).endswith(" ...")


def test_a_state_directory_that_cannot_be_made_says_which_setting_to_change():
    """A read-only state directory failed with "OSError: [Errno 30] Read-only file system:
    '.../.stack.lock'", naming neither the setting nor what to do (a trial)."""
    from pathlib import Path

    from paperline.infra.errors import PaperlineError
    from paperline.infra.settings import Settings
    from paperline.infra.stack import _private_state_dir

    with pytest.raises(PaperlineError, match=r"^state directory /proc/.*: cannot write there \(.*\); set "
                                             "PAPERLINE_STATE_DIR to a writable directory$"):
        _private_state_dir(Settings(state_dir=Path("/proc/self/paperline-state")))


def test_a_state_directory_of_another_user_is_refused(tmp_path):
    """One made first by another user (under /tmp, say) was taken as it was, with the S3 key pair
    and Prefect login they had put there, which they could then use (a security review)."""
    from pathlib import Path

    from paperline.infra.errors import PaperlineError
    from paperline.infra.settings import Settings
    from paperline.infra.stack import _private_state_dir

    if os.geteuid() == 0:  # (CI runs as root: the directory is given away)
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o777)
        (theirs / "s3").mkdir()
        os.chown(theirs, 65534, 65534)
        mode = theirs.stat().st_mode
    else:
        theirs = Path("/usr/share")  # root's (not "/": refused first as the top of the file system)
    refused = rf"^state directory {theirs}: it belongs to another user, .*uid \d+\).*, who could read the keys and " \
              "logins kept there or have put their own there; set PAPERLINE_STATE_DIR to a directory of your own$"
    with pytest.raises(PaperlineError, match=refused):
        _private_state_dir(Settings(state_dir=theirs, _env_file=None))
    # nor read: `env`, `status` and the flows' own lookup went on with their keys and servers (a review)
    for read in (load_stack_info, stack_status):
        with pytest.raises(PaperlineError, match=refused):
            read(Settings(state_dir=theirs, _env_file=None))
    if os.geteuid() == 0:
        assert theirs.stat().st_mode == mode and theirs.stat().st_uid == 65534  # left as it was

    def made(name: str, mode: int) -> Path:
        made = tmp_path / name
        made.mkdir()
        made.chmod(mode)
        return made

    # a directory of every user's (sticky, as /tmp): `up` as root would have made /tmp 0700 (a review)
    shared = made("shared", 0o1777)
    with pytest.raises(PaperlineError, match=rf"^state directory {shared}: a directory shared by every user \(its "
                                             "sticky bit is set, as /tmp's is\)"):
        _private_state_dir(Settings(state_dir=shared, _env_file=None))
    assert shared.stat().st_mode & 0o7777 == 0o1777
    # a directory at the top of the file system (`$UNSET/` is "/"): `up` as root made it 0700 (a review)
    with pytest.raises(PaperlineError, match=r"^state directory /usr: a directory at the top of the file system"):
        load_stack_info(Settings(state_dir="/usr", _env_file=None))
    # one of your own that every user may write: read by no command until `up` tightens it (a review)
    open_to_all = made("open", 0o777)
    with pytest.raises(PaperlineError, match=rf"^state directory {open_to_all}: every user may write it; `paperline "
                                             "up` makes it yours alone"):
        stack_status(Settings(state_dir=open_to_all, _env_file=None))
    _private_state_dir(Settings(state_dir=open_to_all, _env_file=None))
    assert open_to_all.stat().st_mode & 0o777 == 0o700
    if os.geteuid() != 0:
        return
    # under a directory of another user's, who could put another directory in its place (a review)
    under = tmp_path / "their-parent"
    under.mkdir()
    os.chown(under, 65534, 65534)
    with pytest.raises(PaperlineError, match=rf"another user could put another directory in its place: the directory "
                                             rf"above it, {under}: it is another user's, nobody"):
        _private_state_dir(Settings(state_dir=under / "state", _env_file=None))
    # the user's own directory with another user's entries (made while it was open to them): refused, naming one
    mine = tmp_path / "mine"
    (mine / "s3").mkdir(parents=True)
    planted = mine / "s3" / "credentials.json"
    planted.write_text('{"access_key_id": "theirs", "secret_access_key": "theirs-too"}')
    os.chown(planted, 65534, 65534)
    with pytest.raises(PaperlineError, match=rf"^state directory {mine}: {planted} belongs to another user, nobody "
                                             r"\(uid 65534\) .*, who could have put keys or logins of theirs there"):
        load_stack_info(Settings(state_dir=mine, _env_file=None))
    # and a symbolic link of another user's on the way (it chose the directory): refused before it is resolved
    link = tmp_path / "link"
    link.symlink_to(tmp_path / "elsewhere")
    os.lchown(link, 65534, 65534)
    with pytest.raises(ValueError, match=rf"{link} is a symbolic link of another user's, nobody \(uid 65534\), who "
                                         "chose where it points; name a directory of your own"):
        Settings(state_dir=link / "state", _env_file=None)


def test_a_servers_log_past_its_size_is_moved_aside_as_it_starts(tmp_path):
    """The servers' logs were appended across restarts without bound (MLflow's has a line per
    request: a trial)."""
    import sys

    from paperline.infra.stack import LOG_KEPT_BYTES, _spawn

    log = tmp_path / "logs" / "mlflow.log"
    log.parent.mkdir()
    with open(log, "wb") as f:
        f.truncate(LOG_KEPT_BYTES + 1)
    _spawn([sys.executable, "-c", "print('second start')"], {}, log, tmp_path).wait(timeout=60)
    assert (tmp_path / "logs" / "mlflow.log.1").stat().st_size == LOG_KEPT_BYTES + 1
    assert log.read_text().endswith("second start\n") and log.stat().st_size < 1000
    _spawn([sys.executable, "-c", "print('third start')"], {}, log, tmp_path).wait(timeout=60)
    assert "second start" in log.read_text() and (tmp_path / "logs" / "mlflow.log.1").stat().st_size == LOG_KEPT_BYTES + 1


def test_a_running_servers_log_past_its_size_is_emptied_in_place(tmp_path, monkeypatch):
    """A log was moved aside only as its server started: a stack left running for months grew its
    logs without bound (a trial). A running server's log past the size is copied to ``.log.1``
    and emptied in place; the server, writing with O_APPEND, goes on at the new end."""
    import sys

    from paperline.infra.settings import Settings
    from paperline.infra.stack import LOG_KEPT_BYTES, _spawn, _trim_running_logs

    settings = Settings(state_dir=tmp_path)
    log = tmp_path / "logs" / "s3.log"
    flag = tmp_path / "trimmed"
    writer = ("import os, sys, time\nsys.stdout.write('x' * %d + '\\n'); sys.stdout.flush()\n"
              "while not os.path.exists(%r): time.sleep(0.05)\nprint('after the trim', flush=True)\n"
              ) % (LOG_KEPT_BYTES + 10, str(flag))
    proc = _spawn([sys.executable, "-c", writer], {}, log, tmp_path)
    try:
        for _ in range(200):
            if log.stat().st_size > LOG_KEPT_BYTES:
                break
            time.sleep(0.05)
        small = tmp_path / "logs" / "prefect.log"
        small.write_text("small\n")
        _trim_running_logs(settings)
        kept = tmp_path / "logs" / "s3.log.1"
        assert kept.stat().st_size > LOG_KEPT_BYTES and kept.stat().st_mode & 0o777 == 0o600
        assert log.stat().st_size == 0 and small.read_text() == "small\n"  # (under the size: left)
    finally:
        flag.touch()  # it writes once more
        proc.wait(timeout=60)
    assert log.read_text() == "after the trim\n"  # at the emptied file's start, not past a hole
    # a disk without room for the copy: the log is left whole; a copy that fails leaves no half
    # file (one filled a small disk, and every later command tried again: a trial)
    import shutil

    big = tmp_path / "logs" / "mlflow.log"
    with open(big, "wb") as f:
        f.truncate(LOG_KEPT_BYTES + 1)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=LOG_KEPT_BYTES))
    _trim_running_logs(settings)
    assert big.stat().st_size == LOG_KEPT_BYTES + 1 and not (tmp_path / "logs" / "mlflow.log.1").exists()
    monkeypatch.setattr(shutil, "disk_usage", real)

    def full(src, dst):
        with open(dst, "wb") as f:
            f.write(b"x" * 100)
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", full)
    _trim_running_logs(settings)
    assert big.stat().st_size == LOG_KEPT_BYTES + 1
    assert sorted(p.name for p in (tmp_path / "logs").iterdir()) == ["mlflow.log", "prefect.log", "s3.log", "s3.log.1"]


def test_a_state_file_not_written_names_its_path_and_leaves_the_old_one(tmp_path, monkeypatch):
    """A full disk as stack.json was written said a bare "OSError: [Errno 28] No space left on
    device" (a trial); the error names the file, and the old file stays whole."""
    import errno

    from paperline.infra.stack import _write_atomic

    path = tmp_path / "stack.json"
    path.write_text('{"old": true}\n')

    def full(fd: int) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError, match=f"No space left on device: '{path}'"):
        _write_atomic(path, '{"new": true}\n')
    assert path.read_text() == '{"old": true}\n' and sorted(p.name for p in tmp_path.iterdir()) == ["stack.json"]


def test_the_prefect_server_keeps_concurrency_leases_on_disk(stack):
    """A deployment run's concurrency lease lived in the server's memory: a served run that went
    on through a restart of its Prefect server was terminated at its next renewal ("410 Lease not
    found ... Terminating execution to prevent over-allocation", a trial). The stack's server
    keeps them under its PREFECT_HOME, where a restarted server finds them."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate

    name = f"paperline-test-lease-{uuid.uuid4().hex[:8]}"
    leases = stack[0].state_dir / "prefect" / "concurrency_leases"
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        try:
            lease_id = client.increment_concurrency_slots_with_lease([name], 1, "concurrency", 60.0).json()["lease_id"]
            assert (leases / f"{lease_id}.json").is_file(), sorted(p.name for p in leases.glob("*"))
            client.release_concurrency_slots_with_lease(uuid.UUID(lease_id))
            assert not (leases / f"{lease_id}.json").exists()
        finally:
            client.delete_global_concurrency_limit_by_name(name)
