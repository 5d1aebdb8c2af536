"""Two measured workarounds for Prefect 3.9's per-submit cost of serializing the run's context.

Every ``task.submit`` to the Dask task runner serializes the flow run's context, and with it the
result-storage block (paperline's S3 bucket and its credentials, ``infra/stack.py``). Prefect's
``Block.ser_model`` asks ``Block._field_has_secrets`` about every field, and that regenerates the
block class's whole pydantic JSON schema each time, uncached: about 19 schema builds per submit,
60 ms on this 2-core machine. A cached ``paperline run tensor-factorization`` (22 task runs, 16 of
them submitted) spent about 1 s of its 12-13 s there (cProfile, 2026-11-30).

:func:`install` caches each block class's ``secret_fields`` (a property of the class alone: the
schema is generated from the class's fields and ``model_config``) and answers the same question
from it, with Prefect's own matching rules. ``tests/infra/test_prefect_patches.py`` checks it gives
Prefect's answer for every field of every block class Prefect has registered.

The same submit also serializes the settings context (``SettingsContext.serialize``: a
``model_dump`` of Prefect's 54 nested settings models, then a walk of the result), 25 ms a submit
here (2026-12-05), for a context that does not change during a flow run: Prefect makes a new
``SettingsContext`` (``temporary_settings``, a profile switch) rather than changing one.
:func:`cached_settings_serialize` keeps the last few results, each under the context object, its
``settings`` and ``profile`` objects (all three the very same ones, or it serializes anew), and
hands out a deep copy (0.2 ms).

The worker's side builds the ``SettingsContext`` back from that dict for every task run (Prefect's
``hydrated_context``): 28-30 ms here, pydantic-settings building its sources (environment,
``.env``, ``prefect.toml``, ``pyproject.toml``, the profiles file) for each of the 54 nested
models. The dict holds only the settings that were set, so the rest come from the worker's own
environment and files. :func:`cached_settings_context_init` keeps the ``Settings`` built for a
dict under that dict, the process's environment, its working directory and those files' sizes
and modification times (any change builds anew), and hands a deep copy (0.35 ms) to each new
context.

A run whose stack servers died (``infra/watch.py``) is stopped; Prefect's clients then retried
the dead servers as the run ended: the final flow-run state ~20 s (``_send_with_retry``'s
backoff), the result write to S3 ~7 s (a trial). :func:`install` also makes them try once while
:func:`paperline.infra.watch.down_reason` says the server is gone: the sync and async HTTP
clients' ``_send_with_retry`` send the request once, and (:func:`install_result_write_check`)
the ``S3Bucket`` block's write fails at once. A log batch the server did not take is said in one
line of its own (:func:`one_line_log_batch_failure`; Prefect's ``--- Error logging to API ---``
had no line end and glued the next line onto it).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import os
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path, PurePath
from typing import Any

_INSTALLED: dict[str, Any] = {"done": False, "original": None, "original_settings_serialize": None,
                              "original_settings_context_init": None}
_HYDRATED: dict[tuple[Any, ...], Any] = {}  # a settings dict (and what else it depends on) -> Settings
_HYDRATED_LOCK = threading.Lock()
SETTINGS_CACHE_SIZE = 8  # contexts whose serialization is kept (a flow run uses one)
_SETTINGS_CACHE: dict[tuple[int, bool], tuple[Any, Any, Any, dict[str, Any]]] = {}
_SETTINGS_LOCK = threading.Lock()


@functools.cache
def secret_fields(block_cls: type) -> tuple[str, ...]:
    """The ``secret_fields`` entry of ``block_cls.model_json_schema()`` (dotted paths, ``*``
    wildcards), computed once per class."""
    return tuple(block_cls.model_json_schema().get("secret_fields", []))


def field_has_secrets(block: Any, field_name: str) -> bool:
    """Whether ``field_name`` of ``block`` holds a secret: the rules of Prefect 3.9's
    ``Block._field_has_secrets`` (an exact match, a nested ``field.x`` path, or ``field.*``), on
    the cached :func:`secret_fields`."""
    for secret in secret_fields(type(block)):
        if secret == field_name or secret.startswith(f"{field_name}."):
            return True
        if secret.endswith(".*") and secret[:-2] == field_name:
            return True
    return False


def cached_settings_serialize(self: Any, include_secrets: bool = True) -> dict[str, Any]:
    """``SettingsContext.serialize`` (Prefect's own, the first time), answered from a cache while
    the context, its ``settings`` and its ``profile`` are the same objects: a deep copy of the
    dict Prefect's method made for them (``include_secrets`` kept apart)."""
    key = (id(self), bool(include_secrets))
    with _SETTINGS_LOCK:
        hit = _SETTINGS_CACHE.get(key)
    if hit is not None and hit[0] is self and hit[1] is self.settings and hit[2] is self.profile:
        return copy.deepcopy(hit[3])
    value = _INSTALLED["original_settings_serialize"](self, include_secrets=include_secrets)
    with _SETTINGS_LOCK:
        if len(_SETTINGS_CACHE) >= SETTINGS_CACHE_SIZE:
            _SETTINGS_CACHE.pop(next(iter(_SETTINGS_CACHE)))  # the oldest (dicts keep insertion order)
        _SETTINGS_CACHE[key] = (self, self.settings, self.profile, value)
    return copy.deepcopy(value)


def _settings_files() -> tuple[Any, ...]:
    """Size and modification time of each file pydantic-settings reads Prefect's settings from
    besides the environment (None where there is none)."""
    home = Path(os.environ.get("PREFECT_HOME", "~/.prefect")).expanduser()
    paths = (Path(".env"), Path("prefect.toml"), Path("pyproject.toml"),
             Path(os.environ.get("PREFECT_PROFILES_PATH", home / "profiles.toml")).expanduser())
    stamps: list[Any] = []
    for path in paths:
        try:
            st = path.stat()
            stamps.append((st.st_size, st.st_mtime_ns))
        except OSError:
            stamps.append(None)
    return tuple(stamps)


def _key_part(value: Any) -> Any:
    """JSON for the values a serialized settings dict holds besides JSON's own (``timedelta``,
    ``set``, paths); anything else (a secret's object among them) is not keyed."""
    if isinstance(value, timedelta):
        return ["timedelta", value.days, value.seconds, value.microseconds]
    if isinstance(value, (set, frozenset)):
        return ["set", sorted(json.dumps(x, sort_keys=True, default=_key_part) for x in value)]
    if isinstance(value, PurePath):
        return ["path", str(value)]
    raise TypeError(f"not keyed: {type(value).__name__}")


def hydration_key(settings: dict[str, Any]) -> tuple[Any, ...] | None:
    """What a ``Settings`` built from ``settings`` (a serialized context's dict) depends on: the
    dict, the environment, the working directory and the settings files; None when the dict
    cannot be written as JSON (it is then built as Prefect does)."""
    try:
        text = json.dumps(settings, sort_keys=True, default=_key_part)
        cwd = os.getcwd()
    except (TypeError, ValueError, OSError):
        return None
    return text, tuple(sorted(os.environ.items())), cwd, _settings_files()


def cached_settings_context_init(self: Any, **data: Any) -> None:
    """``SettingsContext.__init__`` (Prefect's own), its ``settings`` dict, if it is one, built
    once per :func:`hydration_key`: a later context with the same key gets a deep copy of the
    ``Settings`` built then."""
    init = _INSTALLED["original_settings_context_init"]
    settings = data.get("settings")
    key = hydration_key(settings) if isinstance(settings, dict) else None
    if key is None:
        return init(self, **data)
    with _HYDRATED_LOCK:
        built = _HYDRATED.get(key)
    if built is not None:
        return init(self, **{**data, "settings": built.model_copy(deep=True)})
    init(self, **data)
    with _HYDRATED_LOCK:
        if len(_HYDRATED) >= SETTINGS_CACHE_SIZE:
            _HYDRATED.pop(next(iter(_HYDRATED)))
        _HYDRATED[key] = self.settings.model_copy(deep=True)
    return None


def once_when_down(original: Any) -> Any:
    """Prefect's sync ``_send_with_retry``, sending once while the Prefect server is known gone."""

    @functools.wraps(original)
    def send_with_retry(self: Any, request: Any, send: Any, send_args: Any, send_kwargs: Any, *args: Any,
                        **kwargs: Any) -> Any:
        from paperline.infra.watch import down_reason  # noqa: PLC0415

        if (why := down_reason("prefect")) is not None:
            with _saying_why(why):
                return send(request, *send_args, **send_kwargs)
        return original(self, request, send, send_args, send_kwargs, *args, **kwargs)

    return send_with_retry


def once_when_down_async(original: Any) -> Any:
    """Prefect's async ``_send_with_retry``, sending once while the Prefect server is known gone."""

    @functools.wraps(original)
    async def send_with_retry(self: Any, request: Any, send: Any, send_args: Any, send_kwargs: Any, *args: Any,
                              **kwargs: Any) -> Any:
        from paperline.infra.watch import down_reason  # noqa: PLC0415

        if (why := down_reason("prefect")) is not None:
            with _saying_why(why):
                return await send(request, *send_args, **send_kwargs)
        return await original(self, request, send, send_args, send_kwargs, *args, **kwargs)

    return send_with_retry


@contextlib.contextmanager
def _saying_why(why: str) -> Iterator[None]:
    """A connection error inside says why the Prefect server is gone (``why``, from the server
    watch): a served run whose Prefect server was killed ended on a bare "ConnectError('[Errno
    111] Connection refused')" (a trial). The error keeps its type (Prefect's callers catch it)."""
    import httpx  # noqa: PLC0415

    try:
        yield
    except httpx.TransportError as exc:
        exc.args = (f"{exc.args[0] if exc.args else exc} (prefect: {why})", *exc.args[1:])
        raise


def failing_when_down(original: Any) -> Any:
    """``S3Bucket._write_sync`` (Prefect's result writes), failing at once while S3 is known gone."""

    @functools.wraps(original)
    def write(self: Any, key: str, data: bytes) -> None:
        from paperline.infra.watch import down_reason  # noqa: PLC0415

        if (why := down_reason("s3")) is not None:
            from paperline.infra.errors import ServiceError  # noqa: PLC0415

            raise ServiceError("s3", f"write s3://{self.bucket_name}/{key}: {why}")
        return original(self, key, data)

    return write


LOG_BATCH_QUIET_S = 600.0  # a failed log batch is said at most this often per process
_LOG_BATCH_SAID = {"at": -float("inf")}


def one_line_log_batch_failure(original: Any) -> Any:
    """``APILogWorker._handle_batch`` saying a batch its server did not take in one line of its own,
    at most every :data:`LOG_BATCH_QUIET_S` seconds per process, and nothing while the run's watch
    knows the server is gone (the run's error says so). Prefect wrote ``--- Error logging to API
    ---`` and the error without a line end, so the next line (a results table's title) was glued
    onto it, from the flow's process and every worker (trials)."""

    @functools.wraps(original)
    async def handle_batch(self: Any, items: list[bytes]) -> None:
        import logging  # noqa: PLC0415
        import sys  # noqa: PLC0415
        import time  # noqa: PLC0415

        from paperline.infra.watch import down_reason  # noqa: PLC0415

        try:
            await self._client.request("POST", "/logs/", content=b"[" + b",".join(items) + b"]",
                                       headers={"Content-Type": "application/json"})
        except Exception as exc:  # noqa: BLE001 - as Prefect's own: a log batch lost is not the run's failure
            now = time.monotonic()
            if logging.raiseExceptions and sys.stderr and down_reason("prefect") is None \
                    and now - _LOG_BATCH_SAID["at"] >= LOG_BATCH_QUIET_S:
                _LOG_BATCH_SAID["at"] = now
                sys.stderr.write(f"paperline: the Prefect server did not take a batch of {len(items)} log line(s) "
                                 f"({type(exc).__name__}: {exc}); they are missing from its UI (the next failures "
                                 f"for {LOG_BATCH_QUIET_S / 60:g} minutes are not shown)\n")

    return handle_batch


def install() -> None:
    """Route ``prefect.blocks.core.Block._field_has_secrets`` through :func:`field_has_secrets`,
    ``prefect.context.SettingsContext.serialize`` through :func:`cached_settings_serialize` and its
    ``__init__`` through :func:`cached_settings_context_init`, Prefect's HTTP clients' retries
    through :func:`once_when_down` and :func:`once_when_down_async`, its log worker's batches
    through :func:`one_line_log_batch_failure`, and a flow run's suspension observer's polls
    through :func:`install_suspension_check_through_outages` (idempotent; a Prefect without the
    first two methods keeps its own)."""
    if _INSTALLED["done"]:
        return
    from prefect.blocks.core import Block  # noqa: PLC0415 - kernels and light imports never load Prefect
    from prefect.context import SettingsContext  # noqa: PLC0415

    original = getattr(Block, "_field_has_secrets", None)
    if original is not None:
        _INSTALLED["original"] = original
        Block._field_has_secrets = field_has_secrets  # type: ignore[method-assign]
    serialize = SettingsContext.__dict__.get("serialize")
    if serialize is not None:
        _INSTALLED["original_settings_serialize"] = serialize
        SettingsContext.serialize = cached_settings_serialize  # type: ignore[method-assign]
    _INSTALLED["original_settings_context_init"] = SettingsContext.__init__
    SettingsContext.__init__ = cached_settings_context_init  # type: ignore[method-assign]
    from prefect.client.base import PrefectHttpxAsyncClient, PrefectHttpxSyncClient  # noqa: PLC0415

    PrefectHttpxSyncClient._send_with_retry = once_when_down(PrefectHttpxSyncClient._send_with_retry)  # type: ignore[method-assign]
    PrefectHttpxAsyncClient._send_with_retry = once_when_down_async(  # type: ignore[method-assign]
        PrefectHttpxAsyncClient._send_with_retry)
    from prefect.logging.handlers import APILogWorker  # noqa: PLC0415

    APILogWorker._handle_batch = one_line_log_batch_failure(APILogWorker._handle_batch)  # type: ignore[method-assign]
    with contextlib.suppress(ImportError, AttributeError):  # (Prefect's internals moved: its own behaviour)
        install_suspension_check_through_outages()
    _INSTALLED["done"] = True


def install_result_write_check() -> None:
    """Route ``prefect_aws.S3Bucket._write_sync`` through :func:`failing_when_down` (idempotent).
    Called when a run's watch finds a server gone rather than by :func:`install`: importing
    ``prefect_aws`` costs 0.4 s, and a run has loaded it (its result storage) by then."""
    from prefect_aws import S3Bucket  # noqa: PLC0415

    if not getattr(S3Bucket._write_sync, "_paperline_checked", False):
        checked = failing_when_down(S3Bucket._write_sync)
        checked._paperline_checked = True  # type: ignore[attr-defined]
        S3Bucket._write_sync = checked  # type: ignore[method-assign]


def install_suspension_check_through_outages() -> None:
    """Route ``FlowRunSuspendingObserver._check_for_suspended_flow_runs`` through
    :func:`quiet_while_prefect_down` (idempotent; by :func:`install`, as a flow's modules load:
    the engine enters the observer, taking the method, before the flow's function runs). The
    observer, which polls while its events stream is down, counted each poll to a dead Prefect
    server as a failure and stopped for good after three, printing "Failed the last 3 attempts"
    with two tracebacks and "Suspension polling task failed" (a served run, its Prefect server
    killed: a trial)."""
    from prefect._internal.observers import FlowRunSuspendingObserver  # noqa: PLC0415

    check = FlowRunSuspendingObserver._check_for_suspended_flow_runs
    if not getattr(check, "_paperline_quiet", False):
        FlowRunSuspendingObserver._check_for_suspended_flow_runs = quiet_while_prefect_down(check)  # type: ignore[method-assign]


def quiet_while_prefect_down(original: Any) -> Any:
    """``original`` (an async poll) finding nothing while this process's watch knows the local
    Prefect server is gone (``down_reason("prefect")``) and the poll fails to connect; any other
    error is raised as before."""
    from paperline.infra.watch import down_reason, outage_error  # noqa: PLC0415

    @functools.wraps(original)
    async def poll(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return await original(self, *args, **kwargs)
        except Exception as exc:
            if down_reason("prefect") is None or not outage_error(exc):
                raise
            return None

    poll._paperline_quiet = True  # type: ignore[attr-defined]
    return poll


@contextlib.contextmanager
def served_runs_in_own_process_group() -> Iterator[None]:
    """While inside, Prefect's runner (``prefect.serve``: ``paperline serve``) starts each flow run's
    ``python -m prefect.engine`` process as the leader of a session of its own, as Prefect's process
    worker does (``isolate_process_group``), and stops it by its process group.

    Started in serve's process group, a run and its Dask worker processes received the terminal's
    Ctrl-C with serve: workers still importing printed ~250 lines of ``multiprocessing/spawn.py``
    KeyboardInterrupt tracebacks (a fresh-user trial). Now Ctrl-C reaches serve alone, which stops
    the run it executes (SIGTERM to the run's group, as on Prefect's cancel), and the run ends
    Crashed as before. A Prefect without the starter's option keeps its own behaviour.
    """
    import inspect  # noqa: PLC0415

    from prefect.runner import runner  # noqa: PLC0415 - kernels and light imports never load Prefect

    original = getattr(runner, "EngineCommandStarter", None)
    if original is None or os.name != "posix" or \
            "isolate_process_group" not in inspect.signature(original.__init__).parameters:
        yield
        return
    runner.EngineCommandStarter = functools.partial(original, isolate_process_group=True)  # type: ignore[misc]
    try:
        yield
    finally:
        runner.EngineCommandStarter = original  # type: ignore[misc]


@contextlib.contextmanager
def recording_runner_pauses(record: Callable[[list[str]], None]) -> Iterator[None]:
    """While inside, Prefect's runner (``prefect.serve``), as it stops and pauses the deployments it
    served, first calls ``record`` with the ids (text) of those it finds unpaused: the ones its
    stop pauses, as against those a user paused in the Prefect UI while they were served, which
    the next `paperline serve` keeps paused (it unpaused every one: a trial's pause was undone
    by a restart). A Prefect whose runner lacks the method keeps its own behaviour, unrecorded.
    """
    from prefect.exceptions import ObjectNotFound  # noqa: PLC0415
    from prefect.runner.runner import Runner  # noqa: PLC0415

    original = getattr(Runner, "_pause_schedules", None)
    if original is None:
        yield
        return

    async def _pause_schedules(self: Any) -> None:
        unpaused = []
        for deployment_id in self._deployment_registry.get_deployment_ids():
            try:
                if not (await self._client.read_deployment(deployment_id)).paused:
                    unpaused.append(str(deployment_id))
            except ObjectNotFound:  # deleted meanwhile: nothing to pause or keep paused
                continue
            except Exception:  # noqa: BLE001 - the server gone (`paperline down`), or an error: nothing
                # recorded, and the rest unread (each read's retries added ~10 s to the stop: a trial); the
                # record serve wrote as it started stands, so the next serve unpauses them all, as before it
                await original(self)
                return
        record(unpaused)
        await original(self)

    Runner._pause_schedules = _pause_schedules  # type: ignore[method-assign]
    try:
        yield
    finally:
        Runner._pause_schedules = original  # type: ignore[method-assign]
