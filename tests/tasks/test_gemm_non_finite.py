"""The gemm flow's sweep and peer with NaN/inf operands, in-process (no stack): refused by the
sweep when ``check_finite`` is on (it ran on them, then the peer did, before the main run refused
them: a trial), and without NumPy's RuntimeWarnings when it is off (the verification reports it)."""

import warnings

import numpy as np
import pytest

from paperline.flows.gemm import GemmParameters
from paperline.kernels.errors import InputError
from paperline.tasks.gemm import scaling_sweep, single_process_peer


def _kernel_params(tmp_path, check_finite: bool) -> dict:
    a = np.ones((200, 150))
    a[120, 40] = np.inf
    b = np.ones((150, 100))
    b[40, 7] = 0.0  # inf * 0: NaN, NumPy's "invalid value encountered in matmul"
    np.save(tmp_path / "a.npy", a)
    np.save(tmp_path / "b.npy", b)
    params = GemmParameters(a=str(tmp_path / "a.npy"), b=str(tmp_path / "b.npy"), tile=64, check_finite=check_finite)
    problem = params.validate_inputs(None)
    return {**params.kernel_params(), "m": problem.out_shape[0], "n": problem.out_shape[1], "k": problem.inner,
            "dtype": str(problem.dtype)}


def test_the_scaling_sweep_refuses_non_finite_operands_as_the_main_run_does(tmp_path):
    with pytest.raises(InputError) as e:
        scaling_sweep.fn(_kernel_params(tmp_path, True), None, 1 << 30, "cpu")
    assert str(e.value) == f"a={str(tmp_path / 'a.npy')!r}: non-finite value a[120,40] = inf (check_finite is on)"


def test_non_finite_operands_with_check_finite_off_raise_no_numpy_warnings(tmp_path):
    params = _kernel_params(tmp_path, False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a RuntimeWarning fails the call
        (row,) = scaling_sweep.fn(params, None, 1 << 30, "cpu")  # (the tiles' products on its runtime)
        assert single_process_peer.fn(params, None)["name"] == "numpy.matmul"
    assert row["workers"] == 1 and row["gflops"] > 0
