"""The live-mnist problem: data split, parameter counts against the built models and hand counts,
a trained network against chance, determinism, latency, options. GPU test: ``pytest -m gpu``."""

import itertools

import numpy as np
import pytest

from paperline.infra.device import gpu_usable
from paperline.kernels.errors import InputError
from paperline.kernels.search.live import CHOICES, SPACE, Arch, build_model, count_params, load_mnist5k
from paperline.kernels.search.problems import make_problem

# a cheap 3-stage residual network (~1 s per evaluation on one core)
SMALL = dict(stages="3", width="4", blocks="1", kernel="3", block="residual", activation="relu", pool="max")


def point(**labels: str) -> np.ndarray:
    return np.array([CHOICES[n].index(labels[n]) for n in CHOICES], dtype=np.float64)


def test_mnist5k_split_is_fixed_stratified_and_scaled():
    x_train, y_train, x_test, y_test = load_mnist5k()
    assert x_train.shape == (4000, 1, 28, 28) and x_test.shape == (1000, 1, 28, 28)
    assert x_train.dtype == np.float32 and y_train.dtype == np.int64
    assert x_train.min() == 0.0 and x_train.max() == 1.0
    np.testing.assert_array_equal(np.bincount(y_train), np.full(10, 400))
    np.testing.assert_array_equal(np.bincount(y_test), np.full(10, 100))
    load_mnist5k.cache_clear()  # a fresh load gives the same split
    np.testing.assert_array_equal(load_mnist5k()[3], y_test)


def test_space_size():
    assert SPACE.size() == 576 == np.prod([len(c) for c in CHOICES.values()])


def test_count_params_matches_every_built_model():
    for cell in itertools.product(*(range(len(c)) for c in CHOICES.values())):
        arch = Arch.from_point(np.array(cell, dtype=np.float64))
        model = build_model(arch)
        assert count_params(arch) == sum(p.numel() for p in model.parameters() if p.requires_grad), arch


def test_count_params_by_hand():
    # stem conv 1->8 3x3 (72) + BN (16); plain block conv 8->8 3x3 (576) + BN (16); fc 8->10 (90)
    assert count_params(Arch(1, 8, 1, 3, "plain", "relu", "max")) == 72 + 16 + 576 + 16 + 90
    # stem 4*9 + 8; stage 0: depthwise 4*9 + 8, pointwise 4*4 + 8; stage 1: transition 4*8 + 16,
    # depthwise 8*9 + 16, pointwise 8*8 + 16; fc 8*10 + 10
    assert count_params(Arch(2, 4, 1, 3, "dwsep", "silu", "avg")) == 44 + 44 + 24 + 48 + 88 + 80 + 90


def test_trained_network_beats_chance_and_is_deterministic():
    import torch

    problem = make_problem("live-mnist")
    x = point(**SMALL)
    threads, rng_state = torch.get_num_threads(), torch.get_rng_state()
    y = problem.evaluate(x, seed=0)
    accuracy_pct, params_count, latency_ms = y
    assert accuracy_pct > 50.0  # chance is 10 %
    assert params_count == count_params(Arch.from_point(x))
    assert np.isfinite(latency_ms) and 0.0 < latency_ms < problem.default_ref_point[2]
    assert torch.get_num_threads() == threads  # restored
    assert torch.equal(torch.get_rng_state(), rng_state)  # the caller's RNG is left alone
    again = problem.evaluate(x, seed=0)
    assert again[0] == accuracy_pct and again[1] == params_count


def test_reference_point_and_description():
    problem = make_problem("live-mnist", epochs=2, threads=2, n_train=1000)
    assert problem.options == {"epochs": 2, "threads": 2, "n_train": 1000}
    assert [o.name for o in problem.objectives] == ["val_accuracy_pct", "params_count", "latency_ms"]
    largest = count_params(Arch(3, 16, 2, 5, "residual", "relu", "max"))
    assert problem.default_ref_point[1] == pytest.approx(1.1 * largest)
    np.testing.assert_array_equal(problem.reference_point(), [0.0, -1.1 * largest, -100.0])
    d = problem.describe(point(**SMALL))
    assert d["block"] == "residual" and d["arch"].startswith("conv3-4 > maxpool > 1xresidual3-4")


@pytest.mark.parametrize("options", [{"epochs": 0}, {"epochs": 1.5}, {"epochs": True}, {"threads": 0},
                                     {"n_train": 50}, {"n_train": 4001}, {"device": "tpu"}])
def test_bad_options_raise(options):
    with pytest.raises(InputError, match=next(iter(options))):
        make_problem("live-mnist", **options)


def test_point_outside_the_space_raises():
    with pytest.raises(InputError):
        make_problem("live-mnist").evaluate(np.full(len(CHOICES), 7.0))


@pytest.mark.skipif(gpu_usable(), reason="a CUDA device is usable here")
def test_cuda_without_gpu_raises():
    with pytest.raises(InputError, match="no usable CUDA device"):
        make_problem("live-mnist", device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not gpu_usable(), reason="no usable CUDA device")
def test_evaluation_on_cuda():
    problem = make_problem("live-mnist", device="cuda")
    x = point(**SMALL)
    accuracy_pct, params_count, latency_ms = problem.evaluate(x, seed=0)
    assert accuracy_pct > 50.0
    assert params_count == count_params(Arch.from_point(x))
    assert np.isfinite(latency_ms) and 0.0 < latency_ms < 100.0
