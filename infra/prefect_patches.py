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
hands out a deep copy (0.2 ms). The worker's side, building the ``SettingsContext`` back from the
dict (about 30 ms, pydantic-settings reading the environment for each nested model), depends on
the worker's environment and is left as Prefect does it.
"""

from __future__ import annotations

import copy
import functools
import threading
from typing import Any

_INSTALLED: dict[str, Any] = {"done": False, "original": None, "original_settings_serialize": None}
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


def install() -> None:
    """Route ``prefect.blocks.core.Block._field_has_secrets`` through :func:`field_has_secrets`
    and ``prefect.context.SettingsContext.serialize`` through :func:`cached_settings_serialize`
    (idempotent; a Prefect without either method keeps its own)."""
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
    _INSTALLED["done"] = True
