"""The registry of pipelines the CLI and the deployments can run."""

from __future__ import annotations

import json
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

from pydantic import BaseModel, ValidationError

from paperline.infra.errors import InputError, input_error_from
from paperline.kernels.errors import unknown_name
from paperline.kernels.registry import Registry


@dataclass(frozen=True)
class Pipeline:
    """A runnable pipeline: its flow, its parameter model and named presets."""

    name: str
    flow: Callable[..., Any]
    parameters: type[BaseModel]
    presets: dict[str, dict[str, Any]]
    cron: str | None = None  # the deployment's schedule, UTC (`paperline serve` and prefect.yaml)
    description: str = ""
    # the deployment's parameters (both ways of deploying; "{data_bucket}" is the stack's data bucket)
    deployment_parameters: dict[str, Any] = field(default_factory=dict)

    def deployment_params(self, data_bucket: str) -> dict[str, Any]:
        """:attr:`deployment_parameters` with ``{data_bucket}`` filled in."""
        def fill(v: Any) -> Any:
            if isinstance(v, str):
                return v.replace("{data_bucket}", data_bucket)
            if isinstance(v, dict):
                return {k: fill(x) for k, x in v.items()}
            if isinstance(v, list):
                return [fill(x) for x in v]
            return v

        return fill(self.deployment_parameters)


PIPELINES: Registry[Pipeline] = Registry("pipeline")


# name -> (module, flow, parameter model, deployment cron (UTC), description, deployment parameters);
# a module is imported only when its pipeline is asked for, so `paperline run gemm` does not import
# the NAS or video stacks. prefect.yaml holds the same schedules and parameters (tests/test_layout.py).
_BUILTIN: dict[str, tuple[str, str, str, str, str, dict[str, Any]]] = {
    "tensor-factorization": ("paperline.flows.tensor_factorization", "tensor_factorization",
                             "TensorFactorizationParameters", "0 2 * * *",
                             "P²T²F against TensorLy CP on the bundled real tensors (nightly).", {}),
    "gemm": ("paperline.flows.gemm", "gemm", "GemmParameters", "30 3 * * *",
             "Tiled level-3 BLAS health benchmark: GFLOP/s against NumPy, verified (daily).", {}),
    "nas": ("paperline.flows.nas", "nas", "NasParameters", "0 4 * * 0",
            "NAS campaign: LaMOO on NAS-Bench-201 (weekly, the seeded campaign from scratch: resume=false; "
            "its evaluations come from the task cache), parent/child runs in MLflow.",
            {"params": {"resume": False}}),
    "compressed-training": ("paperline.flows.compressed_training", "compressed_training",
                            "CompressedTrainingParameters", "0 5 * * 6",
                            "Data-parallel training with every gradient compressor against dense (weekly).",
                            {"params": {"compressors": ["none", "fft", "topk", "powersgd", "fp16"]}}),
    "video-curation": ("paperline.flows.video_curation", "video_curation", "VideoCurationParameters", "0 1 * * *",
                       "The videos under s3://<data bucket>/video-curation/incoming/ to WebDataset shards + "
                       "Parquet index, a dataset per night (nightly-<date>) of every video there then: split, "
                       "transcode, filter, dedup.",
                       {"params": {"source": "s3://{data_bucket}/video-curation/incoming/",
                                   "dataset": "nightly-{date}"}}),
}


def _register_builtin(name: str) -> None:
    if name in PIPELINES or name not in _BUILTIN:
        return
    import importlib  # noqa: PLC0415

    module, flow, parameters, cron, description, deployment_parameters = _BUILTIN[name]
    m = importlib.import_module(module)
    PIPELINES.register(name)(Pipeline(name, getattr(m, flow), getattr(m, parameters), m.PRESETS, cron=cron,
                                      description=description, deployment_parameters=deployment_parameters))


def get_pipeline(name: str) -> Pipeline:
    """The pipeline called ``name`` (importing only its module). Raises InputError listing the known ones."""
    _register_builtin(name)
    if name not in PIPELINES:
        raise InputError("pipeline", name, unknown_name("pipeline", name, pipeline_names()))
    return PIPELINES[name]


def pipeline_names() -> list[str]:
    """Every pipeline's name (sorted), without importing any of them."""
    return sorted(set(PIPELINES.names()) | set(_BUILTIN))


def _members(annotation: Any) -> set[Any]:
    """The alternatives of a union annotation (``int | None`` -> ``{int, None}``), else itself."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return set(typing.get_args(annotation))
    return {annotation}


def _is_list(annotation: Any) -> bool:
    """``list[...]``, also inside ``Optional``/``|`` unions (``list[str] | None``)."""
    return any(typing.get_origin(a) is list for a in _members(annotation))


def _numeric_not_bool(annotation: Any) -> bool:
    """``int``/``float`` (also inside ``Optional``) with no ``bool`` alternative: pydantic would
    read ``true`` there as 1 (``q=true`` started a campaign with q = 1)."""
    members = _members(annotation)
    return bool(members & {int, float}) and bool not in members


def _text(annotation: Any) -> bool:
    """``str``, ``list[str]``, or either ``| None``: a name such as ``dataset=2024`` or
    ``campaign=123`` is text there, not the number JSON reads."""
    members = _members(annotation) - {type(None)}
    if len(members) != 1:
        return False
    (member,) = members
    return member is str or (typing.get_origin(member) is list and typing.get_args(member) == (str,))


def _scalar(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class _AsTyped(str):
    """A ``--set`` value shown as typed: ``fps=1e9``, not ``fps='1e9'`` (it was a number, and the
    quotes read as if it had been taken as text)."""

    def __repr__(self) -> str:
        return str(self)


def _json_non_text(raw: str) -> bool:
    """``raw`` parses as JSON other than a string (a number, bool, null, list or object)."""
    try:
        return not isinstance(json.loads(raw), str)
    except json.JSONDecodeError:
        return False


def build_parameters(pipeline: Pipeline, preset: str, overrides: list[str]) -> BaseModel:
    """Parameters from a preset plus ``key=value`` overrides.

    Values are parsed as JSON when they parse (``5``, ``0.1``, ``["a"]``), otherwise taken as
    strings; list-valued parameters also take comma-separated values (``datasets=kinetic,produc``,
    ``ref_point=80,2``) and a single value (``objectives=val_accuracy_pct``).

    Raises:
        InputError: unknown preset, malformed override, unknown parameter or invalid value.
    """
    if preset not in pipeline.presets:
        raise InputError("--preset", preset, unknown_name("preset", preset, sorted(pipeline.presets)))
    values = dict(pipeline.presets[preset])
    fields = pipeline.parameters.model_fields
    given: dict[str, str] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError("--set", item, "expected key=value")
        if key not in fields:  # (rnak: no guess was made: a trial)
            raise InputError("--set", key, unknown_name("parameter", key, list(fields)))
        if key in given:  # the last one silently won
            raise InputError("--set", key, f"given twice ({given[key]!r}, then {raw!r}); give it once")
        given[key] = raw
        annotation = fields[key].annotation
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError as exc:
            if raw.lstrip().startswith(("{", "[")) and not _text(annotation):  # meant as JSON: say what broke
                raise InputError(key, raw, f"not valid JSON ({exc.msg} at character {exc.pos + 1})") from None
            value = raw
        if isinstance(value, bool) and _numeric_not_bool(annotation):
            raise InputError(key, raw, "expected a number, not a boolean")
        if _text(annotation) and isinstance(value, (bool, int, float)):
            value = raw.strip()  # dataset=2024 is a name
        if _is_list(annotation) and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [v.strip() if _text(annotation) else _scalar(v.strip()) for v in str(value).split(",") if v.strip()]
        values[key] = value
    try:
        model = pipeline.parameters.model_validate(values)
    except ValidationError as exc:  # e.g. live.budget, compressors[1] (live.optimizer's checks say it so: a trial)
        error = input_error_from(exc, lambda loc: str(loc[0]) + "".join(f"[{p}]" if isinstance(p, int) else f".{p}"
                                                                        for p in loc[1:]))
        raw = given.get(error.argument)
        if raw is not None and repr(error.value) != raw:  # --set m=null said m=None: the value as typed
            error = InputError(error.argument, _AsTyped(raw) if _json_non_text(raw) else raw, error.problem)
        raise error from None
    # "given" means --set, as it means the parameters of a deployment run: a preset's values count
    # as defaults (gemm refuses a given m that its operand files contradict; `full` sets m)
    model.__pydantic_fields_set__ = set(given)
    return model
