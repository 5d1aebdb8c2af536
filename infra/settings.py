"""Settings: the one place paperline reads its environment.

Every endpoint, credential and knob comes from :class:`Settings` (environment variables with the
``PAPERLINE_`` prefix, or a ``.env`` file). Leave the endpoints unset to use the embedded local stack
that ``paperline up`` starts; set them to use real S3, a remote Prefect API, a remote MLflow and an
existing Dask scheduler, and nothing is started.
"""

from __future__ import annotations

import os
import re
import stat
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")
_IP_LIKE = re.compile(r"\d+\.\d+\.\d+\.\d+")
_MAX_S3_PORT = 65535 - 10000  # SeaweedFS puts each server's gRPC port 10000 above it (infra/stack.py)


class Settings(BaseSettings):
    """paperline configuration (``PAPERLINE_*`` environment variables).

    Attributes:
        state_dir: Directory holding the local stack's data, logs, PIDs and generated credentials.
        host: Interface the local servers bind to. Loopback unless you mean to expose them.
        s3_endpoint_url: S3 endpoint. Unset: the local SeaweedFS server.
        s3_access_key_id / s3_secret_access_key: S3 credentials. Unset with a local stack: the
            credentials generated once into ``state_dir``. Never logged or sent to MLflow.
        s3_region: Region used for request signing.
        results_bucket: Bucket of Prefect's persisted task results (the cache).
        artifacts_bucket: Bucket of MLflow artifacts.
        data_bucket: Bucket of content-addressed data objects and manifests.
        prefect_api_url: Prefect API, e.g. ``http://host:4200/api``. Unset: the local server.
        mlflow_tracking_uri: MLflow tracking server. Unset: the local server.
        dask_scheduler_address: Existing Dask scheduler (``tcp://host:8786``). Unset: a local cluster.
        device: ``auto`` (GPU when usable), ``cpu`` or ``cuda``.
        n_workers: Workers of the local CPU cluster. Unset: one single-threaded worker per core.
        s3_port / prefect_port / mlflow_port: Preferred local ports; free ones are picked if taken.
        startup_timeout_s: Seconds to wait for each local server's health check.
        crash_after_s: Seconds without a heartbeat after which a Running flow run of
            ``paperline serve``/``worker`` is marked Crashed (its process died). At least two
            heartbeats (60 s), so that one late heartbeat never crashes a live run; at most a week.
        prefect_database_url: Database of the local Prefect server, e.g.
            ``postgresql+asyncpg://user:password@127.0.0.1:5432/prefect`` (``postgresql://`` is
            taken to mean asyncpg). Unset: SQLite in ``state_dir``. Never logged.
        mlflow_backend_store_uri: Backend store of the local MLflow server, e.g.
            ``postgresql://user:password@127.0.0.1:5432/mlflow``. Unset: SQLite in ``state_dir``.
            Passed to the server in its environment, never on its command line; never logged.
    """

    # an empty variable (a .env template's `PAPERLINE_N_WORKERS=`) is unset, as it was already for
    # the state directory and the endpoints (a trial: the others were refused as not an integer)
    model_config = SettingsConfigDict(env_prefix="PAPERLINE_", env_file=".env", extra="ignore", env_ignore_empty=True)

    state_dir: Path = Field(default_factory=lambda: Path.home() / ".paperline")
    host: str = "127.0.0.1"

    s3_endpoint_url: str | None = None
    s3_access_key_id: str | None = None
    s3_secret_access_key: SecretStr | None = None
    s3_region: str = "us-east-1"
    results_bucket: str = "paperline-results"
    artifacts_bucket: str = "paperline-artifacts"
    data_bucket: str = "paperline-data"

    prefect_api_url: str | None = None
    mlflow_tracking_uri: str | None = None
    dask_scheduler_address: str | None = None

    device: Literal["auto", "cpu", "cuda"] = "auto"
    n_workers: int | None = Field(default=None, ge=1)

    s3_port: int = 8333
    prefect_port: int = 4200
    mlflow_port: int = 5000
    startup_timeout_s: float = Field(default=120.0, gt=0)
    crash_after_s: float = Field(default=90.0, ge=60.0, le=7 * 86400.0)  # (1e15 failed in Prefect's automation)

    prefect_database_url: SecretStr | None = None
    mlflow_backend_store_uri: SecretStr | None = None

    def __init__(self, **values: Any) -> None:
        """Read the settings (pydantic-settings), once the ``.env`` file (``_env_file`` where
        given) has passed :func:`env_file_problem`: it is checked before it is opened.

        Raises:
            PaperlineError: a ``.env`` file another user could have written, not a regular file, or
                with a line python-dotenv cannot parse (:func:`env_file_syntax_problem`).
            pydantic.ValidationError: a setting with a bad value.
        """
        files = values.get("_env_file", type(self).model_config.get("env_file"))
        for path in [files] if isinstance(files, str | os.PathLike) else list(files or ()):
            problem = env_file_problem(path)
            if problem is not None:
                from paperline.infra.errors import PaperlineError  # noqa: PLC0415

                raise PaperlineError(problem)
        super().__init__(**values)

    @field_validator("state_dir", mode="before")
    @classmethod
    def _empty_is_unset(cls, v: Any) -> Any:
        # `PAPERLINE_STATE_DIR=` made the current directory the state directory (Path("") is "."):
        # `down` tightened it to 700 and wrote its lock there, `up` would have put credentials and
        # databases into the working tree (a trial). Empty means unset, as for the endpoints.
        if isinstance(v, str | Path) and not str(v).strip():
            return Path.home() / ".paperline"
        return v

    @field_validator("state_dir")
    @classmethod
    def _expand(cls, v: Path) -> Path:
        given = Path(v).expanduser().absolute()
        # a symbolic link on the way that another user made (and may point anywhere): the checks
        # of the directory it resolves to saw a directory of root's (a sticky /tmp) with the
        # other user's key pair inside, and `up` would have made /tmp 0700 (a review)
        for part in (given, *given.parents):
            try:
                st = part.lstat()
            except OSError:
                continue
            if stat.S_ISLNK(st.st_mode) and st.st_uid not in (os.geteuid(), 0):
                raise ValueError(f"{part} is a symbolic link of another user's, {owner_name(st.st_uid)}, who chose "
                                 "where it points; name a directory of your own")
        path = given.resolve()
        existing = next(p for p in (path, *path.parents) if p.exists())  # (the root exists)
        if not existing.is_dir():  # `up` failed with a bare FileExistsError (fresh-user trial)
            raise ValueError("exists and is not a directory" if existing == path else
                             f"{existing} is a file, not a directory")
        return path

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        # `up` failed with a bare "gaierror: [Errno -2] Name or service not known" (a trial)
        import ipaddress  # noqa: PLC0415
        import socket  # noqa: PLC0415

        v = v.strip()
        try:
            ipaddress.ip_address(v)
        except ValueError:
            try:
                socket.getaddrinfo(v, None)
            except (OSError, UnicodeError):
                raise ValueError("not an IP address or a host name this machine resolves (the interface the local "
                                 "servers bind to; 127.0.0.1 unless you mean to expose them)") from None
        return v

    @field_validator("s3_port", "prefect_port", "mlflow_port")
    @classmethod
    def _port(cls, v: int, info: Any) -> int:
        # -1 and 70000 were taken, then said to be "taken by another process" (a trial)
        if info.field_name == "s3_port" and not 1 <= v <= _MAX_S3_PORT:
            raise ValueError(f"not a port SeaweedFS can use: 1-{_MAX_S3_PORT} (it also takes the port 10000 "
                             "above for its gRPC)")
        if not 1 <= v <= 65535:
            raise ValueError("not a TCP port: 1-65535")
        return v

    @field_validator("results_bucket", "artifacts_bucket", "data_bucket")
    @classmethod
    def _bucket_name(cls, v: str) -> str:
        # S3's bucket naming rules (general purpose buckets); a bad name failed deep in boto3
        if not _BUCKET_NAME.fullmatch(v) or ".." in v or _IP_LIKE.fullmatch(v):
            raise ValueError("not a valid S3 bucket name: 3-63 characters, lowercase letters, digits, '.' and '-', "
                             "starting and ending with a letter or digit")
        return v

    @field_validator("s3_endpoint_url", "prefect_api_url", "mlflow_tracking_uri")
    @classmethod
    def _url(cls, v: str | None) -> str | None:
        from urllib.parse import urlsplit  # noqa: PLC0415

        if not v:
            return v
        try:
            parts = urlsplit(v)
            parts.port  # noqa: B018 - raises on a port that is not a number
        except ValueError as exc:
            if "out of range" in str(exc):  # (it was told the URL's form, not what was wrong with it: a trial)
                raise ValueError("its port is out of range: 1-65535") from None
            if "@" not in v and "cast to integer" in str(exc):
                raise ValueError("its port is not a number: expected http(s)://host[:port][/path]") from None
            parts = None
        if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
            # a password with a raw '/' or '#' ended the host early: its halves were printed in
            # "GET /cdef@host/health failed: Invalid port: 'ab'" (a trial); the hint only where a
            # login is (every malformed URL got it: an infra trial)
            hint = ("; a password with '/', '?', '#' or '@' must be percent-encoded (e.g. %2F for '/')"
                    if "@" in v else "")
            raise ValueError(f"expected http(s)://[user:password@]host[:port][/path]{hint}")
        return v

    @field_validator("prefect_database_url")
    @classmethod
    def _asyncpg(cls, v: SecretStr | None) -> SecretStr | None:
        if v is None:
            return None
        url = v.get_secret_value()
        if url.startswith(("postgresql://", "postgres://")):
            url = "postgresql+asyncpg://" + url.split("://", 1)[1]
        if not url.startswith(("postgresql+asyncpg://", "sqlite+aiosqlite://")):
            raise ValueError("expected postgresql+asyncpg://... or sqlite+aiosqlite://... (Prefect's drivers)")
        return SecretStr(url)

    @field_validator("mlflow_backend_store_uri")
    @classmethod
    def _sql_store(cls, v: SecretStr | None) -> SecretStr | None:
        if v is not None and not v.get_secret_value().startswith(("postgresql", "sqlite:", "mysql")):
            raise ValueError("expected an SQLAlchemy database URI (postgresql://..., sqlite:///..., mysql://...)")
        driver = v.get_secret_value().split("://", 1)[0].partition("+")[2] if v is not None else ""
        if driver.startswith(("async", "aio")):  # MLflow's server hung ~2 minutes on MissingGreenlet (a trial)
            raise ValueError(f"MLflow's store needs a synchronous driver, not +{driver} (Prefect's): "
                             "e.g. postgresql://user:password@host:5432/mlflow")
        return v

    @property
    def uses_local_stack(self) -> bool:
        """True when any of S3, Prefect or MLflow is left to the embedded local stack."""
        return not (self.s3_endpoint_url and self.prefect_api_url and self.mlflow_tracking_uri)


def owner_name(uid: int) -> str:
    """``"name (uid N)"`` for a file owner's user id (``"uid N"`` without a name)."""
    try:
        import pwd  # noqa: PLC0415

        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except (ImportError, KeyError):
        return f"uid {uid}"


def others_could_change(st: os.stat_result) -> str | None:
    """Why another user could put something else in place of an entry of the directory whose
    ``stat`` is ``st`` (``"it is another user's, NAME (uid N)"`` or ``"every user may write it"``),
    or None: it is this user's or root's, and others may write it only with the sticky bit
    (OpenSSH's rule for the directories above its key files)."""
    if st.st_uid not in (os.geteuid(), 0):
        return f"it is another user's, {owner_name(st.st_uid)}"
    if st.st_mode & 0o002 and not st.st_mode & stat.S_ISVTX:
        return "every user may write it (without the sticky bit)"
    return None


def env_file_problem(path: str | os.PathLike[str]) -> str | None:
    """Why the ``.env`` file at ``path`` is not read: it is another user's file or symbolic link
    (a dangling one too), it lies in a directory another user could change
    (:func:`others_could_change`), it is not a regular file, or every user may write it; None when
    it may be read (or there is none).

    Settings read ``.env`` from the current directory, whoever had put it there: one planted in a
    shared directory (``/tmp``) pointed ``PAPERLINE_DASK_SCHEDULER_ADDRESS`` at another user's
    scheduler, whose worker then received the tasks with the S3 secret and the Prefect login in
    them (a security review).
    """
    file = Path(path)
    try:
        link = file.lstat()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        return f"{file.absolute()}: cannot be read ({exc.strerror})"
    # (a link of theirs was read as your file, its target chosen by them; a dangling one, ignored,
    # could be given a target after this check: reviews)
    if stat.S_ISLNK(link.st_mode) and link.st_uid != os.geteuid():
        return (f"{file.absolute()}: this .env file is a symbolic link of another user's, {owner_name(link.st_uid)}, "
                "who chose which file it reads; remove it, or run paperline from another directory")
    # a directory another user owns, or every user may write without the sticky bit: they could
    # put another file in its place between this check and its reading (a review)
    try:
        folder = others_could_change(file.absolute().parent.stat())
    except OSError:
        folder = None
    if folder is not None:
        return (f"{file.absolute()}: in a directory another user could change ({folder}), who could put another "
                ".env file in its place; run paperline from a directory of your own")
    try:
        st = file.stat()
    except (FileNotFoundError, NotADirectoryError):
        return None  # (a link of yours to nothing: pydantic-settings reads none)
    except OSError as exc:
        return f"{file.absolute()}: cannot be read ({exc.strerror})"
    if not stat.S_ISREG(st.st_mode):  # (a FIFO there left every command waiting: a review)
        return f"{file.absolute()}: not a regular file, which a .env file is; remove it, or run paperline elsewhere"
    if st.st_uid != os.geteuid():
        return (f"{file.absolute()}: this .env file belongs to another user, {owner_name(st.st_uid)}, who could "
                "point paperline's endpoints (and so your logins) anywhere with it; remove it, or run paperline from "
                "another directory")
    if st.st_mode & 0o002:
        return (f"{file.absolute()}: every user may write this .env file, and could point paperline's endpoints (and "
                f"so your logins) anywhere with it; chmod o-w {file.absolute()} to keep it (on a file system without "
                "Unix permissions, such as WSL's /mnt/c, export the variables instead)")
    return env_file_syntax_problem(file)


def env_file_syntax_problem(path: str | os.PathLike[str]) -> str | None:
    """The first line of the ``.env`` file at ``path`` that python-dotenv (pydantic-settings'
    reader) cannot parse, which it drops with a warning and reads the rest: a trial's
    ``PAPERLINE_S3_ENDPOINT_URL="http://..."x`` sent every run to the local stack instead, with
    the warning, naming neither file nor setting, printed hundreds of times a command. The line
    is named by number and variable, not quoted (it may hold a secret). None when every line
    parses (or the file cannot be read: pydantic-settings then says so).
    """
    from dotenv.parser import parse_stream  # noqa: PLC0415 - the parser of pydantic-settings' .env reader

    file = Path(path)
    try:
        with open(file, encoding="utf-8") as stream:
            bad = next((b.original for b in parse_stream(stream) if b.error), None)
    except UnicodeDecodeError as exc:
        return f"{file.absolute()}: not UTF-8 text ({exc.reason} at byte {exc.start}); save it as UTF-8"
    except OSError:
        return None
    if bad is None:
        return None
    # python-dotenv marks a binding before the blank lines ahead of it: counted from its first
    # character instead (a trial's bad line 5 was named line 2)
    text = bad.string
    line = bad.line + len(re.findall(r"\r\n|\r|\n", text[:len(text) - len(text.lstrip())]))
    named = re.match(r"\s*(?:export\s+)?([A-Za-z_][A-Za-z0-9_.]*)\s*=", text)
    what = f"line {line} ({named.group(1)})" if named else f"line {line}"
    return (f"{file.absolute()}: {what} is not `NAME=value` as python-dotenv reads it, which would drop it, and its "
            "setting, unsaid; fix it (a value with spaces or `#` in quotes, every quote closed and nothing after the "
            "closing one) or remove it")


# the logins of configured servers, read by their own clients from the environment (not from .env)
CLIENT_LOGIN_VARIABLES = frozenset({"PREFECT_API_AUTH_STRING", "PREFECT_API_KEY", "MLFLOW_TRACKING_TOKEN",
                                    "MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD"})

# PAPERLINE_* variables that are not settings: read where they act (infra/errors.py, the tests)
OTHER_VARIABLES = frozenset({"PAPERLINE_DEBUG", "PAPERLINE_TEST_POSTGRES_URL", "PAPERLINE_REQUIRE_POSTGRES",
                             "PAPERLINE_REQUIRE_BROWSER", "PAPERLINE_CHROMIUM", "PAPERLINE_TEST_ARTIFACTS"})


def unknown_variables(environ: dict[str, str] | None = None, env_file: str | os.PathLike[str] | None = ".env") -> list[str]:
    """One line per ``PAPERLINE_*`` name, in the environment or the ``.env`` file, that is neither
    a setting nor one of :data:`OTHER_VARIABLES`, with the closest setting's name where one is close.

    Such a name is ignored, silently until this: ``PAPERLINE_S3_ENDPOINT=...`` (for
    ``PAPERLINE_S3_ENDPOINT_URL``) made `up` start a local SeaweedFS, and the data went there
    instead of to the intended endpoint (a fresh-user trial). Also one line per server login
    (:data:`CLIENT_LOGIN_VARIABLES`) found in ``.env`` but not in the environment: its client
    never reads it from there.
    """
    import difflib  # noqa: PLC0415

    from dotenv import dotenv_values  # noqa: PLC0415 - pydantic-settings' own .env reader

    known = {f"PAPERLINE_{name.upper()}" for name in Settings.model_fields}
    environ = os.environ if environ is None else environ
    found = {k: "environment" for k in environ if k.upper().startswith("PAPERLINE_")}
    lines = []
    if env_file is not None and Path(env_file).is_file():
        for key in dotenv_values(env_file):
            if key.upper().startswith("PAPERLINE_"):
                found.setdefault(key, f"{env_file} file")
            elif key in CLIENT_LOGIN_VARIABLES and key not in environ:
                # the servers' own clients read these from the environment alone: in .env they were
                # skipped, and the 401 said to set what the user had set (a trial)
                lines.append(f"{key} (in the {env_file} file) is not read from there: Prefect's and MLflow's clients "
                             f"take it from the environment alone; export it")
    for name, where in sorted(found.items()):
        if name.upper() in known or name.upper() in OTHER_VARIABLES:
            continue
        # compared without the prefix, which every name shares (FOO came out close to HOST)
        typed = name.upper().removeprefix("PAPERLINE_")
        candidates = sorted(k.removeprefix("PAPERLINE_") for k in known)
        if any(word in typed for word in ("URI", "URL", "ENDPOINT", "ADDRESS")):  # an endpoint is meant:
            # PAPERLINE_MLFLOW_URI came out closest to MLFLOW_PORT, not MLFLOW_TRACKING_URI (a trial)
            candidates = [k for k in candidates if any(w in k for w in ("URI", "URL", "ENDPOINT", "ADDRESS"))]
        close = difflib.get_close_matches(typed, candidates, n=1, cutoff=0.5)
        hint = f"; did you mean PAPERLINE_{close[0]}?" if close else f"; the settings: README \"Pointing paperline at real infrastructure\""
        lines.append(f"{name} (in the {where}) is not a paperline setting and is ignored{hint}")
    return lines


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process-wide settings, read once. Tests build their own :class:`Settings` instead.

    Raises:
        InputError: a ``PAPERLINE_*`` variable (or ``.env`` entry) with a bad value, naming it.
    """
    from pydantic import ValidationError  # noqa: PLC0415

    from paperline.infra.errors import input_error_from  # noqa: PLC0415

    try:
        return Settings()
    except ValidationError as exc:
        raise input_error_from(exc, lambda loc: "PAPERLINE_" + "__".join(str(p) for p in loc).upper()) from None
