"""The models of the compressed-training pipeline: a small ResNet-style CNN and an LSTM on
sequential MNIST (rows as time steps). Both take ``float32 (B, 1, 28, 28)`` images and return
``(B, n_classes)`` logits, and both are ``nn.Sequential`` at the top so that
:func:`paperline.kernels.train.recompute.apply_recomputation` can plan over their layers.
"""

from __future__ import annotations

from typing import Any

from paperline.kernels.errors import InputError

MODELS = ("resnet", "lstm")


def make_model(name: str, n_classes: int = 10, **options: Any) -> Any:
    """Build a model.

    ``resnet`` (options ``width=16``, ``blocks=1``, ``norm="batch"`` or ``"group"`` for GroupNorm with
    4 groups): conv3x3 -> norm -> ReLU, then ``blocks`` residual
    basic blocks (He et al. 2016) at ``width`` channels, a stride-2 transition to ``2 width``
    channels, ``blocks`` more, global average pooling and a linear head.

    ``lstm`` (options ``hidden=64``, ``layers=1``): each image row is one time step (28 steps of 28
    pixels); the last hidden state feeds a linear head.

    Raises:
        InputError: unknown name or option, or a non-positive size.
    """
    import torch  # noqa: PLC0415
    from torch import nn  # noqa: PLC0415

    norm_name = options.pop("norm", "batch")
    if norm_name not in ("batch", "group"):
        raise InputError("model_options", {"norm": norm_name}, "norm must be 'batch' or 'group'")

    def norm(c: int) -> nn.Module:
        return nn.BatchNorm2d(c) if norm_name == "batch" else nn.GroupNorm(min(4, c), c)

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

    if name == "resnet":
        width, blocks = int(options.pop("width", 16)), int(options.pop("blocks", 1))
        if options:
            raise InputError("model_options", sorted(options), "unknown for resnet; known: width, blocks, norm")
        if width < 1 or blocks < 1:
            raise InputError("model_options", {"width": width, "blocks": blocks}, "must be >= 1")
        layers: list[nn.Module] = [nn.Conv2d(1, width, 3, 1, 1, bias=False), norm(width), nn.ReLU()]
        layers += [BasicBlock(width, width) for _ in range(blocks)]
        layers += [BasicBlock(width, 2 * width, 2)] + [BasicBlock(2 * width, 2 * width) for _ in range(blocks - 1)]
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(2 * width, n_classes)]
        return nn.Sequential(*layers)
    if name == "lstm":
        hidden, depth = int(options.pop("hidden", 64)), int(options.pop("layers", 1))
        if options:
            raise InputError("model_options", sorted(options), "unknown for lstm; known: hidden, layers")
        if hidden < 1 or depth < 1:
            raise InputError("model_options", {"hidden": hidden, "layers": depth}, "must be >= 1")
        return nn.Sequential(RowLSTM(hidden, depth), nn.Linear(hidden, n_classes))
    raise InputError("model", name, f"unknown model; known: {', '.join(MODELS)}")
