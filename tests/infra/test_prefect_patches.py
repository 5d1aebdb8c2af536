"""The cached block secret-field lookup answers exactly as Prefect's own (infra/prefect_patches.py)."""

from __future__ import annotations

import pytest
from prefect.blocks.core import Block
from prefect.utilities.dispatch import get_registry_for_type
from prefect_aws import AwsCredentials, S3Bucket
from pydantic import SecretStr

from paperline.infra import prefect_patches


def _block_classes() -> list[type[Block]]:
    import prefect_aws  # noqa: F401, PLC0415 - registers its blocks

    registry = get_registry_for_type(Block) or {}
    return sorted(set(registry.values()), key=lambda c: c.__name__)


def test_installed_on_prefect_block() -> None:
    prefect_patches.install()
    assert Block._field_has_secrets is prefect_patches.field_has_secrets
    assert prefect_patches._INSTALLED["original"] is not None


@pytest.mark.parametrize("block_cls", _block_classes(), ids=lambda c: c.__name__)
def test_same_answer_as_prefect_for_every_field(block_cls: type[Block]) -> None:
    prefect_patches.install()
    original = prefect_patches._INSTALLED["original"]
    for name in block_cls.model_fields:
        # Prefect's method only calls self.model_json_schema(), a classmethod: the class stands in.
        assert prefect_patches.field_has_secrets(block_cls.model_construct(), name) == original(block_cls, name), name


def test_s3_bucket_secrets_still_rendered_and_hidden() -> None:
    """The serialization the context uses (include_secrets) still reveals the credentials, and the
    default one still masks them: the patch changes the cost, not the result."""
    prefect_patches.install()
    bucket = S3Bucket(bucket_name="b", credentials=AwsCredentials(
        aws_access_key_id="AKIDEXAMPLE", aws_secret_access_key=SecretStr("very-secret")))
    assert prefect_patches.secret_fields(AwsCredentials)  # the secret is declared: the test means something
    revealed = bucket.model_dump(context={"include_secrets": True})
    assert revealed["credentials"]["aws_secret_access_key"] == "very-secret"
    masked = bucket.model_dump(mode="json")
    assert "very-secret" not in str(masked)


def test_settings_serialization_is_prefects_and_follows_a_changed_context() -> None:
    """The cached ``SettingsContext.serialize`` gives Prefect's dict, a copy each time (changing
    one never reaches the next), and a new context (``temporary_settings``) its own values."""
    from prefect.context import SettingsContext
    from prefect.settings import PREFECT_API_URL, temporary_settings

    prefect_patches.install()
    assert SettingsContext.serialize is prefect_patches.cached_settings_serialize
    original = prefect_patches._INSTALLED["original_settings_serialize"]
    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:1111/api"}):
        ctx = SettingsContext.get()
        for secrets in (True, False):
            assert ctx.serialize(include_secrets=secrets) == original(ctx, include_secrets=secrets)
        first = ctx.serialize()
        assert first["settings"]["api"]["url"] == "http://127.0.0.1:1111/api"
        assert prefect_patches._SETTINGS_CACHE[(id(ctx), True)][0] is ctx  # kept: the next call is a copy of it
        first["settings"]["api"]["url"] = "changed"
        assert ctx.serialize()["settings"]["api"]["url"] == "http://127.0.0.1:1111/api"
        with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:2222/api"}):
            assert SettingsContext.get().serialize()["settings"]["api"]["url"] == "http://127.0.0.1:2222/api"
        assert ctx.serialize()["settings"]["api"]["url"] == "http://127.0.0.1:1111/api"
    for _ in range(3 * prefect_patches.SETTINGS_CACHE_SIZE):  # the cache stays bounded
        with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:3333/api"}):
            SettingsContext.get().serialize()
    assert len(prefect_patches._SETTINGS_CACHE) <= prefect_patches.SETTINGS_CACHE_SIZE


def test_settings_context_hydration_is_prefects_and_follows_the_environment(monkeypatch, tmp_path) -> None:
    """A worker builds each task run's ``SettingsContext`` from the submitted dict (28 ms a task
    run here): the cached build equals Prefect's own, is a new object each time, and follows a
    changed environment variable, working directory or ``.env`` file (the dict holds only the
    settings that were set: the rest come from those)."""
    from prefect.context import SettingsContext
    from prefect.settings import PREFECT_API_URL, temporary_settings

    prefect_patches.install()
    assert SettingsContext.__init__ is prefect_patches.cached_settings_context_init
    original = prefect_patches._INSTALLED["original_settings_context_init"]
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("PREFECT_LOGGING_LEVEL", raising=False)

    def prefects(data: dict) -> SettingsContext:
        ctx = SettingsContext.__new__(SettingsContext)
        original(ctx, **data)
        return ctx

    with temporary_settings({PREFECT_API_URL: "http://127.0.0.1:1111/api"}):
        data = SettingsContext.get().serialize(include_secrets=True)
    key = prefect_patches.hydration_key(data["settings"])
    assert key is not None  # (its timedeltas and sets are keyed)
    first, second = SettingsContext(**data), SettingsContext(**data)
    assert key in prefect_patches._HYDRATED
    assert first.settings.model_dump() == second.settings.model_dump() == prefects(data).settings.model_dump()
    assert first.settings is not second.settings and first.settings.api is not second.settings.api
    assert second.settings.api.url == "http://127.0.0.1:1111/api"
    assert second.settings.logging.level != "ERROR"

    monkeypatch.setenv("PREFECT_LOGGING_LEVEL", "ERROR")  # the environment, not the dict, holds it
    assert SettingsContext(**data).settings.logging.level == "ERROR" == prefects(data).settings.logging.level
    monkeypatch.delenv("PREFECT_LOGGING_LEVEL")
    (tmp_path / ".env").write_text("PREFECT_LOGGING_LEVEL=CRITICAL\n")  # a settings file in the directory
    assert SettingsContext(**data).settings.logging.level == "CRITICAL" == prefects(data).settings.logging.level
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert SettingsContext(**data).settings.logging.level == prefects(data).settings.logging.level != "CRITICAL"
    for n in range(3 * prefect_patches.SETTINGS_CACHE_SIZE):  # the cache stays bounded
        monkeypatch.setenv("PAPERLINE_TEST_VARIABLE", str(n))
        SettingsContext(**data)
    assert len(prefect_patches._HYDRATED) <= prefect_patches.SETTINGS_CACHE_SIZE


def test_a_runs_suspension_observer_polls_on_while_its_prefect_server_is_known_gone(monkeypatch) -> None:
    """Its poll to a dead server failed three times and the observer stopped for good ("Failed
    the last 3 attempts ... Suspension polling task failed", a trial): while the watch knows the
    local Prefect server is gone, a failed connection is nothing found; otherwise errors raise."""
    import asyncio

    import httpx
    from prefect._internal.observers import FlowRunSuspendingObserver

    from paperline.infra import watch

    calls: list[str] = []

    async def poll(self, error: BaseException | None) -> str:
        calls.append("polled")
        if error is not None:
            raise error
        return "checked"

    quiet = prefect_patches.quiet_while_prefect_down(poll)
    refused = httpx.ConnectError("All connection attempts failed")
    with pytest.raises(httpx.ConnectError):  # nothing known to be gone: Prefect's own handling
        asyncio.run(quiet(None, refused))
    monkeypatch.setitem(watch._DOWN, "s3", "its server (pid 7) died during the run")
    with pytest.raises(httpx.ConnectError):  # another server gone: not this poll's business
        asyncio.run(quiet(None, refused))
    monkeypatch.setitem(watch._DOWN, "prefect", "its server (pid 8) died during the run")
    assert asyncio.run(quiet(None, refused)) is None
    with pytest.raises(ValueError):
        asyncio.run(quiet(None, ValueError("a fault of its own")))
    assert asyncio.run(quiet(None, None)) == "checked" and len(calls) == 5
    # installed as the flows' tasks load (before the engine enters the observer), once
    import paperline.tasks  # noqa: F401

    installed = FlowRunSuspendingObserver._check_for_suspended_flow_runs
    assert installed._paperline_quiet
    original = installed.__wrapped__
    assert not getattr(original, "_paperline_quiet", False)
    monkeypatch.setattr(FlowRunSuspendingObserver, "_check_for_suspended_flow_runs", original)
    prefect_patches.install_suspension_check_through_outages()
    prefect_patches.install_suspension_check_through_outages()  # idempotent
    again = FlowRunSuspendingObserver._check_for_suspended_flow_runs
    assert again is not original and again.__wrapped__ is original


def test_served_runs_start_in_a_session_of_their_own_only_while_serving():
    """``served_runs_in_own_process_group`` gives the runner's starter Prefect's own
    ``isolate_process_group`` option (as its process worker does), and takes it back after."""
    from prefect.runner import runner

    from paperline.infra.prefect_patches import served_runs_in_own_process_group

    original = runner.EngineCommandStarter
    with served_runs_in_own_process_group():
        assert runner.EngineCommandStarter(entrypoint="x.py:f")._isolate_process_group is True
    assert runner.EngineCommandStarter is original
    assert runner.EngineCommandStarter(entrypoint="x.py:f")._isolate_process_group is False
