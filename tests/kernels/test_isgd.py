"""Inconsistent SGD (kernels/train/isgd.py).

References: the control chart against a NumPy recomputation of the window mean, population
standard deviation and limit; planted loss spikes; a float64 NumPy simulation of the whole ISGD run
(ordinary SGD steps, SPC decisions, the conservative subproblem's gradient steps) on linear
regression, whose gradients are written out by hand; a plain PyTorch training loop, which ISGD must
match bit for bit while nothing is flagged. Small CPU problems only.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from paperline.kernels.errors import InputError
from paperline.kernels.train.isgd import ISGD, LossControlChart


def np_flags(losses: np.ndarray, window: int, min_history: int, sigmas: float = 3.0) -> list[bool]:
    """Reference SPC decisions: loss t against mean + sigmas * pstd of the <= window losses before it."""
    flags = []
    for t, v in enumerate(losses):
        past = losses[max(0, t - window):t]
        flags.append(bool(past.size >= min_history and v > past.mean() + sigmas * past.std(ddof=0)))
    return flags


# ---------------------------------------------------------------------------------------------------
# the control chart


def test_planted_spikes_are_exactly_the_flagged_batches():
    rng = np.random.default_rng(7)
    losses = rng.normal(1.0, 0.05, 200)
    spikes = [40, 77, 120, 151, 190]
    losses[spikes] += 0.5  # ten standard deviations
    chart = LossControlChart(window=50, min_history=10)
    flagged = [t for t, v in enumerate(losses) if chart.update(float(v))]
    assert flagged == spikes
    assert flagged == [t for t, f in enumerate(np_flags(losses, 50, 10)) if f]
    assert chart.n_flagged == 5
    assert len(chart) == 50
    tail = losses[-50:]
    assert chart.history == tuple(tail)
    assert math.isclose(chart.mean, tail.mean(), rel_tol=1e-12)
    assert math.isclose(chart.std, tail.std(ddof=0), rel_tol=1e-12)
    assert math.isclose(chart.limit, tail.mean() + 3 * tail.std(ddof=0), rel_tol=1e-12)


def test_no_flags_on_a_smoothly_decreasing_loss():
    losses = 0.3 + 2.0 * np.exp(-np.arange(300) / 60.0)
    chart = LossControlChart(window=40, min_history=5)
    assert not any(chart.update(float(v)) for v in losses)
    assert chart.n_flagged == 0
    assert not any(np_flags(losses, 40, 5))


def test_nothing_flagged_before_min_history():
    chart = LossControlChart(window=20, min_history=6)
    assert chart.limit == math.inf and math.isnan(chart.mean) and math.isnan(chart.std)
    for v in [1.0, 1.0, 1.0, 1.0, 1.0, 100.0]:  # the sixth value has only five before it
        assert not chart.update(v)
    assert chart.update(100.0 + 1e3)  # now six are kept: flagged
    assert not chart.update(0.5)


# ---------------------------------------------------------------------------------------------------
# the conservative subproblem, against a NumPy simulation


def regression_batches(n_batches: int = 25, outlier: int = 20, shift: float = 4.0):
    rng = np.random.default_rng(3)
    w_true = rng.normal(size=(5,))
    batches = []
    for t in range(n_batches):
        x = rng.normal(size=(8, 5))
        y = x @ w_true + 0.1 * rng.normal(size=8) + (shift if t == outlier else 0.0)
        batches.append((x, y))
    return batches


def np_isgd(batches, w0, b0, *, lr, lr_sub, window, min_history, stop, epsilon):
    """Float64 reference of ISGD with plain SGD (step ``lr``) on y ~ x @ w + b, MSE loss (mean over the
    batch); the subproblem 1/2 (psi - limit)^2 + epsilon / (2 n_w) ||w - w_before||^2 by gradient
    descent with step ``lr_sub``."""
    w, b = w0.copy(), float(b0)
    n_w = w.size + 1
    history: list[float] = []
    records = []

    def loss_grad(w, b, x, y):
        r = x @ w + b - y
        return float(np.mean(r**2)), 2.0 * x.T @ r / len(y), 2.0 * float(np.mean(r))

    for x, y in batches:
        loss, gw, gb = loss_grad(w, b, x, y)
        past = np.array(history[-window:])
        limit = past.mean() + 3 * past.std(ddof=0) if past.size >= min_history else math.inf
        flagged = loss > limit
        history.append(loss)
        w, b = w - lr * gw, b - lr * gb
        sub = []
        if flagged:
            wb, bb = w.copy(), b
            for k in range(stop + 1):
                cur, gw, gb = loss_grad(w, b, x, y)
                sub.append(cur)
                if cur <= limit or k == stop:
                    break
                chase = cur - limit  # d/dw 1/2 (psi - limit)^2 = (psi - limit) grad psi
                w = w - lr_sub * (chase * gw + epsilon / n_w * (w - wb))
                b = b - lr_sub * (chase * gb + epsilon / n_w * (b - bb))
            distance = math.sqrt(float(np.sum((w - wb) ** 2) + (b - bb) ** 2))
        records.append({"flagged": flagged, "subproblem_losses": sub,
                        "distance": distance if flagged else 0.0})
    return w, b, records


def run_isgd(batches, *, epsilon, stop=4, lr=0.05, lr_sub=0.005, window=10, min_history=5):
    """ISGD on linear regression and its NumPy reference; ``lr_sub`` None: the optimizer's ``lr``.

    The subproblem's step is ``lr_sub * (psi - limit)`` times the loss gradient: with the outlier
    of ``regression_batches()`` (psi - limit ~ 9) the ordinary ``lr = 0.05`` would diverge, hence a
    smaller default ``lr_sub``.
    """
    torch.manual_seed(0)
    model = nn.Linear(5, 1).double()
    w0 = model.weight.detach().numpy().reshape(-1).copy()
    b0 = float(model.bias.detach())
    isgd = ISGD(model, lambda out, y: nn.functional.mse_loss(out.squeeze(1), y),
                torch.optim.SGD(model.parameters(), lr=lr), window=window, min_history=min_history,
                stop=stop, epsilon=epsilon, lr_subproblem=lr_sub)
    records = [isgd.step(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]
    ref_w, ref_b, ref = np_isgd(batches, w0, b0, lr=lr, lr_sub=lr if lr_sub is None else lr_sub,
                                window=window, min_history=min_history, stop=stop, epsilon=epsilon)
    return model, records, (ref_w, ref_b, ref)


@pytest.mark.parametrize("epsilon, lr, lr_sub", [
    (0.0, 0.05, 0.005),
    (600.0, 0.05, 0.005),  # lr_sub * epsilon / n_w = 0.5
    (60.0, 0.01, None),  # the subproblem takes the optimizer's lr
], ids=["eps0", "eps600", "optimizer-lr"])
def test_isgd_matches_numpy_reference(epsilon, lr, lr_sub):
    model, records, (ref_w, ref_b, ref) = run_isgd(regression_batches(), epsilon=epsilon, lr=lr,
                                                   lr_sub=lr_sub)
    assert [r["flagged"] for r in records] == [r["flagged"] for r in ref]
    assert records[20]["flagged"], "the shifted batch must be flagged"
    assert records[20]["extra_steps"] == 4, "the subproblem must take all its steps (none are skipped)"
    for got, want in zip(records, ref):
        assert got["extra_steps"] == max(0, len(want["subproblem_losses"]) - 1)
        np.testing.assert_allclose(got["subproblem_losses"], want["subproblem_losses"], rtol=1e-10)
        assert math.isclose(got["distance"], want["distance"], rel_tol=1e-9, abs_tol=1e-14)
    np.testing.assert_allclose(model.weight.detach().numpy().reshape(-1), ref_w, rtol=1e-10, atol=1e-13)
    assert math.isclose(float(model.bias.detach()), ref_b, rel_tol=1e-10, abs_tol=1e-13)


def test_subproblem_lowers_the_loss_and_epsilon_bounds_the_drift():
    free = run_isgd(regression_batches(), epsilon=0.0)[1][20]
    tight = run_isgd(regression_batches(), epsilon=600.0)[1][20]  # lr_sub * epsilon / n_w = 0.5
    for rec in (free, tight):
        losses = rec["subproblem_losses"]
        assert rec["flagged"] and rec["extra_steps"] == 4
        assert all(b < a for a, b in zip(losses, losses[1:])), losses  # every extra step helps
        assert losses[-1] < 0.8 * losses[0], losses
        # psi - limit shrinks the steps near the limit: a ~9-above-the-limit outlier stays above it
        assert losses[-1] > rec["limit"]
    assert tight["distance"] < 0.75 * free["distance"], (tight["distance"], free["distance"])
    assert tight["subproblem_losses"][-1] > free["subproblem_losses"][-1]


def test_subproblem_stops_once_inside_the_limit():
    # a milder outlier and a step large enough to cross the limit (lr_sub * |grad psi|^2 > 1 near
    # it; smaller steps only approach the limit from above, as 1/2 (psi - limit)^2 flattens there)
    records = run_isgd(regression_batches(shift=3.0), epsilon=0.0, stop=50, lr_sub=0.07)[1]
    rec = records[20]
    assert rec["flagged"]
    losses = rec["subproblem_losses"]
    assert 2 <= rec["extra_steps"] < 50 and len(losses) == rec["extra_steps"] + 1
    assert losses[-1] <= rec["limit"] < min(losses[:-1])
    assert all(b < a for a, b in zip(losses, losses[1:])), losses


# ---------------------------------------------------------------------------------------------------
# nothing flagged: exactly the plain optimizer


def mlp() -> nn.Module:
    torch.manual_seed(11)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 1))


def mlp_batches(n: int = 30):
    g = torch.Generator().manual_seed(5)
    return [(torch.randn(16, 6, generator=g), torch.randn(16, 1, generator=g)) for _ in range(n)]


@pytest.mark.parametrize("make_opt", [
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, weight_decay=1e-4),
    lambda p: torch.optim.Adam(p, lr=1e-2),
], ids=["sgd-momentum", "adam"])
@pytest.mark.parametrize("min_history", [30, 2])
def test_identical_to_plain_optimizer_when_nothing_is_flagged(make_opt, min_history):
    loss_fn = nn.functional.mse_loss
    plain = mlp()
    opt = make_opt(plain.parameters())
    for x, y in mlp_batches():
        opt.zero_grad()
        loss_fn(plain(x), y).backward()
        opt.step()

    model = mlp()
    # min_history 30: the chart never has enough history; 2: it does, and with sigmas this wide
    # nothing is flagged either
    isgd = ISGD(model, loss_fn, make_opt(model.parameters()), window=30, min_history=min_history,
                sigmas=1e6, stop=5, epsilon=1.0)
    records = [isgd.step(x, y) for x, y in mlp_batches()]
    assert not any(r["flagged"] for r in records) and isgd.n_extra_steps == 0
    for p, q in zip(plain.parameters(), model.parameters()):
        assert torch.equal(p, q)


# ---------------------------------------------------------------------------------------------------
# bad input


def test_bad_loss_values():
    chart = LossControlChart(window=5, min_history=2)
    for bad in (math.nan, math.inf, -math.inf, "1.0x", None, True):
        with pytest.raises(InputError, match="loss"):
            chart.update(bad)
    assert len(chart) == 0
    model = mlp()
    isgd = ISGD(model, nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), window=5, min_history=2)
    before = [p.detach().clone() for p in model.parameters()]
    x = torch.full((4, 6), math.nan)
    with pytest.raises(InputError, match="loss"):
        isgd.step(x, torch.zeros(4, 1))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before)), "no step on a NaN loss"
    assert len(isgd.chart) == 0
    with pytest.raises(InputError, match="loss_fn"):
        ISGD(model, lambda out, y: out - y, torch.optim.SGD(model.parameters(), lr=0.1)).step(
            torch.zeros(4, 6), torch.zeros(4, 1))


@pytest.mark.parametrize("kwargs, argument", [
    ({"window": 1}, "window"),
    ({"window": 2.5}, "window"),
    ({"window": 10, "min_history": 11}, "min_history"),
    ({"min_history": 1}, "min_history"),
    ({"sigmas": 0.0}, "sigmas"),
    ({"sigmas": math.nan}, "sigmas"),
    ({"stop": -1}, "stop"),
    ({"epsilon": -0.1}, "epsilon"),
    ({"epsilon": math.inf}, "epsilon"),
    ({"lr_subproblem": 0.0}, "lr_subproblem"),
])
def test_bad_parameters(kwargs, argument):
    model = mlp()
    with pytest.raises(InputError) as err:
        ISGD(model, nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
    assert err.value.argument == argument


def test_bad_components():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with pytest.raises(InputError, match="model"):
        ISGD(lambda x: x, nn.functional.mse_loss, opt)
    with pytest.raises(InputError, match="loss_fn"):
        ISGD(model, "mse", opt)
    with pytest.raises(InputError, match="optimizer"):
        ISGD(model, nn.functional.mse_loss, "sgd")
    frozen = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(InputError, match="no trainable parameters"):
        ISGD(frozen, nn.functional.mse_loss, torch.optim.SGD(frozen.parameters(), lr=0.1))


def test_diverging_subproblem_restores_weights():
    batches = regression_batches(n_batches=21)
    torch.manual_seed(0)
    model = nn.Linear(5, 1).double()
    isgd = ISGD(model, lambda out, y: nn.functional.mse_loss(out.squeeze(1), y),
                torch.optim.SGD(model.parameters(), lr=0.05), window=10, min_history=5, stop=200,
                epsilon=0.0, lr_subproblem=50.0)
    for x, y in batches[:20]:
        isgd.step(torch.from_numpy(x), torch.from_numpy(y))
    x, y = (torch.from_numpy(a) for a in batches[20])
    # w_before: the ordinary SGD step on the outlier, done on a copy
    copy = nn.Linear(5, 1).double()
    copy.load_state_dict(model.state_dict())
    sgd = torch.optim.SGD(copy.parameters(), lr=0.05)
    nn.functional.mse_loss(copy(x).squeeze(1), y).backward()
    sgd.step()
    with pytest.raises(InputError, match="lr_subproblem") as err:
        isgd.step(x, y)
    assert err.value.argument == "lr_subproblem"
    for p, q in zip(model.parameters(), copy.parameters()):
        assert torch.equal(p, q), "weights must be restored to those before the subproblem"


def test_an_optimizer_over_another_models_parameters_is_refused():
    model, other = mlp(), mlp()
    with pytest.raises(InputError, match="not parameters of model") as err:
        ISGD(model, nn.functional.mse_loss, torch.optim.SGD(other.parameters(), lr=0.1))
    assert err.value.argument == "optimizer"
    mixed = torch.optim.SGD([*model.parameters(), next(other.parameters())], lr=0.1)
    with pytest.raises(InputError, match="1 of its"):
        ISGD(model, nn.functional.mse_loss, mixed)
    # a subset of the model's own parameters (the rest frozen) is fine
    first = next(model.parameters())
    assert ISGD(model, nn.functional.mse_loss, torch.optim.SGD([first], lr=0.1)).n_params == first.numel()


def test_non_numeric_losses_are_refused():
    chart = LossControlChart(window=5, min_history=2)
    for bad in ("2", b"2", [1.0], np.bool_(True), torch.tensor([1, 2.0]), torch.tensor(True), np.array(["1"])):
        with pytest.raises(InputError) as err:
            chart.update(bad)
        assert err.value.argument == "loss"
    assert len(chart) == 0
    for good in (1, 1.5, np.float32(2.0), np.int64(3), np.array(4.0), torch.tensor(5.0), torch.tensor([6.0])):
        chart.update(good)
    assert chart.history == (2.0, 3.0, 4.0, 5.0, 6.0)
    assert all(type(v) is float for v in chart.history)


def test_numpy_scalars_are_taken_as_python_numbers():
    model = mlp()
    isgd = ISGD(model, nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1),
                window=np.int64(10), min_history=np.int32(3), sigmas=np.float32(3), stop=np.uint8(2),
                epsilon=np.float32(0.1), lr_subproblem=np.float16(0.5))
    chart = isgd.chart
    assert (chart.window, chart.min_history, chart.sigmas, isgd.stop) == (10, 3, 3.0, 2)
    assert type(chart.window) is int and type(chart.min_history) is int and type(isgd.stop) is int
    assert type(chart.sigmas) is float and isgd.epsilon == 0.1 and isgd.lr_subproblem == 0.5
    for kwargs, argument in (({"window": np.bool_(True)}, "window"), ({"sigmas": np.float32("nan")}, "sigmas"),
                             ({"stop": True}, "stop"), ({"window": np.float64(10.0)}, "window")):
        with pytest.raises(InputError) as err:
            ISGD(model, nn.functional.mse_loss, torch.optim.SGD(model.parameters(), lr=0.1), **kwargs)
        assert err.value.argument == argument
