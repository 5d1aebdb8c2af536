"""The models of the compressed-training pipeline: a small ResNet-style CNN and an LSTM on
sequential MNIST (rows as time steps). Both take ``float32 (B, 1, 28, 28)`` images and return
``(B, n_classes)`` logits, and both are ``nn.Sequential`` at the top so that
:func:`paperline.kernels.train.recompute.apply_recomputation` can plan over their layers.
"""

from __future__ import annotations

from typing import Any

from paperline.kernels.errors import InputError, check_int

MODELS = ("resnet", "lstm")

# The most parameters a model may have. The models here classify 28x28 images (MNIST-size data, the
# defaults have 20k-30k parameters); 100M parameters take 1.1 GiB per rank for weights, gradients
# and SGD momentum (12 bytes each in float32), and about twice that with DDP's gradient buckets
# and a compressor's memory (error-feedback residuals) -- per rank, with every rank of a local
# cluster on the same machine -- and hours per epoch on a CPU. Checked arithmetically from the
# options (:func:`parameter_count`) before anything is allocated: a huge option is refused at once,
# instead of the build growing the process's memory for minutes or failing in torch's allocator.
MAX_PARAMETERS = 100_000_000
# The most residual blocks per stage (resnet ``blocks``: 4 convolutions each, over its two stages) or
# LSTM ``layers``. A thin model can be very deep within MAX_PARAMETERS (width=1 would allow a
# million blocks): building it takes minutes (about 2 ms per block, even without
# allocating), every step runs its Python layer by layer, and the activations kept for backward
# grow with depth x width x batch (about 1.5 GB per rank at width 16, 100 blocks, batch 32).
MAX_DEPTH = 100
# float32 weights, their gradients and SGD's momentum buffer: bytes per parameter
TRAINING_BYTES_PER_PARAMETER = 12


SIZE_OPTIONS = {"resnet": {"width": 16, "blocks": 1}, "lstm": {"hidden": 64, "layers": 1}}
OTHER_OPTIONS = {"resnet": ("norm",), "lstm": ()}


def _int(options: dict[str, Any], key: str, default: int) -> int:
    """Option ``key`` as an integer >= 1: a Python or NumPy integer, or a string of one (not a bool
    or a float: JSON's ``true`` and ``2.5`` became width 1 and 2, a trial)."""
    value = options.pop(key, default)
    if isinstance(value, str):
        try:
            value = int(value)
        except ValueError:
            pass
    try:
        return check_int(key, value, 1)
    except InputError as exc:
        raise InputError("model_options", {key: value}, f"{key} {exc.problem}") from None


def _sizes(name: str, options: dict[str, Any]) -> dict[str, int]:
    """The size options of ``name`` (defaults filled in) as ints; ``options`` keeps the rest."""
    if name not in SIZE_OPTIONS:
        raise InputError("model", name, f"unknown model; known: {', '.join(MODELS)}")
    sizes = {key: _int(options, key, default) for key, default in SIZE_OPTIONS[name].items()}
    if options:
        known = ", ".join([*SIZE_OPTIONS[name], *OTHER_OPTIONS[name]])
        raise InputError("model_options", sorted(options),
                         f"{', '.join(map(str, sorted(options)))} unknown for {name}; known: {known}")
    return sizes


def _count(name: str, sizes: dict[str, int], n_classes: int) -> int:
    if name == "resnet":  # conv weights (no bias) + 2 affine parameters per norm channel; see make_model
        w, b = sizes["width"], sizes["blocks"]
        stem = 9 * w + 2 * w
        block_w = 18 * w * w + 4 * w  # two 3x3 convs w -> w and two norms
        transition = 9 * w * 2 * w + 9 * 4 * w * w + 2 * w * w + 3 * 2 * 2 * w  # 3x3 w->2w, 3x3 2w->2w, 1x1 skip
        block_2w = 72 * w * w + 8 * w
        return stem + b * block_w + transition + (b - 1) * block_2w + 2 * w * n_classes + n_classes
    h, layers = sizes["hidden"], sizes["layers"]  # torch's LSTM: 4 gates, input and hidden weights, two biases
    first = 4 * h * 28 + 4 * h * h + 8 * h
    return first + (layers - 1) * (8 * h * h + 8 * h) + h * n_classes + n_classes


def parameter_count(name: str, n_classes: int = 10, **options: Any) -> int:
    """The number of parameters :func:`make_model` would build, computed from the options alone
    (nothing is allocated, so it is instant for any value).

    Raises:
        InputError: unknown name or option, or a non-positive size.
    """
    if name == "resnet":
        options.pop("norm", None)
    return _count(name, _sizes(name, options), n_classes)


def check_model_size(name: str, n_classes: int = 10, **options: Any) -> int:
    """:func:`parameter_count`, refused above :data:`MAX_PARAMETERS`, or a depth (``blocks``,
    ``layers``) above :data:`MAX_DEPTH`; arithmetic only, instant for any value.

    Raises:
        InputError: ``model_options``, naming the size options, the parameter count and its
            training memory, or the depth; or what :func:`parameter_count` raises.
    """
    given = dict(options)
    if name == "resnet":
        given.pop("norm", None)
    sizes = _sizes(name, given)
    count = _count(name, sizes, n_classes)
    if count > MAX_PARAMETERS:
        shown = ", ".join(f"{k}={v}" if v < 10**12 else f"{k}={str(v)[:6]}...({len(str(v))} digits)"
                          for k, v in sizes.items())
        if count < 10**18:
            what = f"{count:,} parameters ({count * TRAINING_BYTES_PER_PARAMETER / 2**30:,.1f} GiB"
        else:
            what = f"more than 10^18 parameters (more than {10**18 * TRAINING_BYTES_PER_PARAMETER // 2**60:,} EiB"
        raise InputError("model_options", options,
                         f"{shown} makes a model of {what} with gradients and optimizer state); at most "
                         f"{MAX_PARAMETERS:,} parameters (MNIST-size models; see paperline.kernels.train.models."
                         "MAX_PARAMETERS)")
    depth = "blocks" if name == "resnet" else "layers"
    if sizes[depth] > MAX_DEPTH:
        raise InputError("model_options", options,
                         f"{depth}={sizes[depth]}: at most {MAX_DEPTH} (building and stepping a deeper model "
                         "takes minutes; see paperline.kernels.train.models.MAX_DEPTH)")
    return count


GROUPS = 4  # GroupNorm's groups in a ``norm="group"`` ResNet (fewer in a layer of fewer channels)


def make_model(name: str, n_classes: int = 10, **options: Any) -> Any:
    """Build a model.

    ``resnet`` (options ``width=16``, ``blocks=1``, ``norm="batch"`` or ``"group"`` for GroupNorm with
    4 groups): conv3x3 -> norm -> ReLU, then ``blocks`` residual
    basic blocks (He et al. 2016) at ``width`` channels, a stride-2 transition to ``2 width``
    channels, ``blocks`` more, global average pooling and a linear head.

    ``lstm`` (options ``hidden=64``, ``layers=1``): each image row is one time step (28 steps of 28
    pixels); the last hidden state feeds a linear head.

    Raises:
        InputError: unknown name or option, a non-positive size, a ``norm="group"`` width whose
            channels :data:`GROUPS` does not divide, or a model of more than
            :data:`MAX_PARAMETERS` parameters (:func:`check_model_size`, before anything is built).
    """
    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    norm_name = options.pop("norm", "batch") if name == "resnet" else "batch"  # an LSTM's is refused below
    if norm_name not in ("batch", "group"):
        raise InputError("model_options", {"norm": norm_name}, "norm must be 'batch' or 'group'")

    def norm(c: int) -> nn.Module:
        return nn.BatchNorm2d(c) if norm_name == "batch" else nn.GroupNorm(min(GROUPS, c), c)

    class BasicBlock(nn.Module):
        def __init__(self, cin: int, cout: int, stride: int = 1):
            super().__init__()
            self.body = nn.Sequential(
                nn.Conv2d(cin, cout, 3, stride, 1, bias=False), norm(cout), nn.ReLU(),
                nn.Conv2d(cout, cout, 3, 1, 1, bias=False), norm(cout))
            self.skip = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
                nn.Conv2d(cin, cout, 1, stride, bias=False), norm(cout))
            self.act = nn.ReLU()

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.act(self.body(x) + self.skip(x))

    class RowLSTM(nn.Module):
        def __init__(self, hidden: int, layers: int):
            super().__init__()
            self.lstm = nn.LSTM(28, hidden, num_layers=layers, batch_first=True)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            out, _ = self.lstm(x.flatten(1, 2))  # (B, 1, 28, 28) -> (B, 28 steps, 28 features)
            return out[:, -1]

    check_model_size(name, n_classes, **options)  # before anything is allocated
    sizes = _sizes(name, options)
    if name == "resnet":
        width, blocks = sizes["width"], sizes["blocks"]
        if norm_name == "group" and any(c % min(GROUPS, c) for c in (width, 2 * width)):  # (torch: "num_channels (6)
            # must be divisible by num_groups (4)"; norm() gives a layer of fewer channels one group per channel)
            raise InputError("model_options", {"norm": "group", "width": width},
                             f"GroupNorm's {GROUPS} groups must divide every layer's channels (width and 2 x width: "
                             f"{width} and {2 * width}): give a width of 1, 2 or a multiple of 4 (norm='batch' "
                             "takes any)")
        layers: list[nn.Module] = [nn.Conv2d(1, width, 3, 1, 1, bias=False), norm(width), nn.ReLU()]
        layers += [BasicBlock(width, width) for _ in range(blocks)]
        layers += [BasicBlock(width, 2 * width, 2)] + [BasicBlock(2 * width, 2 * width) for _ in range(blocks - 1)]
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, n_classes)]
        return nn.Sequential(*layers)
    hidden, depth = sizes["hidden"], sizes["layers"]
    return nn.Sequential(RowLSTM(hidden, depth), nn.Linear(hidden, n_classes))
