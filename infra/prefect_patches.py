"""One measured workaround for Prefect 3.9's per-submit cost of serializing blocks.

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
"""

from __future__ import annotations

import functools
from typing import Any

_INSTALLED: dict[str, Any] = {"done": False, "original": None}


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


def install() -> None:
    """Route ``prefect.blocks.core.Block._field_has_secrets`` through :func:`field_has_secrets`
    (idempotent; a Prefect without that method is left alone)."""
    if _INSTALLED["done"]:
        return
    from prefect.blocks.core import Block  # noqa: PLC0415 - kernels and light imports never load Prefect

    original = getattr(Block, "_field_has_secrets", None)
    if original is not None:
        _INSTALLED["original"] = original
        Block._field_has_secrets = field_has_secrets  # type: ignore[method-assign]
    _INSTALLED["done"] = True
