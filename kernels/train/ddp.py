"""One data-parallel rank of compressed training: torch DDP with a gradient-compressor comm hook
([Wang2018]_ FFT sparsification and its peers, :mod:`paperline.kernels.comm.compressors`),
optional cost-aware recomputation (:mod:`.recompute`), per-rank checkpoints and resume.

:func:`train_rank` is what each rank runs (a Dask task in the flow, a subprocess in the tests): it
joins the process group at ``init_method`` (``tcp://host:port``; gloo on CPU, NCCL on CUDA), builds
the same seeded model on every rank, trains ``epochs`` epochs over its shard of the data and
evaluates on its shard of the test set (counts summed across ranks). After every epoch it hands
its checkpoint (model, optimizer, epoch, history) to ``save_checkpoint``; given ``resume_bytes``
it continues from there.

Security: a checkpoint is read back from the object store, so it is loaded with
``torch.load(weights_only=True)`` (:func:`load_checkpoint`): a planted pickle that would run code
is refused, not unpickled. The rendezvous store of rank 0 listens on ``init_method``'s host only,
and on a loopback host the backend's own sockets stay on loopback too (:func:`process_group`):
torch's ``tcp://`` rendezvous would listen on every interface, without authentication.

NaN/inf handling: after the backward pass (the gradients are then the same on every rank, being
the result of the collective) a step whose loss or any gradient is not finite is skipped on every
rank: no optimizer update, the step is counted in ``skipped_steps`` and its index recorded. It is
never applied silently. A run that diverged fails (:class:`TrainingDiverged`, naming ``lr``) at the
end of the epoch where every step was skipped, or whose mean training loss exceeded
:data:`DIVERGED_LOSS_FACTOR` times a uniform guess's, rather than finishing at chance accuracy.

Units: seconds are wall seconds (``time.perf_counter``); bytes are the compressor's payload bytes
per rank (see :class:`~paperline.kernels.comm.compressors.StepStats`); accuracy in percent.

References:
    .. [Wang2018] L. Wang, W. Wu, J. Zhang, H. Liu, G. Bosilca, M. Herlihy, R. Fonseca. SuperNeurons:
       FFT-based Gradient Sparsification in the Distributed Training of Deep Neural Networks.
       arXiv:1811.08596, 2018 (see :mod:`paperline.kernels.comm.compressors`).
    .. [Wang2017] L. Wang, Y. Yang, M. R. Min, S. Chakradhar. Accelerating Deep Neural Network
       Training with Inconsistent Stochastic Gradient Descent. Neural Networks 93, 2017.
"""

from __future__ import annotations

import contextlib
import io
import math
import numbers
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from paperline.kernels.errors import InputError, as_float


_NUMBER_FIELDS = (  # TrainConfig's numeric fields: (name, kind, None allowed)
    ("n_train", numbers.Integral, True), ("epochs", numbers.Integral, False),
    ("batch_size", numbers.Integral, False), ("lr", numbers.Real, False), ("momentum", numbers.Real, False),
    ("weight_decay", numbers.Real, False), ("seed", numbers.Integral, False),
    ("max_steps_per_epoch", numbers.Integral, True), ("isgd_window", numbers.Integral, True),
    ("isgd_stop", numbers.Integral, False), ("isgd_epsilon", numbers.Real, False), ("isgd_lr", numbers.Real, True),
)


@dataclass(frozen=True)
class TrainConfig:
    """What to train and how (the same on every rank).

    Attributes:
        model, model_options: :func:`paperline.kernels.train.models.make_model` arguments.
        dataset, n_train: :func:`paperline.kernels.train.data.load_dataset` arguments.
        epochs: Epochs to train.
        batch_size: Examples per rank per step.
        lr, momentum, weight_decay: SGD.
        seed: Model initialisation and data order.
        compressor, compressor_options: :func:`~paperline.kernels.comm.compressors.make_hook` arguments.
        recompute: ``none``, ``cost-aware`` or ``all`` (:func:`.recompute.apply_recomputation`).
        max_steps_per_epoch: Stop each epoch after this many steps (None: the whole shard).
        nan_steps: Fault injection for tests and drills: global step indices whose loss is made NaN.
        isgd: Inconsistent SGD [Wang2017]_ (:mod:`.isgd`), made consistent across ranks: the SPC
            chart watches the *global* batch loss (allreduced mean), so every rank flags the same
            batches, and the conservative subproblem's gradient steps go through DDP (and its
            compressor), so the ranks stay identical.
        isgd_window: Losses in the control chart (None: the steps of one epoch, as the paper).
        isgd_stop: Most extra steps on a flagged batch.
        isgd_epsilon: Weight of the conservative term.
        isgd_lr: Step size of the subproblem (None: ``lr``).

    Raises:
        InputError: at construction, ``epochs``, ``batch_size`` or ``max_steps_per_epoch`` < 1, ``lr``
            not > 0 (NaN included), ``isgd_window`` < 2, ``isgd_stop`` < 0, ``isgd_epsilon`` not >= 0,
            ``isgd_lr`` not > 0, or a negative step in ``nan_steps``. Names and options (model,
            dataset, compressor) are checked by :meth:`validate`.
    """

    model: str = "resnet"
    model_options: dict[str, Any] = field(default_factory=dict)
    dataset: str = "mnist-5k"
    n_train: int | None = None
    epochs: int = 2
    batch_size: int = 64
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    seed: int = 0
    compressor: str = "none"
    compressor_options: dict[str, Any] = field(default_factory=dict)
    recompute: str = "none"
    max_steps_per_epoch: int | None = None
    nan_steps: tuple[int, ...] = ()
    isgd: bool = False
    isgd_window: int | None = None
    isgd_stop: int = 3
    isgd_epsilon: float = 0.1
    isgd_lr: float | None = None

    def __post_init__(self) -> None:
        # another type ("2" for epochs) failed a comparison below with a bare TypeError (a review)
        for name, kind, optional in _NUMBER_FIELDS:
            value = getattr(self, name)
            if (value is None and optional) or (isinstance(value, kind) and not isinstance(value, bool)):
                continue
            raise InputError(name, value, f"must be {'an integer' if kind is numbers.Integral else 'a number'}"
                                          + (" or None" if optional else ""))
        if self.epochs < 1:
            raise InputError("epochs", self.epochs, "must be >= 1")
        if self.batch_size < 1:
            raise InputError("batch_size", self.batch_size, "must be >= 1")
        if not self.lr > 0:
            raise InputError("lr", self.lr, "must be positive")
        if self.max_steps_per_epoch is not None and self.max_steps_per_epoch < 1:
            raise InputError("max_steps_per_epoch", self.max_steps_per_epoch, "must be >= 1")
        if self.isgd_window is not None and self.isgd_window < 2:
            raise InputError("isgd_window", self.isgd_window, "must be >= 2")
        if self.isgd_stop < 0:
            raise InputError("isgd_stop", self.isgd_stop, "must be >= 0")
        if not self.isgd_epsilon >= 0:
            raise InputError("isgd_epsilon", self.isgd_epsilon, "must be >= 0")
        if self.isgd_lr is not None and not self.isgd_lr > 0:
            raise InputError("isgd_lr", self.isgd_lr, "must be positive")
        negative = [s for s in self.nan_steps if s < 0]
        if negative:
            raise InputError("nan_steps", list(self.nan_steps), f"global step {negative[0]} is negative: steps "
                                                                 "count from 0")

    def validate(self, model: Any = None, *, check_compresses: bool = True) -> Any:
        """Check names and options before any rank starts: the model's size first, by arithmetic
        (:func:`~paperline.kernels.train.models.check_model_size`), then the model is built on
        torch's ``meta`` device (shapes only, no memory, fast) with its recomputation, and the
        compressor's hook state is checked against it. Loads nothing heavy.

        Args:
            model: A model this configuration built before (another compressor's configuration
                of the same model): reused instead of building it again.
            check_compresses: Also refuse compressor options that compress no gradient of the
                model (PowerSGD's rank).

        Returns:
            The (meta) model, for the next call.

        Raises:
            InputError: naming the argument.
        """
        import torch  # noqa: PLC0415

        from paperline.kernels.comm.compressors import make_hook  # noqa: PLC0415
        from paperline.kernels.train.models import make_model  # noqa: PLC0415
        from paperline.kernels.train.recompute import apply_recomputation  # noqa: PLC0415

        if model is None:
            with torch.device("meta"):
                model = apply_recomputation(make_model(self.model, **dict(self.model_options)), self.recompute)
        state, _ = make_hook(self.compressor, **dict(self.compressor_options))
        if check_compresses:
            state.check_compresses(model.parameters())  # powersgd: a rank too large for the model is dense
        return model

    def as_dict(self) -> dict[str, Any]:
        """The fields as a plain dict (``nan_steps`` as a list): ``TrainConfig(**d)`` rebuilds it."""
        d = asdict(self)
        d["nan_steps"] = list(self.nan_steps)
        return d


# -- rendezvous ------------------------------------------------------------------------------------


def parse_init_method(init_method: str) -> tuple[str, int]:
    """``(host, port)`` of a ``tcp://host:port`` rendezvous (an IPv6 host in brackets:
    ``tcp://[::1]:29500``).

    Only TCP rendezvous is taken: :func:`process_group` binds rank 0's store to that host itself
    (torch's own ``tcp://`` handler binds every interface), and ``env://`` or ``file://`` would
    bypass that.

    Raises:
        InputError: not ``tcp://host:port`` with a port in [1, 65535].
    """
    from urllib.parse import urlsplit  # noqa: PLC0415

    wanted = "expected tcp://host:port (the rendezvous of rank 0)"
    if not isinstance(init_method, str):
        raise InputError("init_method", init_method, wanted)
    try:
        parts = urlsplit(init_method)
        port = parts.port
    except ValueError:
        raise InputError("init_method", init_method, wanted) from None
    if (parts.scheme != "tcp" or not parts.hostname or port is None or not 0 < port < 65536
            or parts.path not in ("", "/") or parts.query or parts.fragment or parts.username):
        raise InputError("init_method", init_method, wanted)
    return parts.hostname, port


def _is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address (127.0.0.0/8, ::1)."""
    import ipaddress  # noqa: PLC0415
    import socket  # noqa: PLC0415

    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except OSError:
        return False
    addrs = {ipaddress.ip_address(info[4][0].split("%", 1)[0]) for info in infos}
    return bool(addrs) and all(a.is_loopback for a in addrs)


def _loopback_interface() -> str:
    """The name of the network interface that holds the loopback address (``lo`` on Linux,
    ``lo0`` on macOS), for ``GLOO_SOCKET_IFNAME``/``NCCL_SOCKET_IFNAME``."""
    import ipaddress  # noqa: PLC0415
    import socket  # noqa: PLC0415

    import psutil  # noqa: PLC0415

    for name, addrs in psutil.net_if_addrs().items():
        for a in addrs:
            if a.family in (socket.AF_INET, socket.AF_INET6):
                with contextlib.suppress(ValueError):
                    if ipaddress.ip_address(a.address.split("%", 1)[0]).is_loopback:
                        return name
    return "lo"


def _listen_socket(host: str, port: int) -> Any:
    """A TCP socket listening on ``host:port`` only (not the wildcard address)."""
    import socket  # noqa: PLC0415

    family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as TCPStore's own server does
        sock.bind(address)
        sock.listen(128)
    except BaseException:
        sock.close()
        raise
    return sock


def _wait_listening(host: str, port: int, timeout_s: float) -> None:
    """Wait until something listens on ``host:port`` (rank 0's store), before torch's client tries.

    A port the OS hands out (a free one, from the ephemeral range) that nothing listens on yet can
    be connected *to itself*: a client retrying ``127.0.0.1:port`` may get ``port`` as its own
    source port, and TCP's simultaneous open then "connects" it to itself. torch's client then
    waited for the store's answer for its whole timeout (300 s in a CI run whose rank 0 started
    late). Such a self-connection is recognised here and dropped; once rank 0 listens the port
    is taken, and the client cannot get it.

    Raises:
        TimeoutError: nothing listened within ``timeout_s`` seconds.
    """
    import socket  # noqa: PLC0415

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host, port), timeout=min(5.0, timeout_s)) as probe:
                if probe.getsockname() != probe.getpeername():
                    return
        except OSError:
            pass
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0's rendezvous at {host}:{port} did not listen within {timeout_s:g} s")
        time.sleep(0.05)


def rendezvous_store(init_method: str, rank: int, world_size: int, timeout_s: float) -> Any:
    """The ``torch.distributed.TCPStore`` of a ``tcp://host:port`` rendezvous: rank 0 serves it
    on ``host:port`` alone, the other ranks connect to it.

    torch's own ``tcp://`` rendezvous (``init_process_group(init_method=...)``) has rank 0's store
    listen on *every* interface (``*:port``), and the store has no authentication: anyone on the
    network could read and write the ranks' keys while they meet. Here rank 0 binds the socket
    itself and hands it over (``master_listen_fd``), so a rendezvous on 127.0.0.1 is reachable
    from this host only, and one on a host's address from that address's network only.

    Raises:
        InputError: ``init_method`` is not ``tcp://host:port``.
        OSError: rank 0 cannot listen on ``host:port`` (e.g. the port was taken meanwhile).
        RuntimeError: (``torch.distributed.DistError``) a rank could not reach rank 0's store
            within ``timeout_s``; TimeoutError: rank 0 did not listen within it.
    """
    import torch.distributed as dist  # noqa: PLC0415

    host, port = parse_init_method(init_method)
    timeout = timedelta(seconds=timeout_s)
    if rank != 0:
        _wait_listening(host, port, timeout_s)
        return dist.TCPStore(host, port, world_size, False, timeout)
    fd = _listen_socket(host, port).detach()  # the store owns the socket from here
    try:
        return dist.TCPStore(host, port, world_size, True, timeout, master_listen_fd=fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)  # not left listening in a long-lived (Dask worker) process
        raise


# Default process groups process_group() has left, with when (time.monotonic()): kept referenced
# until the first time a group is left RETIRE_S or more after them (or the process exits).
_RETIRED: list[tuple[float, Any]] = []
RETIRE_S = 5.0


def _retire(group: Any) -> None:
    """Keep ``group`` (a default process group just destroyed) from being freed for
    :data:`RETIRE_S` seconds, and free those retired longer ago.

    ``destroy_process_group`` unlists the group, but DDP's reducer (in a reference cycle, freed by
    a later pass of Python's cyclic GC) and the comm hook's state still hold it. Freed (by that
    pass) while one of gloo's worker threads was still releasing the last collective, which holds
    Python objects and so waits for the GIL, ``~ProcessGroupGloo`` joined that thread with the GIL
    held: the process hung forever; or the pass ran on that very worker thread, and the join of
    itself aborted the process (``std::system_error: Resource deadlock avoided``). Both happened
    in a loop of in-process trainings, the abort in a full test run (2026-12-05; very likely
    also the CI run of 2026-12-04 that hung at 97%).
    Held here, the group is freed only seconds after its last collective, when its threads are
    idle."""
    now = time.monotonic()
    _RETIRED[:] = [(t, g) for t, g in _RETIRED if now - t < RETIRE_S]
    if group is not None:
        _RETIRED.append((now, group))


@contextlib.contextmanager
def process_group(backend: str, init_method: str, rank: int, world_size: int, *, timeout_s: float = 300.0,
                  device_id: Any = None) -> Iterator[None]:
    """Join the default process group at ``init_method`` (``tcp://host:port``) for the ``with``
    block, and leave it (``destroy_process_group``) at the end, also on an error.

    Nothing listens beyond ``host``: rank 0's store is bound to it (:func:`rendezvous_store`),
    and for a loopback ``host`` (a one-host run) the backend's own sockets are too:
    ``GLOO_SOCKET_IFNAME`` (gloo) or ``NCCL_SOCKET_IFNAME`` (NCCL's bootstrap) names the loopback
    interface while the group exists (restored after), overriding any value of the caller's.
    Without that, gloo listens on the address the host name resolves to and NCCL on its first
    non-loopback interface, open to the network although every rank is on this host. (NCCL reads
    the variable once per process, when it first initializes: a process that ran NCCL before
    keeps its earlier interface.) For another ``host`` (ranks on several hosts), the backend's
    defaults and the caller's variables stand.

    The group left is kept referenced for a few seconds (:func:`_retire`): freed while gloo's
    threads finished its last collective, it hung or aborted the process.

    Args:
        backend: ``gloo`` or ``nccl``.
        init_method: ``tcp://host:port`` of rank 0.
        rank, world_size: This rank and the number of ranks.
        timeout_s: The store's and the collectives' timeout.
        device_id: NCCL: this rank's ``torch.device`` (binds the group to it); None for gloo.

    Raises:
        InputError: ``init_method`` is not ``tcp://host:port``.
        OSError, RuntimeError: see :func:`rendezvous_store`.
    """
    import torch.distributed as dist  # noqa: PLC0415

    host, _ = parse_init_method(init_method)
    env = {}
    if _is_loopback(host):
        env["NCCL_SOCKET_IFNAME" if backend == "nccl" else "GLOO_SOCKET_IFNAME"] = _loopback_interface()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        store = rendezvous_store(init_method, rank, world_size, timeout_s)
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=timedelta(seconds=timeout_s), device_id=device_id)
        try:
            yield
        finally:
            group = dist.group.WORLD
            dist.destroy_process_group()
            _retire(group)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# -- checkpoints -----------------------------------------------------------------------------------


def _plain(value: Any) -> Any:
    """``value`` with NumPy scalars and arrays (at any depth of plain dicts, lists and tuples)
    turned into Python numbers and torch tensors, so the checkpoint loads with
    ``torch.load(weights_only=True)``, which refuses NumPy's types (an epoch record's
    ``np.mean`` left unconverted would make every later resume fail). Tensors and Python scalars
    are kept, and so are dict subclasses: a module's ``state_dict`` (an OrderedDict) keeps its
    ``_metadata``, which ``load_state_dict`` reads."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415

    if type(value) is dict:
        return {_plain(k): _plain(v) for k, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(_plain(v) for v in value)
    if isinstance(value, np.floating):
        return as_float(value)  # np.float32(0.1) -> 0.1, the number written, not 0.10000000149
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return torch.from_numpy(np.array(value))
    return value


def checkpoint_bytes(checkpoint: dict[str, Any]) -> bytes:
    """``checkpoint`` as ``torch.save`` bytes that :func:`load_checkpoint` accepts (NumPy values
    made plain: :func:`_plain`)."""
    import torch  # noqa: PLC0415

    buf = io.BytesIO()
    torch.save(_plain(checkpoint), buf)
    return buf.getvalue()


def load_checkpoint(data: bytes, source: str, map_location: Any = "cpu") -> dict[str, Any]:
    """A checkpoint of :func:`train_rank` from its bytes, loaded with ``weights_only=True``.

    The bytes come from the object store, where anyone who can write the bucket can plant a
    pickle; a full unpickle (``weights_only=False``) would run whatever code it names. The
    restricted unpickler builds only tensors, state dicts and plain Python values, which is all
    a checkpoint holds.

    Args:
        data: The checkpoint's bytes.
        source: Where they came from (an ``s3://`` URI), named in the error.
        map_location: ``torch.load``'s.

    Raises:
        InputError: naming ``source``: the bytes are not a torch checkpoint, or one holding
            objects other than tensors and plain values (possibly code to run on loading).
    """
    import pickle  # noqa: PLC0415
    import re  # noqa: PLC0415

    import torch  # noqa: PLC0415

    way_out = ("; delete it and the run resumes from the epoch before, which every rank checkpointed (or set "
               "another checkpoint_prefix to start over)")
    if not data:
        raise InputError("checkpoint", source, f"not a readable torch checkpoint: it is empty (0 bytes){way_out}")
    # torch.save writes a zip archive (a pickle, 0x80 then the protocol, before torch 1.6): other
    # bytes were read as a pickle and refused as "tampered with" (random bytes), or failed as a
    # bare KeyError that the rank retried three times (text: a trial)
    if not (data.startswith(b"PK\x03\x04") or data[:1] == b"\x80"):
        raise InputError("checkpoint", source, f"not a torch checkpoint (neither a zip archive, as torch.save "
                                               f"writes, nor a pickle): it begins {data[:16]!r}{way_out}")
    try:
        ck = torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        # torch's message is a page of advice (including "load it with weights_only=False"); keep
        # the reason, e.g. "Unsupported global: GLOBAL posix.system was not an allowed global"
        # (never its advice to reload with weights_only=False: a trial found the message ending there)
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        reasons = [line for line in lines if "weights_only" not in line and not line.startswith(
            ("Weights only load failed", "Check the documentation", "Please file an issue"))]
        reason = re.sub(r"^WeightsUnpickler error:\s*", "", reasons[0])[:200] if reasons else \
            "it names objects other than tensors and plain values"
        raise InputError("checkpoint", source,
                         "refused: not loaded, as it holds more than tensors and plain values (tampered with, "
                         f"or not written by train_rank): {reason}{way_out}") from None
    except MemoryError:
        raise
    except Exception as exc:  # noqa: BLE001 - a damaged archive or pickle: RuntimeError, EOFError, KeyError, ...
        if "out of memory" in str(exc).lower():  # (CUDA's, loading to a full device: the file is fine)
            raise
        said = f"{type(exc).__name__}: {exc}" if not isinstance(exc, RuntimeError | EOFError | ValueError | OSError) \
            else str(exc) or type(exc).__name__
        raise InputError("checkpoint", source, f"not a readable torch checkpoint: {said}"[:400] + way_out) from None
    if not isinstance(ck, dict) or not {"model", "optimizer", "epoch", "epochs", "skipped_steps"} <= set(ck):
        raise InputError("checkpoint", source, "not a training checkpoint (expected a dict with model, optimizer, "
                                               f"epoch, epochs and skipped_steps){way_out}")
    return ck


def _all_finite(loss: Any, params: list[Any]) -> bool:
    import torch  # noqa: PLC0415

    if not torch.isfinite(loss.detach()).all():
        return False
    return all(p.grad is None or bool(torch.isfinite(p.grad).all()) for p in params)


def train_rank(rank: int, world_size: int, init_method: str, cfg: TrainConfig, *, device: str = "cpu",
               resume_bytes: bytes | None = None, save_checkpoint: Callable[[int, bytes], None] | None = None,
               timeout_s: float = 300.0, on_epoch: Callable[[dict[str, Any]], None] | None = None,
               threads: int | None = None, exit_at_step: int | None = None,
               collectives_sizes: list[int] | None = None, resume_source: str = "resume_bytes") -> dict[str, Any]:
    """Train one rank to the end (see the module docstring).

    Args:
        rank, world_size: This rank and the number of ranks.
        init_method: ``tcp://host:port`` of the rendezvous (rank 0 listens there, and only there:
            :func:`process_group`).
        cfg: The training configuration (identical on every rank).
        device: ``cpu`` (gloo) or ``cuda`` (NCCL, this rank's current CUDA device).
        resume_bytes: This rank's checkpoint to continue from (from ``save_checkpoint``), loaded
            with ``weights_only=True`` (:func:`load_checkpoint`) before joining the group.
        resume_source: Where ``resume_bytes`` came from (an ``s3://`` URI), named in errors.
        save_checkpoint: Called after every epoch with ``(epoch, bytes)`` (the epoch just finished).
        timeout_s: Collective timeout: a rank whose peer died fails after this long instead of
            hanging (the flow then restarts every rank from the last checkpoint).
        on_epoch: Called on every rank with each epoch's record.
        threads: torch intra-op threads of this rank (None: leave torch's setting).
        collectives_sizes: After training, time Linear Pipelining allreduce against the backend's on
            these message sizes (bytes) in the same process group
            (:func:`paperline.kernels.comm.collectives.allreduce_sweep`); rows in ``"collectives"``.
        exit_at_step: Drill: the process exits (``os._exit(17)``, as a killed rank) when it reaches
            this global step.

    Returns:
        ``{"rank", "world_size", "epochs": [per-epoch records], "skipped_steps": [global step
        indices], "params_count", "dense_bytes_per_step", "config", "restored_memory_buckets"
        (the buckets whose compressor memory, e.g. error-feedback residuals, came back from the
        checkpoint)}``. Epoch records hold
        ``epoch``, ``train_loss`` (mean over ranks and steps), ``test_accuracy_pct``,
        ``bytes_sent_per_step`` (this rank's payload), ``compression_ratio``, ``compress_s`` and
        ``decompress_s`` (per step), ``step_s`` (mean), ``epoch_s``, ``wall_s`` (since the run
        started, resumed epochs included), ``steps`` and ``skipped_steps``.

    Raises:
        InputError: bad configuration, a missing dataset, more ranks than batches, an
            ``init_method`` other than ``tcp://host:port``, or a resume checkpoint refused by
            :func:`load_checkpoint` (naming ``resume_source``). TrainingDiverged (an InputError
            naming ``lr``): an epoch diverged (:func:`_check_diverged`), raised on every rank
            before that epoch's checkpoint.
        RuntimeError: a collective failed (a peer died or timed out).
        OSError: rank 0 could not listen on ``init_method``'s port.
    """
    import gc  # noqa: PLC0415

    import torch  # noqa: PLC0415

    from paperline.kernels.train.data import load_dataset  # noqa: PLC0415

    if not 0 <= rank < world_size:
        raise InputError("rank", rank, f"must be in [0, {world_size})")
    if threads is not None:
        torch.set_num_threads(threads)
    data = load_dataset(cfg.dataset, n_train=cfg.n_train, seed=cfg.seed)
    backend = "nccl" if device == "cuda" else "gloo"
    dev = torch.device(device)
    # before joining: a refused checkpoint fails this rank at once, with no peer waiting on it
    ck = load_checkpoint(resume_bytes, resume_source, map_location=dev) if resume_bytes is not None else None
    # NCCL: bind the group to this rank's GPU, so its barriers and collectives know the device
    # (without it NCCL's barrier guesses one and warns).
    with process_group(backend, init_method, rank, world_size, timeout_s=timeout_s,
                       device_id=torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else None):
        # The DDP module must go before the group does: its Reducer (C++) held the group's last
        # reference when this frame freed the module after destroy_process_group, so the group
        # was destroyed with the GIL held, and its gloo backend joined its worker threads, one of
        # which may be freeing a finished collective's Python-made tensor and so waiting for the
        # GIL: the rank hung for good after its last epoch (gdb; 1 call in ~70 under load). The
        # module lives and dies in _train_in_group (its reference cycles collected below), so the
        # group's last reference is destroy_process_group's Python handle, and torch releases the
        # GIL when a Python handle frees a group.
        try:
            return _train_in_group(rank, world_size, cfg, data, dev, ck, save_checkpoint=save_checkpoint,
                                   on_epoch=on_epoch, exit_at_step=exit_at_step,
                                   collectives_sizes=collectives_sizes)
        finally:
            gc.collect()


def _train_in_group(rank: int, world_size: int, cfg: TrainConfig, data: Any, dev: Any, ck: dict[str, Any] | None, *,
                    save_checkpoint: Callable[[int, bytes], None] | None,
                    on_epoch: Callable[[dict[str, Any]], None] | None, exit_at_step: int | None,
                    collectives_sizes: list[int] | None) -> dict[str, Any]:
    """:func:`train_rank`'s training, in the process group it joined: every object that holds
    the group through DDP lives in this frame alone (see there)."""
    import numpy as np  # noqa: PLC0415
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415
    from torch.nn.parallel import DistributedDataParallel as DDP  # noqa: PLC0415

    from paperline.kernels.comm.compressors import make_hook  # noqa: PLC0415
    from paperline.kernels.train.data import rank_batches  # noqa: PLC0415
    from paperline.kernels.train.models import make_model  # noqa: PLC0415
    from paperline.kernels.train.recompute import apply_recomputation  # noqa: PLC0415

    torch.manual_seed(cfg.seed)
    base = make_model(cfg.model, n_classes=data.n_classes, **dict(cfg.model_options))
    model = apply_recomputation(base, cfg.recompute).to(dev)
    ddp = DDP(model, device_ids=[torch.cuda.current_device()] if dev.type == "cuda" else None)
    state, hook = make_hook(cfg.compressor, **dict(cfg.compressor_options))
    ddp.register_comm_hook(state, hook)
    params = [p for p in ddp.parameters() if p.requires_grad]
    opt = torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    epochs: list[dict[str, Any]] = []
    skipped: list[int] = []
    start_epoch, wall0, restored = 0, 0.0, []
    if ck is not None:
        model.load_state_dict(ck["model"])
        opt.load_state_dict(ck["optimizer"])
        restored = state.load_memory_state(ck.get("compressor_memory") or {}, dev)
        start_epoch, epochs, skipped = ck["epoch"] + 1, ck["epochs"], ck["skipped_steps"]
        wall0 = epochs[-1]["wall_s"] if epochs else 0.0
    x_train, y_train = torch.from_numpy(np.array(data.x_train)), torch.from_numpy(np.array(data.y_train))
    if ck is not None and start_epoch < cfg.epochs and "compressor_step" in ck:
        _prime_buckets(ddp, state, loss_fn=torch.nn.functional.cross_entropy, step=int(ck["compressor_step"]),
                       batch=rank_batches(len(y_train), rank, world_size, cfg.batch_size, start_epoch, cfg.seed)[0],
                       x_train=x_train, y_train=y_train, dev=dev, opt=opt)
    t_run = time.perf_counter() - wall0
    loss_fn = torch.nn.functional.cross_entropy
    chart = None
    n_params = sum(p.numel() for p in params)
    for epoch in range(start_epoch, cfg.epochs):
        t_epoch = time.perf_counter()
        batches = rank_batches(len(y_train), rank, world_size, cfg.batch_size, epoch, cfg.seed)
        if cfg.max_steps_per_epoch is not None:
            batches = batches[: cfg.max_steps_per_epoch]
        n0 = len(state.history)
        losses, step_s, epoch_skipped = [], [], 0
        flagged, extra_steps = 0, 0
        if cfg.isgd and chart is None:
            from paperline.kernels.train.isgd import LossControlChart  # noqa: PLC0415

            window = cfg.isgd_window or max(2, len(batches))
            chart = LossControlChart(window, min_history=min(10, window))
            if ck is not None and ck.get("isgd_chart"):  # the losses it watched before the restart
                chart.load(ck["isgd_chart"]["history"], ck["isgd_chart"]["n_flagged"])
        ddp.train()
        for i, idx in enumerate(batches):
            t0 = time.perf_counter()
            global_step = epoch * len(batches) + i
            if exit_at_step is not None and global_step == exit_at_step:
                import os  # noqa: PLC0415

                os._exit(17)
            x, y = x_train[idx].to(dev), y_train[idx].to(dev)
            opt.zero_grad(set_to_none=True)
            loss = loss_fn(ddp(x), y)
            if global_step in cfg.nan_steps:
                loss = loss * float("nan")
            loss.backward()
            if not _all_finite(loss, params):
                epoch_skipped += 1
                skipped.append(global_step)
                continue
            opt.step()
            losses.append(float(loss.detach()))
            if chart is not None:
                global_loss = _global_mean(float(loss.detach()), world_size, dev)
                limit = chart.limit
                if chart.update(global_loss):
                    flagged += 1
                    extra_steps += _isgd_subproblem(ddp, params, opt, loss_fn, x, y, limit, cfg, n_params,
                                                    world_size)
            step_s.append(time.perf_counter() - t0)
        hist = [s for s in state.history[n0:] if not s.warmup] or state.history[n0:]
        stats = _allreduce_sum([sum(losses), len(losses)], dev)
        _check_diverged(cfg, epoch, len(batches), stats, skipped, data.n_classes)  # the same on every rank
        record = {
            "epoch": epoch, "train_loss": float(stats[0] / stats[1]) if stats[1] else float("nan"),
            "test_accuracy_pct": _evaluate(ddp, data, rank, world_size, dev,
                                           [x_train[idx] for idx in batches[:PRECISE_BN_BATCHES]]),
            "bytes_sent_per_step": float(np.mean([s.bytes_sent for s in hist])) if hist else 0.0,
            "dense_bytes_per_step": float(np.mean([s.dense_bytes for s in hist])) if hist else 0.0,
            "compress_s": float(np.mean([s.compress_seconds for s in hist])) if hist else 0.0,
            "decompress_s": float(np.mean([s.decompress_seconds for s in hist])) if hist else 0.0,
            "step_s": float(np.mean(step_s)) if step_s else float("nan"),
            "epoch_s": time.perf_counter() - t_epoch, "wall_s": time.perf_counter() - t_run,
            "steps": len(batches), "skipped_steps": epoch_skipped,
            "isgd_flagged": flagged, "isgd_extra_steps": extra_steps,
        }
        sent = record["bytes_sent_per_step"]
        record["compression_ratio"] = record["dense_bytes_per_step"] / sent if sent else float("nan")
        epochs.append(record)
        if on_epoch is not None:
            on_epoch(record)
        if save_checkpoint is not None:
            save_checkpoint(epoch, checkpoint_bytes({
                "model": model.state_dict(), "optimizer": opt.state_dict(), "epoch": epoch,
                "compressor_memory": state.memory_state(), "compressor_step": state.step,
                "isgd_chart": {"history": list(chart.history), "n_flagged": chart.n_flagged} if chart else None,
                "epochs": epochs, "skipped_steps": skipped,
                "config": cfg.as_dict(), "rank": rank, "world_size": world_size}))
    sweep = []
    if collectives_sizes:
        from paperline.kernels.comm.collectives import allreduce_sweep  # noqa: PLC0415

        sweep = allreduce_sweep(collectives_sizes, device=dev)
    dist.barrier()
    return {"rank": rank, "world_size": world_size, "epochs": epochs, "skipped_steps": skipped,
            "params_count": sum(p.numel() for p in params), "n_classes": data.n_classes,
            "dense_bytes_per_step": sum(p.numel() * p.element_size() for p in params),
            "config": cfg.as_dict(), "collectives": sweep,
            "restored_memory_buckets": restored}



def _prime_buckets(ddp: Any, state: Any, *, loss_fn: Any, step: int, batch: Any, x_train: Any, y_train: Any,
                   dev: Any, opt: Any) -> None:
    """After a resume, make DDP and the compressor continue exactly where the checkpoint stopped.

    DDP's first iteration uses its initial gradient buckets and rebuilds them, in the order the
    gradients became ready, at the next forward; the compressors' memory (error-feedback residuals,
    PowerSGD's factors) is kept per *rebuilt* bucket, and fft/topk compress each bucket's whole
    buffer. Without this, a restarted rank ran the compressor's dense warm-up steps again (while DDP
    rebuilt its buckets): a perturbation the uninterrupted run never had, which chaotic training
    amplified (seed 2 of the demo: 89.7% resumed against 91.3%).

    Here one throwaway forward/backward on ``batch`` (the compressor still at step 0, so its hook
    sends it dense and touches no memory) lets DDP take its first iteration; the gradients are
    dropped, no optimizer step is taken, and the compressor's step counter (and PowerSGD's
    ``iter``) is set to the checkpoint's ``step``: the next step uses the rebuilt buckets with the
    restored memory, as the uninterrupted run did. Its forward updates BatchNorm's running
    statistics, which training never reads (train mode) and evaluation re-estimates from scratch.
    """
    ddp.train()
    opt.zero_grad(set_to_none=True)
    loss_fn(ddp(x_train[batch].to(dev)), y_train[batch].to(dev)).backward()
    opt.zero_grad(set_to_none=True)
    state.restore_step(step)


class TrainingDiverged(InputError):
    """Training diverged (every step of an epoch non-finite, or a huge loss): an InputError naming
    ``lr``, so the flow stops at once instead of restarting the ranks into the same divergence."""


# An epoch whose mean training loss is above this many times the loss of a uniform guess
# (ln n_classes, 2.3 for 10 classes) has diverged: a network that learns anything is below ln C
# after its first steps, and 100x is far above the transient spikes of a large but stable lr
# (lr=1e6 on the demo gave a mean cross-entropy of 7e15 with `none`, at chance accuracy).
DIVERGED_LOSS_FACTOR = 100.0


def _check_diverged(cfg: TrainConfig, epoch: int, steps: int, stats: list[float], skipped: list[int],
                    n_classes: int) -> None:
    """Stop a diverged run after an epoch: every step skipped as non-finite on every rank (``stats``
    are the loss sum and the count of steps taken, summed over ranks, so every rank decides alike),
    or a mean training loss above :data:`DIVERGED_LOSS_FACTOR` x ln(n_classes). An epoch whose
    steps were all made NaN by ``nan_steps`` (the drill) is not a divergence; a few skipped steps
    never are.

    Raises:
        TrainingDiverged: naming ``lr``.
    """
    total, taken = stats
    first = epoch * steps
    organic = [s for s in skipped if first <= s < first + steps and s not in cfg.nan_steps]
    if not taken and organic:
        raise TrainingDiverged("lr", cfg.lr, f"training diverged: all {steps} steps of epoch {epoch} had non-finite "
                                             "loss or gradients (skipped); the learning rate may be too large")
    uniform = math.log(max(n_classes, 2))
    if taken and not total / taken <= DIVERGED_LOSS_FACTOR * uniform:
        raise TrainingDiverged("lr", cfg.lr, f"training diverged: the mean training loss of epoch {epoch} was "
                                             f"{total / taken:.3g}, more than {DIVERGED_LOSS_FACTOR:g}x a uniform "
                                             f"guess's {uniform:.2f}; the learning rate may be too large")


def _allreduce_sum(values: list[float], dev: Any) -> list[float]:
    """The sums over ranks of a few host numbers, through the process group's backend. The tensor
    lives on ``dev``: NCCL reduces CUDA tensors only ("No backend type associated with device type
    cpu"); gloo takes either."""
    import torch  # noqa: PLC0415
    import torch.distributed as dist  # noqa: PLC0415

    t = torch.tensor(values, dtype=torch.float64, device=dev)
    dist.all_reduce(t)
    return t.tolist()


def _global_mean(value: float, world_size: int, dev: Any) -> float:
    return _allreduce_sum([value], dev)[0] / world_size


def _isgd_subproblem(ddp: Any, params: list[Any], opt: Any, loss_fn: Any, x: Any, y: Any, limit: float,
                     cfg: TrainConfig, n_params: int, world_size: int) -> int:
    """ISGD's conservative subproblem on a flagged batch, the same on every rank (see
    :mod:`paperline.kernels.train.isgd`, I3-I4): at most ``isgd_stop`` steps of
    ``w <- w - lr ((psi - limit) grad psi + eps / n_w (w - w_before))`` where ``psi`` is the global
    (allreduced) batch loss and ``grad psi`` the DDP-averaged gradient; stops once ``psi <= limit``.
    Returns the extra steps taken."""
    import torch  # noqa: PLC0415

    lr = cfg.isgd_lr or cfg.lr
    coef = cfg.isgd_epsilon / n_params
    w_before = [p.detach().clone() for p in params]
    for k in range(cfg.isgd_stop + 1):
        opt.zero_grad(set_to_none=True)
        loss = loss_fn(ddp(x), y)
        loss.backward()  # through DDP: the gradient is the ranks' mean (and goes through the compressor)
        psi = _global_mean(float(loss.detach()), world_size, x.device)
        if psi <= limit or k == cfg.isgd_stop or not _all_finite(loss, params):
            opt.zero_grad(set_to_none=True)
            return k
        with torch.no_grad():
            for p, w0 in zip(params, w_before):
                d = (p - w0).mul_(coef)
                if p.grad is not None:
                    d.add_(p.grad, alpha=psi - limit)
                p.sub_(d.mul_(lr))
    return cfg.isgd_stop


PRECISE_BN_BATCHES = 20


def _recalibrate_batchnorm(model: Any, batches: list[Any], dev: Any) -> None:
    """Re-estimate BatchNorm running statistics as exact averages over ``batches`` (train mode, no
    gradients; "precise BN", Wu & Johnson 2021). The momentum averages lag a network that moves
    fast at small batch sizes: measured here, they swung MNIST-5k test accuracy by 20-30 points
    from one epoch to the next while the training loss fell smoothly."""
    import torch  # noqa: PLC0415

    bns = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    if not bns or not batches:
        return
    momenta = [m.momentum for m in bns]
    for m in bns:
        m.reset_running_stats()
        m.momentum = None  # cumulative average
    model.train()
    with torch.no_grad():
        for x in batches:
            model(x.to(dev))
    for m, mom in zip(bns, momenta):
        m.momentum = mom


def _evaluate(ddp: Any, data: Any, rank: int, world_size: int, dev: Any, calibration: list[Any]) -> float:
    """Test accuracy (percent) over the whole test set: each rank re-estimates its BatchNorm
    statistics on ``calibration`` (its own training batches), scores a contiguous shard of the
    test set, and the counts are summed across ranks."""
    import torch  # noqa: PLC0415

    n = len(data.y_test)
    lo, hi = rank * n // world_size, (rank + 1) * n // world_size
    model = ddp.module
    _recalibrate_batchnorm(model, calibration, dev)
    model.eval()
    correct = 0
    with torch.no_grad():
        for s in range(lo, hi, 512):
            e = min(hi, s + 512)
            x = torch.tensor(data.x_test[s:e], device=dev)  # a copy: the dataset arrays are read-only
            correct += int((model(x).argmax(1).cpu() == torch.tensor(data.y_test[s:e])).sum())
    model.train()
    counts = _allreduce_sum([correct, hi - lo], dev)
    return 100.0 * float(counts[0] / counts[1]) if counts[1] else math.nan
