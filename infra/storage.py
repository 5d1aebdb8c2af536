"""The S3 object store: content-addressed objects and write-then-commit outputs.

Large data moves between tasks as S3 URIs plus content hashes, never as pickled arrays. Objects written
with :meth:`ObjectStore.put_bytes` / :meth:`ObjectStore.put_file` live under a key derived from their
SHA-256, so writing the same bytes twice is a no-op. A multi-object output is written with
:meth:`ObjectStore.commit`: the parts first, then ``manifest.json`` last as the commit point, so a
reader that finds the manifest finds every part.

The store works against any S3 endpoint: the local SeaweedFS of ``paperline up`` or real S3.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from paperline.infra.errors import InputError, PaperlineError, ServiceError
from paperline.infra.watch import down_reason

if TYPE_CHECKING:
    from paperline.infra.stack import StackInfo

MANIFEST_NAME = "manifest.json"


class ObjectNotFoundError(PaperlineError, FileNotFoundError):
    """The S3 object (or committed output) does not exist."""


class ObjectChangedError(PaperlineError):
    """The S3 object is no longer the version asked for (its ETag changed: it was overwritten)."""


class ObjectExistsError(PaperlineError, FileExistsError):
    """A create-only write found the object already there (another writer's)."""


class LeaseHeldError(PaperlineError):
    """A lease asked for without waiting is held by a live holder.

    Attributes:
        holder: The holder in words (owner, pid and host).
    """

    def __init__(self, uri: str, holder: str):
        super().__init__(f"{uri} is held by {holder}")
        self.uri, self.holder = uri, holder


class LeaseLostError(PaperlineError):
    """A held lease was lost (``taken_over``: another holder has it now) or may be about to be
    (this holder could not renew it in time).

    Attributes:
        taken_over: True when another holder took the lease over.
    """

    def __init__(self, message: str, taken_over: bool):
        super().__init__(message)
        self.taken_over = taken_over


class NotCommittedError(ObjectNotFoundError):
    """A multi-object output has no manifest: it was never committed, or its writer failed."""


@dataclass(frozen=True)
class ObjectRef:
    """A stored object: where it is and what it holds.

    Attributes:
        uri: ``s3://bucket/key``.
        sha256: Hex SHA-256 of the object's bytes.
        size_bytes: Size in bytes.
    """

    uri: str
    sha256: str
    size_bytes: int


S3_BUCKET_NAME = re.compile(r"[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]")  # S3's bucket naming rules (the common part)


def s3_location_problem(uri: str) -> str | None:
    """What is wrong with ``s3://bucket/key`` as a location to read or write, or None: a bucket
    name S3 refuses (the request failed as "S3 is not available"), or a key with ``.``/``..``
    or empty segments (SeaweedFS answered 400 Bad Request; ``a//b`` was stored as is)."""
    bucket, _, key = uri[len("s3://"):].partition("/")
    if not S3_BUCKET_NAME.fullmatch(bucket):
        return f"{bucket!r} is not a valid S3 bucket name (3-63 lowercase letters, digits, dots and hyphens)"
    parts = key.rstrip("/").split("/") if key.rstrip("/") else []
    if any(p in ("", ".", "..") or p != p.strip() for p in parts):
        return "its key has an empty, '.', '..' or space-padded segment; name it plainly, e.g. s3://bucket/videos/set1"
    return None


def split_uri(uri: str) -> tuple[str, str]:
    """Split ``s3://bucket/key`` into ``(bucket, key)``.

    Raises:
        InputError: ``uri`` is not an ``s3://`` URI with a bucket.
    """
    from paperline.infra.errors import InputError  # noqa: PLC0415

    if not uri.startswith("s3://"):
        raise InputError("uri", uri, "expected s3://bucket/key")
    bucket, _, key = uri[5:].partition("/")
    if not bucket:
        raise InputError("uri", uri, "expected s3://bucket/key")
    return bucket, key


def nearest_existing(path: Path) -> Path:
    """``path`` itself, or its nearest ancestor that exists (where a file under it would land)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def require_writable_dir(argument: str, value: object, directory: Path) -> None:
    """Refuse a local ``directory`` a file cannot be created in, found by creating (and removing)
    one: permission bits say nothing for root, and ``/proc`` takes no files whatever they say.

    Raises:
        InputError: naming ``argument``, ``value`` and the directory, with the system's reason.
    """
    try:
        with tempfile.NamedTemporaryFile(dir=directory, prefix=".paperline-probe-"):
            pass
    except OSError as exc:
        # the system's reason in brackets: "cannot write in /proc: No such file or directory" read as
        # /proc missing (a trial)
        raise InputError(argument, value, f"cannot create a file in {directory} (the system says: "
                                          f"{exc.strerror or exc})") from None


def require_outside_state_dir(argument: str, value: object, path: Path, state_dir: Path) -> None:
    """Refuse a local file ``path`` the run would write inside paperline's ``state_dir``: the
    stack's servers' data, logins and records, and scratch later runs reuse (a trial's gemm
    ``output`` replaced a staged random operand, which the next runs multiplied unchecked).

    Raises:
        InputError: naming ``argument``, ``value`` and the state directory.
    """
    state = Path(state_dir).expanduser().resolve()
    target = Path(path).expanduser().resolve()
    if target == state or state in target.parents:
        raise InputError(argument, value, f"is inside paperline's state directory {state} (PAPERLINE_STATE_DIR: the "
                                          "stack's servers' data and logins, and staged operands later runs reuse); "
                                          "name a file elsewhere")


def _sha256_file(path: Path) -> tuple[str, int]:
    """Hex SHA-256 of a file's bytes and how many bytes were hashed (one read of the file)."""
    with open(path, "rb") as f:
        digest = hashlib.file_digest(f, "sha256")
        return digest.hexdigest(), f.tell()


def _join(prefix: str, name: str) -> str:
    prefix = prefix.strip("/")
    return f"{prefix}/{name}" if prefix else name


def _free_bytes(path: Path) -> int | None:
    """Free bytes on the file system holding ``path`` (None where it cannot be read)."""
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def this_machine() -> tuple[str, str]:
    """This machine: its host name and its ``/etc/machine-id`` ("" where there is none), so that
    two machines of one host name are not taken for one (a pid of one unknown on the other would
    read as a dead holder's)."""
    import socket  # noqa: PLC0415

    try:
        machine_id = Path("/etc/machine-id").read_text().strip()
    except OSError:
        machine_id = ""
    return socket.gethostname(), machine_id


def _holder_words(held: Any) -> tuple[str, bool]:
    """A lease object's holder in words, and whether its process is known gone (it ran on this
    machine and no such process is left)."""
    try:
        words = f"{held['owner']} (pid {held['pid']} on {held['host']})"
    except (KeyError, TypeError):
        return "another writer", False
    return words, gone_from_this_machine(held.get("pid"), held.get("host"), held.get("machine_id"))


def gone_from_this_machine(pid: Any, host: Any, machine_id: Any = None) -> bool:
    """True when process ``pid`` ran on this machine (``host`` and, where given, ``machine_id``
    are :func:`this_machine`'s) and no such process is left. False for a live one (a PID reused
    since reads as live, another user's too), another machine's, or a pid that is not an int."""
    here, mine = this_machine()
    if host != here or (machine_id is not None and machine_id != mine) or not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        pass  # (alive, another user's)
    return False


def _server_age(head: dict[str, Any]) -> float:
    """Seconds since the object was last written, by the S3 server's own clock (its reply's
    ``Date`` header less the object's ``Last-Modified``, both to the second); 0 when the reply
    lacks either."""
    from email.utils import parsedate_to_datetime  # noqa: PLC0415

    try:
        now = parsedate_to_datetime(head["ResponseMetadata"]["HTTPHeaders"]["date"])
        return max(0.0, (now - head["LastModified"]).total_seconds())
    except (KeyError, TypeError, ValueError):
        return 0.0


class ObjectStore:
    """A client of one S3 endpoint.

    Picklable (the boto3 client is created lazily and dropped when pickled), so it can travel to Dask
    workers. The secret never appears in ``repr``.

    Args:
        endpoint_url: S3 endpoint, e.g. ``http://127.0.0.1:8333``; None for AWS's default endpoint.
        access_key_id: Access key; None to use boto3's default credential chain.
        secret_access_key: Secret key; None to use boto3's default credential chain.
        region: Region used for request signing.
    """

    def __init__(
        self,
        endpoint_url: str | None,
        access_key_id: str | None,
        secret_access_key: str | None,
        region: str = "us-east-1",
        log_path: str | None = None,
    ):
        self.endpoint_url = endpoint_url
        self.log_path = log_path  # the local server's log, named in its errors
        self.access_key_id = access_key_id
        self._secret_access_key = secret_access_key
        self.region = region
        self._client: Any = None
        self._lock = threading.Lock()

    @classmethod
    def from_stack(cls, info: StackInfo) -> ObjectStore:
        """The store of a running stack (see :func:`paperline.infra.stack.ensure_stack`)."""
        log = next((s.log_path for s in info.services if s.name == "s3" and s.managed), None)
        return cls(info.s3_endpoint_url, info.s3_access_key_id, info.s3_secret_access_key, info.s3_region,
                   log_path=log)

    # -- plumbing -------------------------------------------------------------------------------------

    def __repr__(self) -> str:
        return f"ObjectStore(endpoint_url={self.endpoint_url!r}, access_key_id={self.access_key_id!r}, region={self.region!r})"

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_client"] = None
        state["_lock"] = None
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def client(self) -> Any:
        """The boto3 S3 client (created on first use; thread-safe once created)."""
        if self._client is None:
            with self._lock:
                if self._client is None:
                    import boto3  # noqa: PLC0415
                    from botocore.config import Config  # noqa: PLC0415

                    session = boto3.session.Session()
                    self._client = session.client(
                        "s3",
                        endpoint_url=self.endpoint_url,
                        aws_access_key_id=self.access_key_id,
                        aws_secret_access_key=self._secret_access_key,
                        region_name=self.region,
                        config=Config(
                            signature_version="s3v4",
                            s3={"addressing_style": "path"},
                            retries={"max_attempts": 3, "mode": "standard"},
                            connect_timeout=5,
                            read_timeout=120,
                        ),
                    )
        return self._client

    def _service_error(self, exc: Exception, what: str) -> ServiceError:
        from paperline.infra.tracking import STATUS_HINT  # noqa: PLC0415

        return ServiceError("s3", f"{what}: {exc}; {STATUS_HINT}", url=self.endpoint_url, log=self.log_path)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        """Call a boto3 method, turning connection and credential failures into ServiceError (at
        once, without a request, where this process's run watch found the local server dead:
        :func:`paperline.infra.watch.down_reason`)."""
        if (why := down_reason("s3")) is not None:
            raise ServiceError("s3", f"{what}: {why}", url=self.endpoint_url, log=self.log_path)
        from botocore.exceptions import (  # noqa: PLC0415
            BotoCoreError,
            ClientError,
            NoCredentialsError,
        )

        from boto3.exceptions import S3UploadFailedError  # noqa: PLC0415

        try:
            return fn(*args, **kwargs)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "")
            if code in {"SignatureDoesNotMatch", "InvalidAccessKeyId", "AccessDenied", "InvalidToken"}:
                raise ServiceError("s3", f"{what}: credentials rejected ({code})", url=self.endpoint_url) from exc
            failed = self._server_failed(what, exc)
            if failed is not None:
                raise failed from exc
            raise
        except S3UploadFailedError as exc:  # boto3's upload_file wraps the ClientError: it went by unexplained (a trial)
            cause = exc.__cause__ or exc.__context__
            failed = self._server_failed(what, cause) if isinstance(cause, ClientError) else None
            if failed is not None:
                raise failed from exc
            raise
        except NoCredentialsError as exc:
            raise ServiceError("s3", f"{what}: no S3 credentials configured", url=self.endpoint_url) from exc
        except BotoCoreError as exc:  # connection refused, timeouts, ...
            raise self._service_error(exc, what) from exc

    def _server_failed(self, what: str, exc: Any) -> ServiceError | None:
        """The error for an S3 server's HTTP 5xx (``exc``, a botocore ``ClientError``), naming what
        stops a local SeaweedFS's writes; None for any other status."""
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0
        if status < 500:
            return None
        code = exc.response.get("Error", {}).get("Code", "")
        message = exc.response.get("Error", {}).get("Message", "")  # "InternalError ... please try again" (a trial)
        # (or no free volumes: SeaweedFS sized its count of 1 GiB volumes from the disk's free space
        # at its start, and its log said "no free volumes left": measured)
        disk = ""
        if self.log_path:
            free = _free_bytes(Path(self.log_path).parent.parent)
            now = f" ({free / 2**20:.0f} MiB free now)" if free is not None else ""
            disk = (f"; a full disk{now} stops SeaweedFS's writes, as does running out of volumes (it makes one "
                    "1 GiB volume per GiB the disk had free when it started: free at least 1 GiB, then `paperline "
                    "down` and `up`; `df -h` of the state directory and its log say more)")
        return ServiceError("s3", f"{what}: the server failed (HTTP {status}, {code}: {message}){disk}",
                            url=self.endpoint_url, log=self.log_path)

    @staticmethod
    def _is_not_found(exc: Exception) -> bool:
        from botocore.exceptions import ClientError  # noqa: PLC0415

        if not isinstance(exc, ClientError):
            return False
        code = str(exc.response.get("Error", {}).get("Code", ""))
        return code in {"404", "NoSuchKey", "NotFound", "NoSuchBucket"}

    def _head(self, bucket: str, key: str) -> dict[str, Any] | None:
        from botocore.exceptions import ClientError  # noqa: PLC0415

        try:
            return self._call(f"head s3://{bucket}/{key}", self.client.head_object, Bucket=bucket, Key=key)
        except ClientError as exc:
            if self._is_not_found(exc):
                return None
            raise

    # -- buckets --------------------------------------------------------------------------------------

    def ensure_buckets(self, names: list[str] | tuple[str, ...]) -> list[str]:
        """Create the buckets that do not exist yet (idempotent); returns the names created.

        Raises:
            InputError: A bucket name is shorter than 3 characters.
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        from botocore.exceptions import ClientError  # noqa: PLC0415

        from paperline.infra.errors import InputError  # noqa: PLC0415

        created = []
        for name in names:
            if len(name) < 3:
                raise InputError("bucket", name, "S3 bucket names have at least 3 characters")
            try:
                self._call(f"head bucket {name}", self.client.head_bucket, Bucket=name)
                continue
            except ClientError as exc:
                if not self._is_not_found(exc):
                    raise
            kwargs: dict[str, Any] = {"Bucket": name}
            if self.region and self.region != "us-east-1":
                kwargs["CreateBucketConfiguration"] = {"LocationConstraint": self.region}
            try:
                self._call(f"create bucket {name}", self.client.create_bucket, **kwargs)
                created.append(name)
            except ClientError as exc:
                if exc.response.get("Error", {}).get("Code") not in {"BucketAlreadyOwnedByYou", "BucketAlreadyExists"}:
                    raise
        return created

    def bucket_exists(self, name: str) -> bool:
        """Whether the bucket exists (and these credentials may see it).

        Raises:
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        from botocore.exceptions import ClientError  # noqa: PLC0415

        try:
            self._call(f"head bucket {name}", self.client.head_bucket, Bucket=name)
            return True
        except ClientError as exc:
            if self._is_not_found(exc) or exc.response.get("Error", {}).get("Code") in {"403", "Forbidden"}:
                return False
            raise

    def require_bucket(self, argument: str, uri: str) -> None:
        """Refuse a user's ``s3://bucket/...`` URI whose bucket does not exist (buckets named by
        the user are never created for them).

        Raises:
            InputError: naming ``argument``, the URI and the bucket.
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        bucket = split_uri(uri)[0]
        if not self.bucket_exists(bucket):
            raise InputError(argument, uri, f"no such bucket {bucket!r} (or these credentials may not read it)")

    # -- objects --------------------------------------------------------------------------------------

    def put_bytes(self, data: bytes, *, bucket: str, prefix: str, suffix: str = "") -> ObjectRef:
        """Store bytes under the content-addressed key ``{prefix}/{sha256}{suffix}``.

        Idempotent: nothing is uploaded when an object of the same key and size exists.

        Args:
            data: The object's bytes.
            bucket: Target bucket.
            prefix: Key prefix (no leading/trailing slash needed).
            suffix: Appended to the hash, e.g. ``".parquet"``.

        Returns:
            The object's reference (URI, SHA-256, size in bytes).

        Raises:
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        sha = hashlib.sha256(data).hexdigest()
        key = _join(prefix, f"{sha}{suffix}")
        head = self._head(bucket, key)
        if head is None or int(head.get("ContentLength", -1)) != len(data):
            self._call(
                f"put s3://{bucket}/{key}",
                self.client.put_object,
                Bucket=bucket,
                Key=key,
                Body=data,
                Metadata={"sha256": sha},
            )
        return ObjectRef(f"s3://{bucket}/{key}", sha, len(data))

    def put_file(self, path: str | os.PathLike[str], *, bucket: str, prefix: str, suffix: str | None = None) -> ObjectRef:
        """Store a local file under ``{prefix}/{sha256}{suffix}`` (multipart for large files).

        Args:
            path: Local file.
            bucket: Target bucket.
            prefix: Key prefix.
            suffix: Appended to the hash; None uses the file's extension (e.g. ``".mp4"``).

        Returns:
            The object's reference.

        Raises:
            FileNotFoundError: ``path`` does not exist.
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        path = Path(path)
        sha, size = _sha256_file(path)
        if suffix is None:
            suffix = "".join(path.suffixes)
        key = _join(prefix, f"{sha}{suffix}")
        head = self._head(bucket, key)
        if head is None or int(head.get("ContentLength", -1)) != size:
            self._call(
                f"upload {path} to s3://{bucket}/{key}",
                self.client.upload_file,
                str(path),
                bucket,
                key,
                ExtraArgs={"Metadata": {"sha256": sha}},
            )
        return ObjectRef(f"s3://{bucket}/{key}", sha, size)

    def get_bytes(self, uri: str, *, sha256: str | None = None) -> bytes:
        """Read an object.

        Args:
            uri: ``s3://bucket/key``.
            sha256: When given, the bytes are checked against it.

        Returns:
            The object's bytes.

        Raises:
            ObjectNotFoundError: No such object.
            PaperlineError: The bytes do not match ``sha256``.
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        with self.open_stream(uri) as body:
            data = body.read()
        if sha256 is not None and hashlib.sha256(data).hexdigest() != sha256:
            raise PaperlineError(f"{uri}: content does not match sha256 {sha256}")
        return data

    def head(self, uri: str) -> dict[str, Any] | None:
        """The object's metadata (``ContentLength``, ``ETag``, ...), or None if there is no such object.

        Raises:
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        bucket, key = split_uri(uri)
        return self._head(bucket, key)

    def get_range(self, uri: str, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of an object (one ranged GET).

        Raises:
            ObjectNotFoundError: No such object.
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        from botocore.exceptions import ClientError  # noqa: PLC0415

        bucket, key = split_uri(uri)
        try:
            resp = self._call(f"get {uri} bytes {start}-{stop - 1}", self.client.get_object, Bucket=bucket, Key=key,
                              Range=f"bytes={start}-{stop - 1}")
        except ClientError as exc:
            if self._is_not_found(exc):
                raise ObjectNotFoundError(f"{uri}: no such object") from exc
            raise
        return resp["Body"].read()

    def open_stream(self, uri: str) -> Any:
        """A readable, closeable stream of an object's bytes (one GET, read as it arrives), for
        reading large objects such as tar shards without holding them in memory.

        Raises:
            ObjectNotFoundError: No such object.
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        from botocore.exceptions import ClientError  # noqa: PLC0415

        bucket, key = split_uri(uri)
        try:
            resp = self._call(f"get {uri}", self.client.get_object, Bucket=bucket, Key=key)
        except ClientError as exc:
            if self._is_not_found(exc):
                raise ObjectNotFoundError(f"{uri}: no such object") from exc
            raise
        return resp["Body"]

    def put_bytes_to(self, data: bytes, uri: str, *, if_absent: bool = False) -> str:
        """Write ``data`` to exactly ``uri`` in one PUT (a reader sees the old object or the new
        one, never a part), e.g. a checkpoint replaced after every step.

        Args:
            data: The object's bytes.
            uri: ``s3://bucket/key``.
            if_absent: Create only (``If-None-Match: *``, which SeaweedFS, AWS S3 and MinIO
                decide atomically): of two writers creating one object, one wins and the other
                gets :class:`ObjectExistsError`, e.g. a dataset's commit. Bytes equal to this
                call's found there count as written (a retried PUT whose first attempt landed).

        Raises:
            ObjectExistsError: ``if_absent`` and the object exists with other bytes.
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        from botocore.exceptions import ClientError  # noqa: PLC0415

        bucket, key = split_uri(uri)
        sha = hashlib.sha256(data).hexdigest()
        if not if_absent:
            self._call(f"put {uri}", self.client.put_object, Bucket=bucket, Key=key, Body=data, Metadata={"sha256": sha})
            return uri
        for attempt in range(20):
            try:
                self._call(f"put {uri}", self.client.put_object, Bucket=bucket, Key=key, Body=data,
                           Metadata={"sha256": sha}, IfNoneMatch="*")
                return uri
            except ClientError as exc:
                code = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
                if code not in (409, 412):
                    raise
            # 409 (AWS): another conditional write to it is in flight; 412: it exists
            head = self._head(bucket, key) if code == 412 else None
            if head is not None:
                if head.get("Metadata", {}).get("sha256") == sha and int(head["ContentLength"]) == len(data):
                    return uri  # (this PUT's own first attempt, retried by boto3 after a lost reply; or the same bytes)
                raise ObjectExistsError(f"{uri}: already exists (written by another writer)")
            time.sleep(0.1 * (attempt + 1))  # in flight, or deleted in between: try again
        raise ObjectExistsError(f"{uri}: other writers kept writing it (20 tries)")

    def upload_file_to(self, path: str | os.PathLike[str], uri: str, *,
                       record: str | os.PathLike[str] | None = None) -> str:
        """Upload a local file to exactly ``uri`` (multipart for large files: the object becomes
        visible only when every part has arrived, so a failed upload leaves nothing).

        Args:
            path: The local file.
            uri: ``s3://bucket/key``.
            record: A file to write ``{"uri": ..., "upload_id": ...}`` into as soon as S3 has
                begun the multipart upload (botocore's ``after-call`` event of
                ``CreateMultipartUpload``; nothing for a file under boto3's 8-MiB multipart
                threshold): a process killed outright mid-upload (``kill -9``) cannot abort it,
                and S3 keeps, and AWS bills, its parts until someone does
                (:meth:`abort_recorded_upload`). An upload that fails otherwise is aborted by boto3.

        Raises:
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        bucket, key = split_uri(uri)
        if record is None:
            self._call(f"upload {uri}", self.client.upload_file, str(path), bucket, key)
            return uri

        def begun(parsed: dict[str, Any], **_: Any) -> None:
            if parsed.get("Bucket") == bucket and parsed.get("Key") == key and parsed.get("UploadId"):
                fd, tmp = tempfile.mkstemp(dir=os.path.dirname(os.path.abspath(record)), prefix=".record-")
                with os.fdopen(fd, "w") as f:
                    json.dump({"uri": uri, "upload_id": parsed["UploadId"]}, f)
                os.replace(tmp, record)

        events, name = self.client.meta.events, f"paperline-record-{id(begun)}"
        events.register("after-call.s3.CreateMultipartUpload", begun, unique_id=name)
        try:
            self._call(f"upload {uri}", self.client.upload_file, str(path), bucket, key)
        finally:
            events.unregister("after-call.s3.CreateMultipartUpload", unique_id=name)
        return uri

    def abort_recorded_upload(self, record: str | os.PathLike[str]) -> bool:
        """Abort the multipart upload that :meth:`upload_file_to` recorded in ``record`` (of a
        process killed mid-upload): its parts are deleted, and the object it would have made never
        appears.

        Returns:
            True when there is nothing left to abort: no record (the upload was a single PUT, or
            never began), the upload aborted now, or S3 no longer knows it (it completed, or was
            aborted already). False for a record that cannot be read.

        Raises:
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        from botocore.exceptions import ClientError  # noqa: PLC0415

        try:
            recorded = json.loads(Path(record).read_text())
            uri, upload_id = recorded["uri"], recorded["upload_id"]
            bucket, key = split_uri(uri)
        except FileNotFoundError:
            return True
        except (OSError, ValueError, KeyError, TypeError, InputError):
            return False
        try:
            self._call(f"abort the upload to {uri}", self.client.abort_multipart_upload, Bucket=bucket, Key=key,
                       UploadId=upload_id)
        except ClientError as exc:
            if exc.response.get("Error", {}).get("Code") not in ("NoSuchUpload", "404"):
                raise
        return True

    def get_file(self, uri: str, path: str | os.PathLike[str], *, etag: str | None = None) -> Path:
        """Download an object to a local file (written atomically: temporary file, then rename).

        Args:
            uri: ``s3://bucket/key``.
            path: The local file to write.
            etag: When given, only that version of the object is read (one GET with ``If-Match``,
                so the file is that version's bytes even if the object is overwritten meanwhile);
                otherwise boto3's parallel ranged download.

        Returns:
            The local path.

        Raises:
            ObjectNotFoundError: No such object.
            ObjectChangedError: ``etag`` is given and the object's ETag is another.
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        import shutil  # noqa: PLC0415

        from botocore.exceptions import ClientError  # noqa: PLC0415

        bucket, key = split_uri(uri)
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        # (a prefix taken from the name overran the file system's 255 bytes for a long object name: a trial)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".download-", suffix=".part")
        os.close(fd)
        try:
            if etag is None:
                self._call(f"download {uri}", self.client.download_file, bucket, key, tmp)
            else:
                resp = self._call(f"download {uri}", self.client.get_object, Bucket=bucket, Key=key, IfMatch=etag)
                with resp["Body"] as body, open(tmp, "wb") as f:
                    shutil.copyfileobj(body, f, 1 << 20)
            os.replace(tmp, path)
        except ClientError as exc:
            if self._is_not_found(exc):
                raise ObjectNotFoundError(f"{uri}: no such object") from exc
            if exc.response.get("Error", {}).get("Code") in {"PreconditionFailed", "412"}:
                raise ObjectChangedError(f"{uri}: the object was overwritten (its ETag is no longer {etag})") from exc
            raise
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
        return path

    def exists(self, uri: str) -> bool:
        """Whether the object exists.

        Raises:
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        bucket, key = split_uri(uri)
        return self._head(bucket, key) is not None

    def any_under(self, uri_prefix: str) -> bool:
        """Whether any object's key starts with the prefix (one request of one key: :meth:`list`
        pages through all of them).

        Raises:
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        bucket, prefix = split_uri(uri_prefix)
        page = self._call(f"list {uri_prefix}", self.client.list_objects_v2, Bucket=bucket, Prefix=prefix, MaxKeys=1)
        return bool(page.get("Contents"))

    def list(self, uri_prefix: str) -> list[str]:
        """URIs of all objects whose key starts with the prefix, sorted.

        Args:
            uri_prefix: ``s3://bucket/some/prefix`` (a plain string prefix, not only a "folder").

        Raises:
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        bucket, prefix = split_uri(uri_prefix)
        paginator = self.client.get_paginator("list_objects_v2")
        out: list[str] = []

        def _all() -> None:
            for page in paginator.paginate(Bucket=bucket, Prefix=prefix):
                out.extend(f"s3://{bucket}/{obj['Key']}" for obj in page.get("Contents", []))

        self._call(f"list {uri_prefix}", _all)
        return sorted(out)

    def delete(self, uri: str) -> None:
        """Delete one object (no error when it is already gone).

        Raises:
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        bucket, key = split_uri(uri)
        self._call(f"delete {uri}", lambda: self.client.delete_object(Bucket=bucket, Key=key))

    # -- one writer at a time ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def lease(self, uri: str, owner: str, *, on_wait: Callable[[str], None] | None = None,
              on_takeover: Callable[[str], None] | None = None, renew_s: float = 10.0, stale_s: float = 60.0,
              poll_s: float = 1.0, wait: bool = True) -> Iterator[Callable[[], None]]:
        """Hold the object ``uri`` as a lease while the block runs: one holder at a time, across
        processes and machines, for a write that must not interleave with another (two runs
        committing one dataset: a trial's two runs both reported success while the second
        rewrote the first's committed shards).

        Taken by a conditional create (``If-None-Match: *``: SeaweedFS, AWS S3 and MinIO refuse
        it when the object exists), renewed every ``renew_s`` seconds by a thread (a conditional
        rewrite, ``If-Match`` of the last ETag), and deleted at the end. A waiter polls every
        ``poll_s`` seconds; a lease whose ETag has not changed for ``stale_s`` seconds of the
        waiter's own clock (its holder died without releasing it) is taken over, and at once when
        its holder's process, on this machine, is gone. A lease that by the S3 server's own clock
        (its reply's ``Date`` less the object's ``Last-Modified``) was last written over
        ``stale_s + 1`` seconds ago is taken over once it stays unchanged for ``renew_s +
        poll_s`` of the waiter's clock (a holder dead long before need not be waited for
        ``stale_s``; the confirmation guards against a server clock that jumped). No clock is
        compared between machines. Each holder writes a token of its own into the object, so a
        conditional request that botocore retried after its first attempt landed (a lost
        response) is known for this holder's own, not another's.

        Args:
            uri: The lease object, e.g. ``s3://bucket/prefix/.write-lease.json``.
            owner: Who holds it, in words (stored in the object, shown to waiters).
            on_wait: Called once with the holder's words when the lease is held by another.
            on_takeover: Called with the holder's words and why, when its lease is taken over.
            renew_s, stale_s, poll_s: Seconds, as above (``stale_s`` > 2 ``renew_s``).
            wait: False refuses at once (:class:`LeaseHeldError`) where a live holder holds the
                lease, rather than waiting for it (a campaign that must not run twice); a lease
                the server's clock says is stale is still confirmed and taken over.

        Yields:
            A check to call before each write the lease guards: it raises when the lease was
            taken over, or when this holder has not renewed it for ``stale_s - 2 renew_s``
            seconds (it stops writing before a waiter could take the lease over: a holder cut
            off from S3, or paused, wrote on over its successor's shards: a review).

        Raises:
            LeaseHeldError: ``wait`` is False and a live holder holds the lease.
            ServiceError: S3 is unreachable or rejects the credentials.
            LeaseLostError: (from the check) the lease was lost, or may be.
        """
        import uuid  # noqa: PLC0415

        from botocore.exceptions import ClientError  # noqa: PLC0415

        if not stale_s > 2 * renew_s > 0:
            raise InputError("stale_s", stale_s, f"must exceed twice renew_s ({renew_s:g} s), which must be positive")
        bucket, key = split_uri(uri)
        token = uuid.uuid4().hex
        host, machine_id = this_machine()
        base = {"owner": owner, "host": host, "machine_id": machine_id, "pid": os.getpid(), "token": token}

        def status(exc: ClientError) -> int:
            return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)

        def put(n: int, **condition: str) -> str:
            body = json.dumps({**base, "renewal": n}).encode()  # (a new ETag per renewal: waiters see it live)
            return self._call(f"lease {uri}", self.client.put_object, Bucket=bucket, Key=key, Body=body,
                              **condition)["ETag"]

        def ours() -> str | None:
            """The lease's ETag when it holds this holder's token (a retried request's first
            attempt landed), else None."""
            try:
                got = self._call(f"lease {uri}", self.client.get_object, Bucket=bucket, Key=key)
                held = json.loads(got["Body"].read())
            except (ClientError, ValueError):
                return None
            return got["ETag"] if isinstance(held, dict) and held.get("token") == token else None

        def holder() -> tuple[str, bool]:
            """The holder in words, and whether its process is known gone (on this machine)."""
            try:
                return _holder_words(json.loads(self.get_bytes(uri)))
            except Exception:  # noqa: BLE001 - (released meanwhile, or not ours to read)
                return "another writer", False

        seen, seen_at, said, who, gone = None, 0.0, False, "another writer", False
        while True:
            try:
                etag = put(0, IfNoneMatch="*")
                break
            except ClientError as exc:
                # 412: it exists; 409 (AWS): another conditional write to it is in flight, try again
                if status(exc) not in (409, 412):
                    raise
                if status(exc) == 412 and (mine := ours()) is not None:
                    etag = mine
                    break
            head = self._head(bucket, key)
            if head is None:
                continue  # released in between
            if head["ETag"] != seen:
                seen, seen_at = head["ETag"], time.monotonic()
                who, gone = holder()
            unrenewed = time.monotonic() - seen_at
            # a holder dead long before this waiter came need not be waited for stale_s: the S3
            # server's clock says how old the lease is (to the second: a second's grace), confirmed
            # by the lease staying unchanged for a renewal's time on this waiter's own clock (a
            # server clock that jumped, or gateways whose clocks differ, made a live lease look old)
            aged = _server_age(head) > stale_s + 1 and unrenewed > renew_s + poll_s
            if gone or unrenewed > stale_s or aged:  # its holder died, or stopped renewing: taken over
                try:
                    self._call(f"lease {uri}", self.client.delete_object, Bucket=bucket, Key=key, IfMatch=seen)
                except ClientError:
                    continue  # (another waiter took it first)
                if on_takeover is not None:  # (a waiter saw only "waiting for ...", then success: a trial)
                    on_takeover(f"{who}: its process is gone" if gone else
                                f"{who}: not renewed for the {unrenewed:.0f} s since this run first saw it"
                                if unrenewed > stale_s else f"{who}: last renewed {_server_age(head):.0f} s ago (the "
                                                            "S3 server's clock)")
                continue
            if not wait and _server_age(head) <= stale_s + 1:
                raise LeaseHeldError(uri, who)
            if not said and on_wait is not None:
                said = True
                on_wait(who)
            time.sleep(poll_s)
        state: dict[str, Any] = {"etag": etag, "lost": False, "renewed_at": time.monotonic()}
        stop, one_at_a_time = threading.Event(), threading.Lock()  # (a renewal is not half-seen by the check)

        def renew() -> None:
            n = 0
            while not stop.wait(renew_s):
                n += 1
                with one_at_a_time:
                    try:
                        state["etag"] = put(n, IfMatch=state["etag"])
                    except ClientError as exc:
                        if status(exc) == 412 and (mine := ours()) is None:  # taken over
                            state["lost"] = True
                            return
                        if status(exc) == 412:  # (this renewal's retried first attempt had landed)
                            state["etag"] = mine
                        else:
                            continue  # 409, 5xx: renewed next time
                    except Exception:  # noqa: BLE001 - an S3 hiccup: renewed next time (a waiter waits stale_s)
                        continue
                    state["renewed_at"] = time.monotonic()

        def check() -> None:  # (one HEAD: a takeover the renewals have not met yet is seen too)
            with one_at_a_time:
                head = self._head(bucket, key)
                unrenewed = time.monotonic() - state["renewed_at"]
                if state["lost"] or head is None or head["ETag"] != state["etag"]:
                    state["lost"] = True
                    raise LeaseLostError(f"lost the write lease {uri} (not renewed for {stale_s:g} s, and another "
                                         "writer took it over): stopped before writing on; run again", True)
                if unrenewed > stale_s - 2 * renew_s:
                    raise LeaseLostError(f"could not renew the write lease {uri} for {unrenewed:.0f} s: stopped "
                                         f"before another writer may take it over ({stale_s:g} s); run again", False)

        thread = threading.Thread(target=renew, name=f"lease {key}", daemon=True)
        thread.start()
        try:
            yield check
        finally:
            stop.set()
            thread.join()
            if not state["lost"]:
                with contextlib.suppress(Exception):  # (gone with the server: taken over after stale_s)
                    self._call(f"lease {uri}", self.client.delete_object, Bucket=bucket, Key=key,
                               IfMatch=state["etag"])

    def lease_holder(self, uri: str, stale_s: float = 60.0) -> str | None:
        """Who holds the lease ``uri`` (:meth:`lease`) now, in words, without taking it: None when
        it is free, its holder's process on this machine is gone, or the S3 server's clock says it
        was last renewed over ``stale_s + 1`` seconds ago (a check before a run starts; the run
        takes the lease itself).

        Raises:
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        bucket, key = split_uri(uri)
        head = self._head(bucket, key)
        if head is None or _server_age(head) > stale_s + 1:
            return None
        try:
            words, gone = _holder_words(json.loads(self.get_bytes(uri)))
        except (ObjectNotFoundError, ValueError):
            return None
        return None if gone else words

    # -- write-then-commit ----------------------------------------------------------------------------

    def commit(self, prefix_uri: str, parts: dict[str, bytes], meta: dict[str, Any] | None = None) -> ObjectRef:
        """Write a multi-object output that becomes visible only when complete.

        All parts are uploaded first, content-addressed under ``{prefix}/parts/``; then
        ``{prefix}/manifest.json`` is written last as the commit point. If any part fails, no manifest is
        written. The manifest is deterministic (sorted JSON), so committing the same output twice is
        idempotent.

        Args:
            prefix_uri: ``s3://bucket/prefix`` of the output.
            parts: Part name -> bytes. A name's extension is kept as the object's suffix.
            meta: JSON-serialisable metadata stored in the manifest.

        Returns:
            The manifest's reference.

        Raises:
            ServiceError: S3 is unreachable or rejects the credentials.
            TypeError: ``meta`` is not JSON-serialisable.
        """
        bucket, prefix = split_uri(prefix_uri.rstrip("/"))
        meta = dict(meta or {})
        json.dumps(meta)  # fail before uploading anything
        entries: dict[str, dict[str, Any]] = {}
        for name, data in parts.items():
            suffix = "".join(Path(name).suffixes)
            ref = self.put_bytes(data, bucket=bucket, prefix=_join(prefix, "parts"), suffix=suffix)
            entries[name] = {"uri": ref.uri, "sha256": ref.sha256, "size_bytes": ref.size_bytes}
        manifest = {"version": 1, "prefix": f"s3://{bucket}/{prefix}", "parts": entries, "meta": meta}
        body = json.dumps(manifest, sort_keys=True, indent=1).encode()
        key = _join(prefix, MANIFEST_NAME)
        self._call(
            f"commit s3://{bucket}/{key}",
            self.client.put_object,
            Bucket=bucket,
            Key=key,
            Body=body,
            ContentType="application/json",
        )
        return ObjectRef(f"s3://{bucket}/{key}", hashlib.sha256(body).hexdigest(), len(body))

    def is_committed(self, prefix_uri: str) -> bool:
        """Whether ``{prefix}/manifest.json`` exists.

        Raises:
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        return self.exists(f"{prefix_uri.rstrip('/')}/{MANIFEST_NAME}")

    def read_manifest(self, prefix_uri: str) -> dict[str, Any]:
        """The manifest of a committed output: ``{"version", "prefix", "parts": {name: {uri, sha256,
        size_bytes}}, "meta"}``.

        Raises:
            NotCommittedError: There is no manifest (the output was never committed).
            ServiceError: S3 is unreachable or rejects the credentials.
        """
        uri = f"{prefix_uri.rstrip('/')}/{MANIFEST_NAME}"
        try:
            data = self.get_bytes(uri)
        except ObjectNotFoundError as exc:
            raise NotCommittedError(f"{prefix_uri}: not committed (no {MANIFEST_NAME})") from exc
        return json.loads(data)
