"""The registry of pipelines the CLI and the deployments can run."""

from __future__ import annotations

import json
import typing
from dataclasses import dataclass
from typing import Any, Callable

from pydantic import BaseModel, ValidationError

from paperline.infra.errors import InputError
from paperline.kernels.registry import Registry


@dataclass(frozen=True)
class Pipeline:
    """A runnable pipeline: its flow, its parameter model and named presets."""

    name: str
    flow: Callable[..., Any]
    parameters: type[BaseModel]
    presets: dict[str, dict[str, Any]]
    cron: str | None = None  # the deployment's schedule (`paperline serve`)
    description: str = ""


PIPELINES: Registry[Pipeline] = Registry("pipeline")


def _register_builtin() -> None:
    from paperline.flows import compressed_training as ct
    from paperline.flows import gemm as gm
    from paperline.flows import nas
    from paperline.flows import tensor_factorization as tf
    from paperline.flows import video_curation as vc

    if "tensor-factorization" not in PIPELINES:
        PIPELINES.register("tensor-factorization")(
            Pipeline("tensor-factorization", tf.tensor_factorization, tf.TensorFactorizationParameters, tf.PRESETS,
                     cron="0 2 * * *", description="P²T²F against TensorLy CP on the bundled real tensors (nightly)."))
    if "gemm" not in PIPELINES:
        PIPELINES.register("gemm")(Pipeline(
            "gemm", gm.gemm, gm.GemmParameters, gm.PRESETS, cron="30 3 * * *",
            description="Tiled level-3 BLAS health benchmark: GFLOP/s against NumPy, verified (daily)."))
    if "nas" not in PIPELINES:
        PIPELINES.register("nas")(Pipeline(
            "nas", nas.nas, nas.NasParameters, nas.PRESETS, cron="0 4 * * 0",
            description="NAS campaign: LaMOO on NAS-Bench-201 (weekly), resumable, parent/child runs in MLflow."))
    if "compressed-training" not in PIPELINES:
        PIPELINES.register("compressed-training")(Pipeline(
            "compressed-training", ct.compressed_training, ct.CompressedTrainingParameters, ct.PRESETS, cron="0 5 * * 6",
            description="Data-parallel training with FFT-compressed gradients against dense and peers (weekly)."))
    if "video-curation" not in PIPELINES:
        PIPELINES.register("video-curation")(Pipeline(
            "video-curation", vc.video_curation, vc.VideoCurationParameters, vc.PRESETS, cron="0 1 * * *",
            description="Videos to WebDataset shards + Parquet index in S3: split, transcode, filter, dedup (nightly)."))


def get_pipeline(name: str) -> Pipeline:
    """The pipeline called ``name``. Raises InputError listing the known ones."""
    _register_builtin()
    if name not in PIPELINES:
        raise InputError("pipeline", name, f"unknown pipeline; known: {', '.join(PIPELINES.names())}")
    return PIPELINES[name]


def pipeline_names() -> list[str]:
    _register_builtin()
    return PIPELINES.names()


def _is_list(annotation: Any) -> bool:
    """``list[...]``, also inside ``Optional``/``|`` unions (``list[str] | None``)."""
    if typing.get_origin(annotation) is list:
        return True
    return any(typing.get_origin(a) is list for a in typing.get_args(annotation))


def _scalar(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def build_parameters(pipeline: Pipeline, preset: str, overrides: list[str]) -> BaseModel:
    """Parameters from a preset plus ``key=value`` overrides.

    Values are parsed as JSON when they parse (``5``, ``0.1``, ``["a"]``), otherwise taken as
    strings; list-valued parameters also take comma-separated values (``datasets=kinetic,produc``,
    ``ref_point=80,2``) and a single value (``objectives=val_accuracy_pct``).

    Raises:
        InputError: unknown preset, malformed override, unknown parameter or invalid value.
    """
    if preset not in pipeline.presets:
        raise InputError("--preset", preset, f"unknown preset; known: {', '.join(sorted(pipeline.presets))}")
    values = dict(pipeline.presets[preset])
    fields = pipeline.parameters.model_fields
    for item in overrides:
        key, sep, raw = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise InputError("--set", item, "expected key=value")
        if key not in fields:
            raise InputError("--set", key, f"unknown parameter; known: {', '.join(fields)}")
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        if _is_list(fields[key].annotation) and isinstance(value, (str, int, float)) and not isinstance(value, bool):
            value = [_scalar(v.strip()) for v in str(value).split(",") if v.strip()]
        values[key] = value
    try:
        return pipeline.parameters.model_validate(values)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = err["loc"]
        where = str(loc[0]) + "".join(f"[{p}]" for p in loc[1:])
        raise InputError(where, err.get("input"), err["msg"]) from None
