"""Inconsistent Stochastic Gradient Descent: train harder on the batches the model has under-learnt.

ISGD [Wang2017]_ watches the per-batch training loss with Statistical Process Control (SPC, a
Shewhart chart) and gives a batch whose loss is unusually high extra, conservative updates::

    isgd = ISGD(model, torch.nn.functional.cross_entropy, torch.optim.SGD(model.parameters(), lr=0.1,
                momentum=0.9), window=len(loader))      # the paper's window: one epoch of batches
    for x, y in loader:
        info = isgd.step(x, y)     # {"loss", "flagged", "extra_steps", "limit", ...}

Each :meth:`ISGD.step` (the steps are labelled I1-I4 in the code):

    I1. The ordinary step: ``optimizer.zero_grad()``, forward, loss ``psi``, ``backward()``,
        ``optimizer.step()`` -- exactly the operations of a plain training loop, so a run in which
        no batch is flagged gives bit-identical weights to the same loop without ISGD.
    I2. SPC check (:class:`LossControlChart`), on ``psi`` of the forward in I1 (before the update):
        over the last ``window`` batch losses *before* this one (the paper's queue of ``n_b``
        losses), the mean ``psi_bar`` and the population standard deviation ``sigma`` (divisor
        ``n``); the upper control limit is ``limit = psi_bar + 3 sigma`` (``sigmas = 3``). The
        batch is *under-trained* when ``psi > limit``. ``psi`` then enters the window (flagged or
        not). Until ``min_history`` losses have been seen the limit is ``+inf`` and nothing is flagged.
    I3. For a flagged batch, the conservative subproblem on that same batch ``d_t``::

            minimize_w  1/2 (psi_w(d_t) - limit)^2 + epsilon / (2 n_w) * ||w - w_before||_2^2

        (the chasing term pulls the batch loss down to the control limit; the conservative term
        keeps the weights near ``w_before``), where ``n_w`` is the number of trainable scalars and
        ``w_before`` the weights after I1 (before the extra steps). It is solved by at most
        ``stop`` plain gradient-descent steps
        ``w <- w - lr_sub * ((psi - limit) grad psi_w(d_t) + epsilon / n_w * (w - w_before))`` -- no momentum, no
        weight decay, and the optimizer's state (momentum buffers, Adam moments) is not touched.
    I4. Chasing the limit: before each extra step the batch loss is evaluated again, and the
        subproblem stops as soon as ``psi_w(d_t) <= limit`` (the batch is no longer an outlier),
        or after ``stop`` steps. The conservative term keeps the extra steps from dragging the
        weights far away on one batch (larger ``epsilon``: smaller ``||w - w_before||``).

What the paper leaves to an implementation and this module decides: the subproblem is solved by
plain gradient descent with the optimizer's learning rate unless ``lr_subproblem`` is given; the
extra steps are separate from the optimizer (so they never enter momentum); the reference weights
``w_before`` are those after the ordinary step of the same batch; the defaults ``stop = 3``,
``epsilon = 0.1``, ``window = 100``, ``min_history = 10`` are ours (the paper sets the window to the
number of batches in an epoch -- pass ``window=len(loader)`` for that).

Model modes: ISGD never calls ``model.train()`` or ``model.eval()``; it runs the model in whatever
mode the caller set (``model.train()`` for training, as usual). The extra forward passes of I3/I4
run in that mode too, so BatchNorm running statistics are updated on each of them and Dropout draws
fresh masks -- as they would be for any other extra iteration on the batch.

Units: losses are whatever ``loss_fn`` returns (a scalar tensor, read back as a Python float); the
learning rates are the optimizer's. torch is imported lazily (``kernels/`` modules import no
backend at module top). Works on any device: everything the kernel allocates lives on the
parameters' device; reading the loss back (``float(loss)``) synchronizes once per forward.

.. [Wang2017] L. Wang, Y. Yang, M. R. Min, S. Chakradhar. "Accelerating Deep Neural Network
   Training with Inconsistent Stochastic Gradient Descent." Neural Networks 93, 2017;
   arXiv:1603.05544. The method's description: identifying under-trained batches with SPC, and
   the conservative subproblem solved on them.
"""

from __future__ import annotations

import math
from collections import deque
from typing import TYPE_CHECKING, Any, Callable

from paperline.kernels.errors import InputError, as_float, check_int, is_real

if TYPE_CHECKING:
    import torch

__all__ = ["LossControlChart", "ISGD"]


# --------------------------------------------------------------------------------------------------
# Validation helpers


def _check_real(argument: str, value: object, *, positive: bool) -> float:
    if not is_real(value) or not math.isfinite(float(value)):
        raise InputError(argument, value, "must be a finite real number")
    if positive and not value > 0:
        raise InputError(argument, value, "must be > 0")
    if not positive and not value >= 0:
        raise InputError(argument, value, "must be >= 0")
    return as_float(value)


def _loss_value(loss: object) -> float:
    """``loss`` as a float: a real number (Python or NumPy, not bool) or a one-element
    floating-point array/tensor; anything else (a string, a bool, a list) is refused."""
    if is_real(loss):
        return float(loss)
    shape, dtype = getattr(loss, "shape", None), getattr(loss, "dtype", None)
    if shape is not None and dtype is not None and math.prod(shape) == 1:
        # a NumPy array (dtype.kind "f") or a torch tensor (dtype.is_floating_point)
        if getattr(dtype, "kind", None) == "f" or getattr(dtype, "is_floating_point", False) is True:
            return float(loss)
    raise InputError("loss", loss, "must be a real number (a Python or NumPy float, or a one-element "
                                   "floating-point tensor)")


# --------------------------------------------------------------------------------------------------
# SPC monitor


class LossControlChart:
    """Shewhart control chart on the per-batch training loss ([Wang2017]_; step I2 above).

    Keeps the last ``window`` losses (a ``collections.deque``). :meth:`update` compares a new loss
    with the upper control limit of the losses seen *before* it, then appends it.

    Args:
        window: number of past losses kept (the paper's ``n_b``, one epoch of batches), an integer
            >= 2 (Python or NumPy).
        min_history: losses needed before anything can be flagged, an integer in ``[2, window]``;
            with fewer the limit is ``+inf``.
        sigmas: width of the control band in standard deviations (the paper's 3), a finite real
            > 0 (Python or NumPy; bools refused).

    Attributes:
        mean: mean of the kept losses (``nan`` when empty).
        std: their population standard deviation, divisor ``n`` (``nan`` when empty).
        limit: ``mean + sigmas * std`` once ``min_history`` losses are kept, else ``+inf``.
        n_flagged: how many :meth:`update` calls returned True.
        history: the kept losses, oldest first (a tuple copy).

    Raises:
        InputError: bad ``window``, ``min_history`` or ``sigmas``.
    """

    def __init__(self, window: int = 100, *, min_history: int = 10, sigmas: float = 3.0):
        self.window = check_int("window", window, 2)
        self.min_history = check_int("min_history", min_history, 2, self.window)
        self.sigmas = _check_real("sigmas", sigmas, positive=True)
        self._losses: deque[float] = deque(maxlen=self.window)
        self.n_flagged = 0

    def __len__(self) -> int:
        return len(self._losses)

    @property
    def history(self) -> tuple[float, ...]:
        """The kept losses, oldest first (a tuple copy; at most ``window``)."""
        return tuple(self._losses)

    @property
    def mean(self) -> float:
        """Mean of the kept losses, the chart's centre line ``psi_bar`` (``nan`` when none
        are kept)."""
        n = len(self._losses)
        return math.fsum(self._losses) / n if n else math.nan

    @property
    def std(self) -> float:
        """Population standard deviation ``sigma`` of the kept losses, divisor ``n``
        (``nan`` when none are kept)."""
        n = len(self._losses)
        if not n:
            return math.nan
        mean = self.mean
        return math.sqrt(math.fsum((v - mean) ** 2 for v in self._losses) / n)

    @property
    def limit(self) -> float:
        """The upper control limit ``mean + sigmas * std`` of the kept losses (the paper's
        ``psi_bar + 3 sigma``), in the losses' units; ``+inf`` while fewer than ``min_history`` are
        kept, so that nothing is flagged.

        Source: [Wang2017]_, the SPC check of under-trained batches (step I2 of the module
        docstring).
        """
        if len(self._losses) < self.min_history:
            return math.inf
        return self.mean + self.sigmas * self.std

    def load(self, history: Any, n_flagged: int = 0) -> None:
        """Restore a chart's kept losses (oldest first; the last ``window`` are kept) and flag count,
        e.g. from a checkpoint, so a resumed run flags the same batches as an uninterrupted one."""
        self._losses.clear()
        self._losses.extend(float(v) for v in history)
        self.n_flagged = int(n_flagged)

    def update(self, loss: float) -> bool:
        """Record one batch loss; True when it is above the limit of the losses before it.

        Args:
            loss: the batch's training loss, a finite real: a Python or NumPy int/float, or a
                one-element floating-point array or tensor (read with ``float()``). Strings and
                bools are refused.

        Returns:
            True when ``loss > limit`` computed over the kept losses before this one (never True
            before ``min_history`` losses are kept). The loss is appended either way.

        Raises:
            InputError: ``loss`` is not a real number (e.g. the string ``"2"``), or is NaN or inf;
                nothing is recorded.
        """
        value = _loss_value(loss)
        if not math.isfinite(value):
            raise InputError("loss", value, "must be finite: the batch loss is NaN or inf (diverged training?)")
        flagged = value > self.limit
        self._losses.append(value)
        self.n_flagged += flagged
        return flagged


# --------------------------------------------------------------------------------------------------
# ISGD


class ISGD:
    """Inconsistent SGD around any model, loss and optimizer ([Wang2017]_; steps I1-I4 above).

    Args:
        model: any ``torch.nn.Module`` (any device; its mode is left as the caller set it).
        loss_fn: ``loss_fn(model(inputs), targets)`` -> a scalar (one-element) floating tensor.
        optimizer: a ``torch.optim.Optimizer`` over the model's trainable parameters (SGD with
            momentum in the paper; any optimizer works for the ordinary step I1). It may hold a
            subset of them (the rest stay frozen) but no parameter that is not ``model``'s.
        window: losses kept by the control chart (the paper: batches per epoch), >= 2.
        min_history: losses needed before a batch can be flagged, in ``[2, window]``.
        sigmas: control-band width in standard deviations (3 in the paper), > 0.
        stop: most extra gradient steps per flagged batch, >= 0 (0: monitor only).
        epsilon: weight of the conservative term ``epsilon / (2 n_w) ||w - w_before||^2``, >= 0.
        lr_subproblem: step size of the extra steps, > 0; None: the optimizer's first parameter
            group's current ``lr`` (read at every flagged step, so schedulers are followed).

        The integers (``window``, ``min_history``, ``stop``) and reals (``sigmas``, ``epsilon``,
        ``lr_subproblem``) may be Python or NumPy scalars; bools are refused.

    Attributes:
        chart: the :class:`LossControlChart`.
        n_extra_steps: extra steps taken so far, over all flagged batches.

    Raises:
        InputError: a wrong type for ``model``, ``loss_fn`` or ``optimizer``, an optimizer with no
            trainable parameters or with a trainable parameter that is not one of ``model``'s
            (e.g. built over another model's parameters: ISGD would train nothing), or a bad
            number (see each argument).
    """

    def __init__(
        self,
        model: "torch.nn.Module",
        loss_fn: Callable[..., "torch.Tensor"],
        optimizer: "torch.optim.Optimizer",
        *,
        window: int = 100,
        min_history: int = 10,
        sigmas: float = 3.0,
        stop: int = 3,
        epsilon: float = 0.1,
        lr_subproblem: float | None = None,
    ):
        import torch

        if not isinstance(model, torch.nn.Module):
            raise InputError("model", type(model).__name__, "must be a torch.nn.Module")
        if not callable(loss_fn):
            raise InputError("loss_fn", loss_fn, "must be callable as loss_fn(outputs, targets)")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InputError("optimizer", type(optimizer).__name__, "must be a torch.optim.Optimizer")
        self.model, self.loss_fn, self.optimizer = model, loss_fn, optimizer
        self.chart = LossControlChart(window, min_history=min_history, sigmas=sigmas)
        self.stop = check_int("stop", stop, 0)
        self.epsilon = _check_real("epsilon", epsilon, positive=False)
        self.lr_subproblem = (
            None if lr_subproblem is None else _check_real("lr_subproblem", lr_subproblem, positive=True)
        )
        seen: set[int] = set()
        self._params: list[torch.Tensor] = []
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    self._params.append(p)
        if not self._params:
            raise InputError("optimizer", type(optimizer).__name__, "has no trainable parameters")
        own = {id(p) for p in model.parameters()}
        foreign = [p for p in self._params if id(p) not in own]
        if foreign:
            raise InputError(
                "optimizer", type(optimizer).__name__,
                f"{len(foreign)} of its {len(self._params)} trainable parameters (the first of shape "
                f"{tuple(foreign[0].shape)}) are not parameters of model: the ordinary and the extra steps "
                "would not train the model; build it over model.parameters()",
            )
        self.n_params = sum(p.numel() for p in self._params)  # the paper's n_w
        self.n_extra_steps = 0

    def _loss(self, inputs: Any, targets: Any) -> "torch.Tensor":
        import torch

        loss = self.loss_fn(self.model(inputs), targets)
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1 or not loss.is_floating_point():
            shown = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
            raise InputError("loss_fn", shown, "must return a one-element floating-point tensor")
        return loss.reshape(())

    def step(self, inputs: Any, targets: Any) -> dict[str, Any]:
        """One ISGD iteration on the batch ``(inputs, targets)`` (steps I1-I4 of the module docstring).

        Args:
            inputs: whatever ``model`` takes (a tensor of shape ``(batch, ...)`` on the model's device).
            targets: whatever ``loss_fn`` takes as its second argument.

        Returns:
            A dict: ``loss`` (float, the batch loss of the ordinary step's forward, before its
            update), ``flagged`` (bool, under-trained), ``extra_steps`` (int, gradient steps of the
            subproblem, ``0..stop``), ``limit`` (float, the control limit the loss was compared with;
            ``inf`` before ``min_history`` losses), ``subproblem_losses`` (list of floats: the batch
            loss evaluated before each extra step and once after the last; empty when not
            flagged or ``stop == 0``), ``distance`` (float, ``||w - w_before||_2`` over all
            trainable parameters after the subproblem; 0.0 when there was none).

        Raises:
            InputError: ``loss_fn`` returned something other than a one-element float tensor, or
                the batch loss is NaN/inf (then no optimizer step is taken and the chart is
                unchanged); ``lr_subproblem`` (argument name) when an extra step made the batch loss
                non-finite (the weights are restored to ``w_before`` first).
        """
        # I1 (forward) + I2: the ordinary forward, the SPC decision on its loss
        self.optimizer.zero_grad()
        loss = self._loss(inputs, targets)
        value = float(loss.detach())
        limit = self.chart.limit
        flagged = self.chart.update(value)  # InputError on NaN/inf, before any update
        # I1: the ordinary update, the same calls as a plain training loop
        loss.backward()
        self.optimizer.step()
        result: dict[str, Any] = {
            "loss": value, "flagged": flagged, "extra_steps": 0, "limit": limit,
            "subproblem_losses": [], "distance": 0.0,
        }
        if flagged and self.stop > 0:
            extra, losses, distance = self._subproblem(inputs, targets, limit)
            result.update(extra_steps=extra, subproblem_losses=losses, distance=distance)
        return result

    def _subproblem(self, inputs: Any, targets: Any, limit: float) -> tuple[int, list[float], float]:
        """I3 + I4: at most ``stop`` gradient steps on the conservative objective, chasing ``limit``."""
        import torch

        lr = self.lr_subproblem
        if lr is None:
            lr = float(self.optimizer.param_groups[0]["lr"])
        coef = self.epsilon / self.n_params  # d/dw of epsilon/(2 n_w) ||w - w_before||^2 = coef (w - w_before)
        params = self._params
        w_before = [p.detach().clone() for p in params]
        losses: list[float] = []
        extra = 0
        for k in range(self.stop + 1):
            last = k == self.stop
            with torch.set_grad_enabled(not last):  # the final evaluation needs no graph
                loss = self._loss(inputs, targets)
            value = float(loss.detach())
            losses.append(value)
            if not math.isfinite(value):
                with torch.no_grad():
                    for p, w0 in zip(params, w_before):
                        p.copy_(w0)
                raise InputError(
                    "lr_subproblem", lr,
                    f"the batch loss became {value} after {extra} extra step(s); weights restored to "
                    "those before the subproblem: use a smaller step",
                )
            if value <= limit or last:  # I4: the batch is back inside the control limit, or out of steps
                break
            grads = torch.autograd.grad(loss, params, allow_unused=True)
            chase = value - limit  # d/dw 1/2 (psi - limit)^2 = (psi - limit) grad psi
            with torch.no_grad():
                for p, g, w0 in zip(params, grads, w_before):
                    direction = (p - w0).mul_(coef)
                    if g is not None:
                        direction.add_(g, alpha=chase)
                    p.sub_(direction.mul_(lr))
            extra += 1
        self.n_extra_steps += extra
        with torch.no_grad():
            sq = sum(float((p - w0).double().pow(2).sum()) for p, w0 in zip(params, w_before))
        return extra, losses, math.sqrt(sq)
