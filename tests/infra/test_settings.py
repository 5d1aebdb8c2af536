from __future__ import annotations

import os
import re
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


@pytest.mark.parametrize("value", ["", "  "])
def test_an_empty_state_dir_is_the_default_not_the_current_directory(monkeypatch, tmp_path, value):
    """`PAPERLINE_STATE_DIR=` made the current directory the state directory (a trial)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.setenv("PAPERLINE_STATE_DIR", value)
    assert Settings().state_dir == (tmp_path / "home" / ".paperline").resolve()


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
    monkeypatch.setenv("PAPERLINE_CRASH_AFTER_S", "1e15")  # `up` failed in Prefect, blaming the server (a trial)
    with pytest.raises(ValidationError, match="(?s)crash_after_s.*less than or equal to 604800"):
        Settings()


@pytest.mark.parametrize("name, ok", [("paperline-data", True), ("a.b-c", True), ("Bad_Bucket", False),
                                      ("Bad_Bucket!!", False), ("xy", False), ("-lead", False), ("a..b", False),
                                      ("192.168.1.1", False), ("x" * 64, False)])
def test_bucket_names_follow_s3s_rules(monkeypatch, tmp_path, name, ok):
    """A bad name failed deep in boto3 (`InvalidBucketName ... CreateBucket`, or a parameter-validation
    regex) without naming the setting (a fresh-user trial)."""
    from paperline.infra.errors import InputError
    from paperline.infra.settings import get_settings

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PAPERLINE_DATA_BUCKET", name)
    get_settings.cache_clear()
    try:
        if ok:
            assert get_settings().data_bucket == name
        else:
            with pytest.raises(InputError, match=f"^PAPERLINE_DATA_BUCKET='{name}': not a valid S3 bucket name"):
                get_settings()
    finally:
        get_settings.cache_clear()


@pytest.mark.parametrize("name, value, error", [
    ("PAPERLINE_PREFECT_PORT", "-1", "not a TCP port: 1-65535"), ("PAPERLINE_MLFLOW_PORT", "0", "not a TCP port"),
    ("PAPERLINE_MLFLOW_PORT", "65536", "not a TCP port"), ("PAPERLINE_MLFLOW_PORT", "65535", None),
    ("PAPERLINE_S3_PORT", "70000", "not a port SeaweedFS can use: 1-55535 (it also takes the port 10000 above"),
    ("PAPERLINE_S3_PORT", "55536", "not a port SeaweedFS can use"), ("PAPERLINE_S3_PORT", "55535", None),
    ("PAPERLINE_MLFLOW_TRACKING_URI", "http://127.0.0.1:99999", "its port is out of range: 1-65535")])
def test_ports_out_of_range_are_refused_naming_the_range(monkeypatch, tmp_path, name, value, error):
    """-1 and 70000 were taken, and `up` said the port "is taken by another process"; a URL's port
    99999 was refused with the URL's expected form alone (a trial)."""
    from paperline.infra.errors import InputError
    from paperline.infra.settings import get_settings

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv(name, value)
    get_settings.cache_clear()
    try:
        if error is None:
            assert getattr(get_settings(), name.removeprefix("PAPERLINE_").lower()) == int(value)
        else:
            with pytest.raises(InputError, match=re.escape(f"{name}='{value}': {error}")):
                get_settings()
    finally:
        get_settings.cache_clear()


@pytest.mark.parametrize("host, ok", [("127.0.0.1", True), ("::1", True), ("localhost", True), ("0.0.0.0", True),
                                      ("not-a-host.invalid", False), ("", True), ("127.0.0.1:80", False)])
def test_host_is_an_address_or_a_resolvable_name(monkeypatch, tmp_path, host, ok):
    """A bad PAPERLINE_HOST failed `up` with "gaierror: [Errno -2] Name or service not known",
    not naming the setting (a trial)."""
    from paperline.infra.errors import InputError
    from paperline.infra.settings import get_settings

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PAPERLINE_HOST", host)
    get_settings.cache_clear()
    try:
        if ok:  # (empty: unset, as every setting's empty variable is)
            assert get_settings().host == (host or "127.0.0.1")
        else:
            with pytest.raises(InputError, match=f"^PAPERLINE_HOST='{host}': not an IP address or a host name"):
                get_settings()
    finally:
        get_settings.cache_clear()


def test_unknown_paperline_variables_are_named_with_the_closest_setting(tmp_path):
    """`PAPERLINE_S3_ENDPOINT=...` (for ..._URL) was ignored silently: `up` started a local
    SeaweedFS and the data went there, not to the intended endpoint (a trial)."""
    from paperline.infra.settings import unknown_variables

    env_file = tmp_path / ".env"
    env_file.write_text("PAPERLINE_STATEDIR=/tmp/x\nPAPERLINE_DEVICE=cpu\nOTHER=1\n")
    environ = {"PAPERLINE_S3_ENDPOINT": "http://s3", "PAPERLINE_STATE_DIR": "/tmp/y", "PAPERLINE_DEBUG": "1",
               "paperline_n_workers": "2", "PAPERLINE_FOO": "1", "HOME": "/root"}
    assert unknown_variables(environ, env_file) == [
        "PAPERLINE_FOO (in the environment) is not a paperline setting and is ignored; the settings: README "
        '"Pointing paperline at real infrastructure"',
        "PAPERLINE_S3_ENDPOINT (in the environment) is not a paperline setting and is ignored; did you mean "
        "PAPERLINE_S3_ENDPOINT_URL?",
        f"PAPERLINE_STATEDIR (in the {env_file} file) is not a paperline setting and is ignored; did you mean "
        "PAPERLINE_STATE_DIR?"]
    assert unknown_variables({"PAPERLINE_HOST": "x"}, tmp_path / "missing.env") == []
    # a configured server's login in .env: not read from there (its client reads the environment), said so
    env_file.write_text("PREFECT_API_AUTH_STRING=u:p\nMLFLOW_TRACKING_PASSWORD=pw\n")
    assert unknown_variables({"MLFLOW_TRACKING_PASSWORD": "pw"}, env_file) == [
        f"PREFECT_API_AUTH_STRING (in the {env_file} file) is not read from there: Prefect's and MLflow's clients take "
        "it from the environment alone; export it"]
    # an endpoint meant: named after an endpoint setting (MLFLOW_URI came out as MLFLOW_PORT, a trial)
    for typo, meant in (("MLFLOW_URI", "MLFLOW_TRACKING_URI"), ("MLFLOW_URL", "MLFLOW_TRACKING_URI"),
                        ("PREFECT_URL", "PREFECT_API_URL"), ("MLFLOW_PROT", "MLFLOW_PORT")):
        assert unknown_variables({f"PAPERLINE_{typo}": "x"}, None)[0].endswith(f"did you mean PAPERLINE_{meant}?")


def test_the_cli_warns_about_an_unknown_variable_once(tmp_path):
    import os
    import subprocess
    import sys

    env = {**os.environ, "PAPERLINE_S3_ENDPOINT": "http://s3.example", "PAPERLINE_STATE_DIR": str(tmp_path / "st")}
    proc = subprocess.run([sys.executable, "-m", "paperline.flows.cli", "status"], env=env, cwd=tmp_path,
                          capture_output=True, text=True, timeout=120)
    assert proc.stderr.count("warning:") == 1, proc.stderr
    assert "warning: PAPERLINE_S3_ENDPOINT (in the environment) is not a paperline setting and is ignored; did you " \
           "mean PAPERLINE_S3_ENDPOINT_URL?" in " ".join(proc.stderr.split()), proc.stderr


def test_the_cli_turns_prefects_client_usage_data_off_unless_told(tmp_path):
    import os
    import subprocess
    import sys

    code = "import os, paperline.flows.cli; print(os.environ['DO_NOT_TRACK'])"
    env = {k: v for k, v in os.environ.items() if k != "DO_NOT_TRACK"}
    assert subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip() == "1"
    assert subprocess.run([sys.executable, "-c", code], env={**env, "DO_NOT_TRACK": "0"}, capture_output=True,
                          text=True, check=True).stdout.strip() == "0"


def test_a_stack_prefers_its_last_ports_to_the_defaults_and_a_set_port_to_both(monkeypatch, tmp_path):
    """Two stacks stopped and started again in the other order swapped ports (the defaults came
    before each one's last ports), and one stack's MLflow links opened the other's Prefect UI (a
    trial); a port the user sets still comes first."""
    from paperline.infra.stack import _pick_port, _preferred_ports

    monkeypatch.chdir(tmp_path)
    for name in ("S3", "PREFECT", "MLFLOW"):
        monkeypatch.delenv(f"PAPERLINE_{name}_PORT", raising=False)
    default = Settings(state_dir=tmp_path)
    assert _preferred_ports(default, "prefect", 41811) == (41811, 4200)
    assert _preferred_ports(default, "mlflow", None) == (None, 5000)
    monkeypatch.setenv("PAPERLINE_PREFECT_PORT", "4300")
    assert _preferred_ports(Settings(state_dir=tmp_path), "prefect", 41811) == (4300, 41811)
    # the order is what _pick_port takes: the first free port of it
    free = _pick_port("127.0.0.1", None, set())
    assert _pick_port("127.0.0.1", _preferred_ports(default, "s3", free), set()) == free


def test_a_server_port_not_preferred_is_drawn_below_the_ephemeral_range():
    """A port the OS hands out for bind(0) it also hands to outgoing connections, and a server binds
    its port seconds after the pick: a second stack's MLflow, on such a port, exited at start-up
    in a CI run. Ports are drawn below the ephemeral range, SeaweedFS's gRPC ports too."""
    from pathlib import Path

    from paperline.infra.stack import _GRPC_OFFSET, DRAWN_PORTS, _pick_port

    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    taken: set[int] = set()
    for _ in range(20):
        port = _pick_port("127.0.0.1", None, taken)
        assert DRAWN_PORTS[0] <= port < min(DRAWN_PORTS[1], ephemeral)
        s3 = _pick_port("127.0.0.1", None, taken, with_grpc=True)
        assert DRAWN_PORTS[0] <= s3 and s3 + _GRPC_OFFSET < ephemeral
    assert len(taken) == 60  # each pick a new port, gRPC ports counted taken too


def test_a_seaweedfs_port_whose_socket_path_is_another_users_is_taken():
    """SeaweedFS names its unix sockets after its ports in /tmp (``seaweedfs-master-grpc-N.sock``):
    one there that SeaweedFS cannot replace (another user's, or a directory) left its parts talking
    to whatever listened there, or `up` waiting 120 s (a security review). Such a port is taken,
    and the notice says why."""
    import shutil
    import socket

    from paperline.infra.settings import Settings
    from paperline.infra.stack import _GRPC_OFFSET, _pick_port, _why_taken

    port = _pick_port("127.0.0.1", None, set(), with_grpc=True)
    planted = f"/tmp/seaweedfs-master-grpc-{port + _GRPC_OFFSET}.sock"
    os.mkdir(planted)  # (not a socket: SeaweedFS cannot remove it, whoever owns it)
    try:
        assert _pick_port("127.0.0.1", port, set(), with_grpc=True) != port
        assert _why_taken(Settings(s3_port=port, _env_file=None), "s3", port) == (
            f"is free, but SeaweedFS's socket path {planted} for it is not a socket: remove it")
        if os.geteuid() == 0:  # (CI runs as root: another user's, as a socket left by their SeaweedFS)
            os.chown(planted, 65534, 65534)
            assert _why_taken(Settings(s3_port=port, _env_file=None), "s3", port) == (
                f"is free, but SeaweedFS's socket path {planted} for it is another user's, nobody (uid 65534): remove "
                "it")  # (root can; another user would be told only its owner can)
    finally:
        shutil.rmtree(planted)
    own = socket.socket(socket.AF_UNIX)  # a socket of this user's, as a killed SeaweedFS leaves: it replaces it
    own.bind(planted)
    try:
        assert _pick_port("127.0.0.1", port, set(), with_grpc=True) == port
    finally:
        own.close()
        os.unlink(planted)


def test_the_ports_lock_waits_then_goes_on_and_ignores_a_planted_file(tmp_path, monkeypatch):
    """Two stacks starting at once are serialized by a per-user lock file in the temp directory;
    a holder that never lets go costs at most the wait, and a file another user could plant (a
    symbolic link) is not used."""
    import tempfile
    import time

    from paperline.infra.stack import _ports_lock

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    said: list[str] = []
    with _ports_lock(5.0, said.append):
        start = time.monotonic()
        with _ports_lock(0.5, said.append):  # held above: waits 0.5 s, then goes on
            assert time.monotonic() - start >= 0.5
    assert said == ["waiting for another paperline stack on this machine to finish starting (ports)",
                    "another paperline stack kept starting for 0 s: picking ports without waiting"], said
    lock = tmp_path / f"paperline-ports-{os.getuid()}.lock"
    lock.unlink()
    lock.symlink_to(tmp_path / "elsewhere")
    said.clear()
    with _ports_lock(5.0, said.append):
        pass
    assert said == [] and not (tmp_path / "elsewhere").exists()


def test_an_empty_variable_is_an_unset_setting(monkeypatch, tmp_path):
    """A `.env` template's blank `PAPERLINE_N_WORKERS=` was refused as not an integer, while a
    blank state directory or endpoint meant unset (a trial)."""
    from paperline.infra.settings import get_settings

    monkeypatch.chdir(tmp_path)
    (tmp_path / ".env").write_text("PAPERLINE_N_WORKERS=\nPAPERLINE_PREFECT_PORT=\n")
    for name in ("PAPERLINE_DEVICE", "PAPERLINE_CRASH_AFTER_S", "PAPERLINE_S3_ENDPOINT_URL"):
        monkeypatch.setenv(name, "")
    get_settings.cache_clear()
    try:
        s = get_settings()
        assert (s.n_workers, s.prefect_port, s.device, s.crash_after_s, s.s3_endpoint_url) == (None, 4200, "auto", 90.0, None)
    finally:
        get_settings.cache_clear()


def test_a_dotenv_line_python_dotenv_cannot_parse_is_refused_naming_the_line(monkeypatch, tmp_path):
    """python-dotenv drops a line it cannot parse and reads the rest: a trial's endpoint with a
    character after its closing quote sent every run to the local stack, the warning (naming
    neither file nor setting) printed hundreds of times a command. Refused, the line named by its
    number and variable, not quoted (it may hold a secret)."""
    from paperline.infra.errors import PaperlineError
    from paperline.infra.settings import Settings

    monkeypatch.chdir(tmp_path)
    dotenv = tmp_path / ".env"
    dotenv.write_text('PAPERLINE_N_WORKERS=1 # comment\n# note\nPAPERLINE_S3_ENDPOINT_URL="http://127.0.0.1:9"x\n')
    with pytest.raises(PaperlineError, match=rf"^{re.escape(str(dotenv))}: line 3 \(PAPERLINE_S3_ENDPOINT_URL\) is not "
                                             r"`NAME=value` as python-dotenv reads it, which would drop it") as refused:
        Settings()
    assert "127.0.0.1:9" not in str(refused.value)
    for text, problem in (("this is not a setting\n", "line 1 is not"),
                          ("A=1\n\n   \n# note\n\nPAPERLINE_S3_REGION=\"x\"y\n", "line 6 (PAPERLINE_S3_REGION)"),  # (said 2)
                          ("A=1\r\n\r\n\r\nB=\"x\"y\r\n", "line 4 (B)"), ("A=1\r\rB='x'y\r", "line 3 (B)"),
                          ('PAPERLINE_N_WORKERS=1\nexport PAPERLINE_S3_SECRET_ACCESS_KEY="s3cret\n', "line 2 (PAPERLINE_S3_SECRET"),
                          ("PAPERLINE_N_WORKERS=1\n".encode() + b"X=\xff\n", "not UTF-8 text")):
        dotenv.write_bytes(text if isinstance(text, bytes) else text.encode())
        with pytest.raises(PaperlineError) as refused:
            Settings()
        assert problem in str(refused.value) and "s3cret" not in str(refused.value), refused.value
    # quoted values, multi-line ones too, an `export`, blank lines and comments all parse
    dotenv.write_text('export PAPERLINE_N_WORKERS="3"\n\nPAPERLINE_DEVICE=\'cpu\'  # here\nNOTE="two\nlines"\n')
    assert (Settings().n_workers, Settings().device) == (3, "cpu")


def test_a_dotenv_file_another_user_could_have_written_is_refused(monkeypatch, tmp_path):
    """A `.env` planted in a shared directory pointed PAPERLINE_DASK_SCHEDULER_ADDRESS at another
    user's scheduler, whose worker received tasks holding the S3 secret and the Prefect login (a
    security review): one that belongs to another user, or that every user may write, is refused,
    naming it; the user's own is read."""
    from paperline.infra.errors import PaperlineError

    monkeypatch.chdir(tmp_path)
    dotenv = tmp_path / ".env"
    dotenv.write_text("PAPERLINE_DASK_SCHEDULER_ADDRESS=tcp://127.0.0.1:18799\n")
    dotenv.chmod(0o644)
    assert Settings().dask_scheduler_address == "tcp://127.0.0.1:18799"
    dotenv.chmod(0o666)
    with pytest.raises(PaperlineError, match=rf"^{re.escape(str(dotenv))}: every user may write this .env file, and "
                                             rf"could point paperline's endpoints .* chmod o-w {re.escape(str(dotenv))} "
                                             r"to keep it \(on a file system without Unix permissions"):
        Settings()
    dotenv.chmod(0o644)
    if os.geteuid() == 0:  # (CI runs as root: the file is given away)
        os.chown(dotenv, 65534, 65534)
        with pytest.raises(PaperlineError, match=r"this .env file belongs to another user, .*uid 65534\), who could "
                                                 "point paperline's endpoints .* run paperline from another directory$"):
            Settings()
        dotenv.unlink()  # a symbolic link of another user's, to a file of yours: they chose what is read (a review)
        yours = tmp_path / "yours.env"
        yours.write_text("PAPERLINE_N_WORKERS=2\n")
        dotenv.symlink_to(yours)
        os.lchown(dotenv, 65534, 65534)
        with pytest.raises(PaperlineError, match=r"this .env file is a symbolic link of another user's, .*uid 65534\), "
                                                 "who chose which file it reads"):
            Settings()
    elsewhere = tmp_path / "sub" / "team.env"  # a file named by Settings(_env_file=...) is checked too
    elsewhere.parent.mkdir()
    elsewhere.write_text("PAPERLINE_N_WORKERS=2\n")
    elsewhere.chmod(0o666)
    with pytest.raises(PaperlineError, match="every user may write this .env file"):
        Settings(_env_file=str(elsewhere))
    # your own file, in a directory every user may write (no sticky bit): another could swap it after the check
    swappable = tmp_path / "swappable"
    swappable.mkdir()
    (swappable / ".env").write_text("PAPERLINE_N_WORKERS=2\n")
    swappable.chmod(0o777)
    with pytest.raises(PaperlineError, match=r"in a directory another user could change \(every user may write it \(without the sticky bit\)\), "
                                             "who could put another .env file in its place"):
        Settings(_env_file=str(swappable / ".env"))
    swappable.chmod(0o1777)  # sticky, as /tmp: your file stays yours
    assert Settings(_env_file=str(swappable / ".env")).n_workers == 2
    if os.geteuid() == 0:  # another user's dangling link (it could be given a target after the check: a review)
        dangling = swappable / "dangling.env"
        dangling.symlink_to(tmp_path / "nothing-yet")
        os.lchown(dangling, 65534, 65534)
        with pytest.raises(PaperlineError, match="is a symbolic link of another user's"):
            Settings(_env_file=str(dangling))
    fifo = tmp_path / "sub" / "fifo.env"  # checked before it is opened: a FIFO left every command waiting (a review)
    os.mkfifo(fifo, 0o600)
    with pytest.raises(PaperlineError, match="fifo.env: not a regular file, which a .env file is"):
        Settings(_env_file=str(fifo))
