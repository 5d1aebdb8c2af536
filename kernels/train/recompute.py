"""Cost-aware recomputation (SuperNeurons): drop cheap layers' activations, recompute them in backward.

SuperNeurons [Wang2018]_ observes that the layers of a CNN differ in cost per byte of activation:
convolution and fully-connected layers are compute-heavy, while activation functions, BatchNorm and
pooling (and dropout, reshapes) are cheap to run but produce as many bytes. Its *cost-aware
recomputation* keeps the outputs of the expensive layers as checkpoints and frees what the cheap
layers after each of them would keep for backward; in backward, the cheap layers are recomputed
from the nearest preceding checkpoint. No expensive layer runs twice, so the extra compute is small
while the memory of the cheap layers' activations is gone. ::

    fast = apply_recomputation(model, "cost-aware")   # shares model's parameters and buffers
    peak_activation_bytes(model, x), peak_activation_bytes(fast, x)
    recomputation_plan(model, "cost-aware")           # which layers are checkpointed together

Policies (all three run the same ops on the same values, so outputs and gradients are equal bit for
bit wherever the kernels are deterministic -- on the CPU the tests check it in float64):

==========  =========================================================================================
name        what is done
==========  =========================================================================================
none        the model, unchanged: every layer keeps what its backward needs.
cost-aware  the paper's policy, on the flattened layer sequence (nested plain ``nn.Sequential`` are
            opened; any other module is one layer). Each maximal run of cheap layers (see
            :func:`cheap_layer`) *together with the expensive layer that follows it*, when that
            layer is a plain ``nn.Linear`` / ``nn.Conv{1,2,3}d`` / ``nn.ConvTranspose{1,2,3}d``,
            is one region run under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``;
            a run followed by any other module, or by nothing, is a region on its own; expensive
            layers not preceded by a cheap run run normally.
all         every top-level child of the ``nn.Sequential`` is its own checkpointed region (the
            classic recompute-everything baseline: on a model built of blocks, each block keeps only
            its input and recomputes everything inside, its convolutions included). On a flat
            ``nn.Sequential`` of single layers it saves nothing: each layer then keeps its input, as
            without recomputation, and the checkpoints add their own bookkeeping (measured: 410 kB
            against 263 kB for ``none``, a library trial), so ``deepest_trainable`` can find a
            shallower network under it than under ``none``.
==========  =========================================================================================

What ``cost-aware`` keeps and recomputes, for a chain ``... conv_k -> BN -> ReLU -> pool -> conv_{k+1} ...``
(one region ``[BN, ReLU, pool, conv_{k+1}]``):

* kept across forward -> backward: the region's input, i.e. the output of the expensive layer
  ``conv_k`` (the paper's checkpoint; saved once by the checkpoint), and, as without
  recomputation, what the expensive layers outside regions save (their inputs and weights);
* dropped in forward, recomputed in backward: everything the cheap layers would save (BN's input
  and batch statistics, ReLU's output, pool's indices) and the input of ``conv_{k+1}`` (the pool
  output): the region's backward re-runs BN, ReLU and pool from the kept ``conv_k`` output;
* not recomputed: ``conv_{k+1}`` itself. Its backward needs only its input and weight, which an
  ``aten`` convolution / linear op saves before it runs its kernel, and the non-reentrant checkpoint
  stops the recomputation as soon as the last tensor the region's backward needs has been
  recomputed ("early stop", ``torch.utils.checkpoint.set_checkpoint_early_stop``, on by default).
  So the recomputation never runs an expensive kernel: a training step's matmul/convolution FLOPs
  equal those without recomputation (the tests count them with ``FlopCounterMode``). If a caller
  disables early stop, the tail layer is re-run as well -- correct, just slower. Only modules whose
  forward is a single such op are put at the tail of a region (exact types, not subclasses).

This is the paper's segment (an expensive layer whose output is the checkpoint, then the cheap
layers after it) cut at a different place: a torch checkpoint keeps its *input*, so the region
starts right after the expensive layer (its output is the region's input) and ends with the next
expensive layer, whose input is then recomputed rather than kept. Putting the *preceding* expensive
layer inside the region instead would keep that layer's input and re-run the layer itself in
backward -- the expensive recomputation the paper avoids (that is what ``all`` does per block).

Memory of ``all`` versus ``cost-aware``: ``all`` keeps one tensor per block (its input),
``cost-aware`` one per expensive layer (its output), plus the input of a first expensive layer.
With pooling inside the blocks the block inputs are the smaller tensors and ``all`` keeps less; in
a stack of Conv-BN-ReLU blocks without pooling both keep about the same bytes (in the tests: 18
blocks fit the same budget under either, 9 without recomputation) -- and ``all`` runs every
convolution twice.

BatchNorm under recomputation: ``torch.utils.checkpoint`` re-runs the forward in backward in the
module's current mode, so a BatchNorm in training mode updates its running statistics (and
``num_batches_tracked``) a second time during the recomputation -- checkpoint restores the RNG
state (Dropout masks match) but not module buffers. Here each region's recomputation runs under a
``context_fn`` that swaps every buffer of the region's modules for a private clone and puts the
originals back afterwards, so the recomputation changes no buffer: after forward + backward the
running statistics are exactly those of one ordinary forward. (Outputs are unaffected either way:
in training mode BatchNorm normalizes with the batch statistics.)

Supported structure: an ``nn.Sequential`` at the top; nested plain ``nn.Sequential`` (exact type)
are flattened for ``cost-aware``; any other module (a residual block, a subclass of
``nn.Sequential``) is treated as one opaque layer, expensive unless :func:`cheap_layer` says
otherwise, and is never the tail of a region; ``cost-aware`` then applies itself inside it, to its
direct plain ``nn.Sequential`` children (a residual block's ``body``), on a shallow copy of it. ``apply_recomputation`` returns a new ``nn.Sequential``
whose leaves are the input model's own modules (shared parameters, buffers and train/eval flags);
the input model is not modified. The state-dict keys of the result differ from the input's.

Memory measure: :func:`peak_activation_bytes` counts the bytes of the distinct storages that
autograd keeps for backward at the end of one forward (collected with
``torch.autograd.graph.saved_tensors_hooks``, parameters and buffers excluded). It is the peak of
saved-activation memory *between* forward and backward. It does not count the transient activations
of the one region being recomputed during backward (at most one region's worth, released after that
region's backward), gradients, or optimizer state.

torch is imported lazily (``kernels/`` modules import no backend at module top).

.. [Wang2018] L. Wang, J. Ye, Y. Zhao, W. Wu, A. Li, S. L. Song, Z. Xu, T. Kraska. "SuperNeurons:
   Dynamic GPU Memory Management for Training Deep Neural Networks." PPoPP 2018, pp. 41-53;
   the cost-aware recomputation part. Its reference implementation (github.com/linnanwang/
   superneurons-release, ``src/recompute.cpp``) never frees the output of a checkpoint layer and
   frees, then recomputes from the preceding checkpoint, a checkpoint layer's input that comes from
   a non-checkpoint layer -- the placement of regions above.
"""

from __future__ import annotations

import contextlib
import functools
import numbers
from typing import TYPE_CHECKING, Callable, Iterator, NamedTuple

from paperline.kernels.errors import InputError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "POLICIES",
    "Segment",
    "cheap_layer",
    "recomputation_plan",
    "apply_recomputation",
    "peak_activation_bytes",
    "deepest_trainable",
]

#: the recomputation policies, see the module docstring
POLICIES = ("none", "cost-aware", "all")


class Segment(NamedTuple):
    """One step of a recomputation plan: ``names`` are qualified module names in the input model
    (``model.get_submodule(name)``), run in order; ``recomputed``: run as one checkpointed region."""

    names: tuple[str, ...]
    recomputed: bool


# --------------------------------------------------------------------------------------------------
# Layer classification


@functools.lru_cache(maxsize=1)
def _cheap_types() -> tuple[type, ...]:
    from torch import nn

    names = [
        # activations
        "ReLU", "ReLU6", "LeakyReLU", "PReLU", "RReLU", "ELU", "SELU", "CELU", "GELU", "SiLU", "Mish",
        "Sigmoid", "Tanh", "Hardtanh", "Hardswish", "Hardsigmoid", "Softplus", "Softsign", "Tanhshrink",
        "Softshrink", "Hardshrink", "LogSigmoid", "Threshold", "GLU", "Softmax", "LogSoftmax", "Softmax2d",
        # normalization
        "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "GroupNorm", "LayerNorm",
        "RMSNorm", "InstanceNorm1d", "InstanceNorm2d", "InstanceNorm3d", "LocalResponseNorm",
        # pooling
        "MaxPool1d", "MaxPool2d", "MaxPool3d", "AvgPool1d", "AvgPool2d", "AvgPool3d",
        "AdaptiveMaxPool1d", "AdaptiveMaxPool2d", "AdaptiveMaxPool3d",
        "AdaptiveAvgPool1d", "AdaptiveAvgPool2d", "AdaptiveAvgPool3d", "LPPool1d", "LPPool2d", "LPPool3d",
        # dropout, reshapes, identity
        "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout",
        "Identity", "Flatten", "Unflatten",
    ]
    return tuple(getattr(nn, n) for n in names if hasattr(nn, n))


@functools.lru_cache(maxsize=1)
def _tail_types() -> frozenset[type]:
    """Expensive layers whose forward is one op that saves only its inputs (before its kernel)."""
    from torch import nn

    return frozenset({nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d,
                      nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d})


def cheap_layer(module: "nn.Module") -> bool:
    """Whether ``module`` is a cheap layer in the sense of [Wang2018]_ (recompute, don't keep).

    Cheap: element-wise activations (ReLU, LeakyReLU, GELU, SiLU, Sigmoid, Tanh, Softmax, ...),
    normalization (BatchNorm*, SyncBatchNorm, GroupNorm, LayerNorm, RMSNorm, InstanceNorm*, LRN),
    pooling (Max/Avg/AdaptiveMax/AdaptiveAvg/LP pooling), Dropout variants, Identity, Flatten,
    Unflatten, and their subclasses; a non-empty plain ``nn.Sequential`` whose children are all
    cheap. Everything else (convolutions, linear layers, attention, embeddings, residual blocks,
    unknown modules) is expensive -- unknown means kept, the safe side.

    Args:
        module: a ``torch.nn.Module``.

    Returns:
        True for a cheap layer.

    Raises:
        InputError: ``module`` is not a ``torch.nn.Module``.
    """
    from torch import nn

    if not isinstance(module, nn.Module):
        raise InputError("module", type(module).__name__, "must be a torch.nn.Module")
    if type(module) is nn.Sequential:
        children = list(module.children())
        return bool(children) and all(cheap_layer(c) for c in children)
    return isinstance(module, _cheap_types())


# --------------------------------------------------------------------------------------------------
# Plans and the rewritten model


def _check_policy(policy: object) -> str:
    if not isinstance(policy, str) or policy not in POLICIES:  # a str first: an array would compare elementwise
        raise InputError("policy", policy, f"unknown recomputation policy; known: {', '.join(POLICIES)}")
    return str(policy)  # type: ignore[return-value]


def _flatten(seq: "nn.Sequential", prefix: str = "") -> Iterator[tuple[str, "nn.Module"]]:
    from torch import nn

    for name, child in seq.named_children():
        qualified = prefix + name
        if type(child) is nn.Sequential:
            yield from _flatten(child, qualified + ".")
        else:
            yield qualified, child


def recomputation_plan(model: "nn.Sequential", policy: str = "cost-aware") -> list[Segment]:
    """The layers of ``model`` in run order, grouped into regions as ``policy`` says (module docstring).

    Args:
        model: an ``nn.Sequential`` (nested plain ``nn.Sequential`` are flattened for
            ``"cost-aware"``; ``"none"`` and ``"all"`` list the top-level children).
        policy: one of :data:`POLICIES`.

    Returns:
        A list of :class:`Segment`; their ``names`` concatenated are every layer once, in order.

    Raises:
        InputError: unknown ``policy`` (the message lists the known ones); ``model`` is not an
            ``nn.Sequential``.
    """
    from torch import nn

    policy = _check_policy(policy)
    if not isinstance(model, nn.Sequential):
        raise InputError("model", type(model).__name__,
                         f"policy {policy!r} works on a torch.nn.Sequential (nested blocks are fine)")
    if policy == "none":
        return [Segment((name,), False) for name, _ in model.named_children()]
    if policy == "all":
        return [Segment((name,), True) for name, _ in model.named_children()]
    plan: list[Segment] = []
    run: list[str] = []  # the current maximal run of cheap layers
    for name, layer in _flatten(model):
        if cheap_layer(layer):
            run.append(name)
        elif run and type(layer) in _tail_types():
            plan.append(Segment((*run, name), True))  # cheap run + the expensive layer after it
            run = []
        else:
            if run:
                plan.append(Segment(tuple(run), True))
                run = []
            plan.append(Segment((name,), False))
    if run:
        plan.append(Segment(tuple(run), True))
    return plan


@contextlib.contextmanager
def _private_buffers(body: "nn.Module") -> Iterator[None]:
    """Run the block with clones of its modules' buffers, then put the originals back: a
    recomputation must not update BatchNorm running statistics a second time."""
    swapped = []
    for module in body.modules():
        for name, buf in list(module._buffers.items()):
            if buf is not None:
                swapped.append((module, name, buf))
                module._buffers[name] = buf.clone()
    try:
        yield
    finally:
        for module, name, buf in reversed(swapped):
            module._buffers[name] = buf


@functools.lru_cache(maxsize=1)
def _recompute_cls() -> type:
    import torch
    from torch import nn
    from torch.utils.checkpoint import checkpoint

    class Recompute(nn.Module):
        """``body(x)`` under ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``: keeps
        ``x``, recomputes the rest in backward without touching the body's buffers (see the
        module docstring of paperline.kernels.train.recompute)."""

        def __init__(self, body: nn.Sequential):
            super().__init__()
            self.body = body

        def forward(self, x):
            if not torch.is_grad_enabled():
                return self.body(x)  # nothing is saved for backward: checkpointing is pointless
            body = self.body
            return checkpoint(body, x, use_reentrant=False,
                              context_fn=lambda: (contextlib.nullcontext(), _private_buffers(body)))

    return Recompute


def _inside(layer: "nn.Module", policy: str) -> "nn.Module":
    """``cost-aware`` inside an opaque module (a residual block): a shallow copy of ``layer`` whose
    direct ``nn.Sequential`` children (of 2+ layers, e.g. a block's ``body``) are replaced by their
    recomputed versions, recursively. ``layer`` itself is not changed (the copy has its own child
    table; parameters and buffers are shared). A module without such children is returned as is."""
    import copy

    from torch import nn

    if isinstance(layer, nn.Sequential):
        return layer
    children = {name: child for name, child in layer.named_children()
                if type(child) is nn.Sequential and len(child) >= 2}
    if not children:
        return layer
    twin = copy.copy(layer)
    twin._modules = dict(layer._modules)  # a table of its own: setting a child must not reach ``layer``
    for name, child in children.items():
        twin._modules[name] = apply_recomputation(child, policy)
    return twin


def apply_recomputation(model: "nn.Module", policy: str = "cost-aware") -> "nn.Module":
    """A model computing the same function as ``model``, with activations recomputed per ``policy``.

    See the module docstring for what each policy keeps and recomputes ([Wang2018]_).
    The same ops run on the same values (checkpoint restores the RNG state for the recomputation,
    buffers are protected from a second update), so outputs and gradients equal ``model``'s bit
    for bit where the kernels are deterministic.

    Args:
        model: any ``nn.Module`` for ``"none"``; an ``nn.Sequential`` for the other policies.
        policy: one of :data:`POLICIES`.

    Returns:
        ``"none"``: ``model`` itself. Otherwise a new ``nn.Sequential`` whose leaves are ``model``'s
        own modules (parameters, buffers and train/eval flags shared; ``model`` is not changed),
        checkpointed regions wrapped in a small module with the region as ``.body``.

    Raises:
        InputError: unknown ``policy`` (the message lists the known ones); ``model`` is not an
            ``nn.Module``, or not an ``nn.Sequential`` for a policy other than ``"none"``.
    """
    from torch import nn

    policy = _check_policy(policy)
    if not isinstance(model, nn.Module):
        raise InputError("model", type(model).__name__, "must be a torch.nn.Module")
    if policy == "none":
        return model
    recompute = _recompute_cls()
    parts: list[nn.Module] = []
    for segment in recomputation_plan(model, policy):  # type: ignore[arg-type]
        layers = [model.get_submodule(name) for name in segment.names]
        if segment.recomputed:
            body = nn.Sequential(*layers)
            part = recompute(body)
            body.training = part.training = model.training
            parts.append(part)
        elif policy == "cost-aware":
            parts.extend(_inside(layer, policy) for layer in layers)
        else:
            parts.extend(layers)
    out = nn.Sequential(*parts)
    out.training = model.training  # set the flag only: .train() would reach the shared modules
    return out


# --------------------------------------------------------------------------------------------------
# Measuring


def _as_inputs(example_input: object) -> tuple["torch.Tensor", ...]:
    import torch

    inputs = example_input if isinstance(example_input, (tuple, list)) else (example_input,)
    if not inputs or not all(isinstance(t, torch.Tensor) for t in inputs):
        raise InputError("example_input", type(example_input).__name__,
                         "must be a tensor or a non-empty tuple of tensors (the model's positional inputs)")
    return tuple(inputs)


def _model_inputs(model: object, example_input: object) -> tuple["torch.Tensor", ...]:
    """``example_input`` as a tuple of tensors, once ``model`` is known to be an ``nn.Module``."""
    from torch import nn

    if not isinstance(model, nn.Module):
        raise InputError("model", type(model).__name__, "must be a torch.nn.Module")
    return _as_inputs(example_input)


def _storage_key(t: "torch.Tensor") -> tuple[str, int, int] | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested or other storage-less tensors
        return None
    return (str(t.device), storage.data_ptr(), storage.nbytes())


def peak_activation_bytes(model: "nn.Module", example_input: "torch.Tensor | tuple[torch.Tensor, ...]") -> int:
    """Bytes autograd keeps for backward after one forward of ``model`` (module docstring, "Memory measure").

    Runs ``model(*example_input)`` once with grad enabled, in the model's current train/eval mode,
    under ``torch.autograd.graph.saved_tensors_hooks``, and sums ``untyped_storage().nbytes()`` over
    the distinct storages (by device and ``data_ptr``) of the tensors packed for backward, leaving
    out the model's parameters and buffers (weights are not activations). Inside a checkpointed
    region checkpoint's own hook takes the packs (it keeps no tensor); the region's input is saved
    by checkpoint outside it and is counted. A saved view counts its whole storage. The model's
    input counts when some layer saves it.

    The measurement has no lasting effect: buffers (BatchNorm running statistics) are restored and
    the global RNG states (CPU and the devices used) are forked, the graph is freed.

    Args:
        model: any ``nn.Module`` (e.g. from :func:`apply_recomputation`).
        example_input: a tensor, or a tuple of tensors passed as positional arguments, on the
            model's device.

    Returns:
        Bytes (int) of saved activations at the end of the forward -- the peak of saved-activation
        memory between forward and backward.

    Raises:
        InputError: ``model`` is not an ``nn.Module``; ``example_input`` is not a tensor or a
            non-empty tuple of tensors.
    """
    import torch

    inputs = _model_inputs(model, example_input)
    excluded = {_storage_key(t) for t in (*model.parameters(), *model.buffers())}
    saved: dict[tuple[str, int], int] = {}
    alive: list[torch.Tensor] = []  # hold every packed tensor so no address is reused mid-forward

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage_key(t)
        if key is not None and key not in excluded:
            saved.setdefault(key[:2], key[2])
            alive.append(t)
        return t

    try:
        _forward_packing(model, inputs, pack)
    finally:
        alive.clear()
    return int(sum(saved.values()))


def _forward_packing(model: "nn.Module", inputs: tuple["torch.Tensor", ...],
                     pack: Callable[["torch.Tensor"], "torch.Tensor"]) -> None:
    """One forward of ``model`` with grad, ``pack`` seeing every tensor saved for backward; no
    lasting effect (buffers restored, the RNG states of the CPU and the devices used forked)."""
    import torch

    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    devices = sorted({t.device.index or 0 for t in (*inputs, *model.parameters()) if t.device.type == "cuda"})
    try:
        with torch.random.fork_rng(devices=devices), torch.enable_grad(), \
                torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = model(*inputs)
        del out
    finally:
        with torch.no_grad():
            for buf, copy in buffers:
                buf.copy_(copy)


def saved_tensor_bytes(model: "nn.Module", example_input: "torch.Tensor | tuple[torch.Tensor, ...]") -> int:
    """Bytes of the tensors autograd saves for backward in one forward of ``model``, summed per
    saved tensor: an estimate that runs on torch's ``meta`` device (shapes only: no memory, no
    time, whatever the batch), where storages cannot be told apart.

    Counting a storage once per save, it is at least :func:`peak_activation_bytes` (about 1.6x it
    for the ResNet here) and close to what a CPU training step adds to the process's peak RSS
    (0.9-1.1x measured for ResNets at batch 64-256: backward's transients roughly make up the
    difference). Torch's LSTM on ``meta`` runs a decomposition that saves 2-5x what the CPU kernel
    saves, so for LSTMs it is a loose upper bound. Runs as :func:`peak_activation_bytes` does
    (buffers restored, RNG forked).

    Args:
        model: any ``nn.Module`` (e.g. built under ``torch.device("meta")``, with
            :func:`apply_recomputation`).
        example_input: a tensor, or a tuple of tensors, on the model's device.

    Returns:
        Bytes (int), parameters and buffers included when a layer saves them.

    Raises:
        InputError: ``model`` is not an ``nn.Module``; ``example_input`` is not a tensor or a
            non-empty tuple of tensors.
    """
    import torch

    inputs = _model_inputs(model, example_input)
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        total += t.numel() * t.element_size()
        return t

    _forward_packing(model, inputs, pack)
    return int(total)


def deepest_trainable(
    make_model: Callable[[int], "nn.Module"],
    example_input: "torch.Tensor | tuple[torch.Tensor, ...]",
    budget_bytes: int,
    policy: str,
    max_depth: int = 64,
) -> int:
    """The deepest model that fits an activation-memory budget under ``policy`` ([Wang2018]_'s
    "deeper networks in the same memory" experiment, measured with :func:`peak_activation_bytes`).

    Builds ``apply_recomputation(make_model(d), policy)`` for probe depths ``d`` and measures its
    saved-activation bytes on ``example_input``. Probes ``1, 2, 4, ...`` until a depth does not fit
    (or ``max_depth``), then bisects between the last fitting and the first failing depth, so about
    ``2 log2(answer)`` models are built. Assumes the bytes grow with depth (true for stacked blocks);
    it is not checked.

    Args:
        make_model: ``d -> nn.Module`` for ``d >= 1`` (an ``nn.Sequential`` unless policy ``"none"``).
        example_input: a tensor or a tuple of tensors for the model.
        budget_bytes: memory budget in bytes, an integer >= 1 (Python or NumPy; bools refused).
        policy: one of :data:`POLICIES`.
        max_depth: largest depth tried, an integer >= 1 (Python or NumPy; bools refused).

    Returns:
        The largest ``d`` in ``1..max_depth`` with ``peak_activation_bytes <= budget_bytes``, or 0 when
        even depth 1 does not fit.

    Raises:
        InputError: bad ``budget_bytes``, ``max_depth``, unknown ``policy``, a non-callable
            ``make_model`` or one not returning an ``nn.Module``.
    """
    from torch import nn

    policy = _check_policy(policy)
    # Python or NumPy integers (numbers.Integral), bools refused; used as Python ints
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, numbers.Integral) or budget_bytes < 1:
        raise InputError("budget_bytes", budget_bytes, "must be an integer >= 1 (bytes)")
    if isinstance(max_depth, bool) or not isinstance(max_depth, numbers.Integral) or max_depth < 1:
        raise InputError("max_depth", max_depth, "must be an integer >= 1")
    budget_bytes, max_depth = int(budget_bytes), int(max_depth)
    if not callable(make_model):
        raise InputError("make_model", make_model, "must be callable as make_model(depth) -> nn.Module")
    inputs = _as_inputs(example_input)

    @functools.cache
    def fits(depth: int) -> bool:
        model = make_model(depth)
        if not isinstance(model, nn.Module):
            raise InputError("make_model", type(model).__name__, f"make_model({depth}) must return an nn.Module")
        return peak_activation_bytes(apply_recomputation(model, policy), inputs) <= budget_bytes

    lo, hi, probe = 0, max_depth + 1, 1  # fits(lo) (vacuously for 0), not fits(hi)
    while True:
        if not fits(probe):
            hi = probe
            break
        lo = probe
        if probe == max_depth:
            return lo
        probe = min(2 * probe, max_depth)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid
    return lo
