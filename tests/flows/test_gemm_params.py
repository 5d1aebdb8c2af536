"""The gemm flow's parameter checks that need no stack (flows/gemm.py, GemmParameters): what the
routine does not read is refused (c without beta), and the disk check sums what one filesystem
must hold. The CLI's wording of each refusal is in test_cli.py."""

from __future__ import annotations

import shutil
from collections import namedtuple

import pytest

from paperline.infra.errors import InputError

Usage = namedtuple("Usage", "total used free")


@pytest.fixture
def params(monkeypatch, tmp_path):
    monkeypatch.setenv("PAPERLINE_STATE_DIR", str(tmp_path / "state"))
    monkeypatch.setenv("PAPERLINE_N_WORKERS", "2")
    monkeypatch.delenv("PAPERLINE_S3_ENDPOINT_URL", raising=False)
    from paperline.flows.gemm import GemmParameters  # noqa: PLC0415
    from paperline.infra.settings import get_settings  # noqa: PLC0415

    getattr(get_settings, "cache_clear", lambda: None)()
    yield GemmParameters
    getattr(get_settings, "cache_clear", lambda: None)()


def _free(monkeypatch, free):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10 * free, 9 * free, free))


def _problem(p):
    from paperline.flows.gemm import build_problem  # noqa: PLC0415

    return build_problem(p.kernel_params(), None)


def test_staged_operands_and_staged_result_are_summed_against_free_space(params, monkeypatch):
    """Random a, b staged (34.3 GiB) and the result staged for S3 (17.2 GiB) on one disk with room
    for either alone: each passed on its own, and the run would have filled the disk (a trial)."""
    p = params(m=48000, n=48000, k=48000, tile=4096)
    operands, result = 2 * 48000 * 48000 * 8, 48000 * 48000 * 8
    _free(monkeypatch, operands + result // 2)
    with pytest.raises(InputError, match="need together .* on disk at") as e:
        p.check_size(_problem(p))
    assert e.value.argument == "m" and "staged random operands (34.33 GiB)" in str(e.value)


def test_an_s3_output_counts_its_copy_in_the_local_seaweedfs(params, monkeypatch):
    # no staged operands: the staged result and its upload into SeaweedFS, both under the state dir
    p = params(m=48000, n=48000, k=16, tile=4096, stage_random=False)
    result = 48000 * 48000 * 8
    _free(monkeypatch, result + result // 2)
    with pytest.raises(InputError) as e:
        p.check_size(_problem(p))
    # the default output is named by where it goes, not as output=None
    assert str(e.value).startswith("output='s3://<data bucket>/gemm/<flow run id>/result.npy': "), str(e.value)
    assert "its copy in the local SeaweedFS (17.17 GiB) need together 34.33 GiB" in str(e.value)
    _free(monkeypatch, 2 * result + 1)
    p.check_size(_problem(p))


def test_a_local_output_on_another_filesystem_is_not_summed_with_the_state_dir(params, monkeypatch, tmp_path):
    import os  # noqa: PLC0415

    out = tmp_path / "out"
    out.mkdir()
    real_stat = os.stat

    class Stat:  # the output's directory on a device of its own
        def __init__(self, path, *args, **kwargs):
            self.real = real_stat(path, *args, **kwargs)
            self.st_dev = self.real.st_dev + (1 if str(path).startswith(str(out)) else 0)

        def __getattr__(self, name):
            return getattr(self.real, name)

    monkeypatch.setattr(os, "stat", Stat)
    p = params(m=48000, n=48000, k=48000, tile=4096, output=str(out / "c.npy"))
    _free(monkeypatch, 2 * 48000 * 48000 * 8 + 1)  # room for the operands, and, elsewhere, the result
    p.check_size(_problem(p))


def test_c_without_beta_is_refused_where_beta_is_its_only_use(params):
    for routine in ("gemm", "symm"):
        with pytest.raises(InputError, match="reads c only as beta \\* c, and beta is 0: set beta") as e:
            params(routine=routine, c="random").check_used()
        assert e.value.argument == "c" and e.value.value == "random"
    params(routine="gemm", c="random", beta=1.0).check_used()
    # SYRK/SYR2K return C's other triangle, so they read c with beta 0 too
    params(routine="syrk", c="random").check_used()
    params(routine="syr2k", c="random").check_used()


@pytest.mark.parametrize("under", ["x.npy", "sub/x.npy"])
def test_an_output_under_a_regular_file_says_it_is_a_file(params, tmp_path, under):
    """``output=afile/x.npy`` said "its directory does not exist", with afile right there (a trial)."""
    afile = tmp_path / "afile"
    afile.write_text("")
    out = str(afile / under)
    with pytest.raises(InputError) as e:
        params(output=out).check_output(None)
    assert str(e.value) == f"output={out!r}: {afile} is a file, not a directory"
    with pytest.raises(InputError, match="its directory does not exist$"):  # nothing there at all
        params(output=str(tmp_path / "nowhere" / "x.npy")).check_output(None)


def test_a_bad_transpose_flag_names_the_ones_taken(params):
    """`trans_a='x'` said "Input should be 'N' or 'T'" while C is taken too (a trial)."""
    from pydantic import ValidationError

    for flag in ("trans_a", "trans_b"):
        with pytest.raises(ValidationError, match="expected N or T \\(either case\\), or C, taken as T"):
            params(**{flag: "x"})
        assert getattr(params(**{flag: "c"}), flag) == "T"


def test_an_output_inside_the_state_directory_is_refused(params, tmp_path):
    """A trial's `output` replaced a staged random operand under `<state dir>/gemm/operands`, which
    the next runs multiplied unchecked (Freivalds' check verifies the product of what was read)."""
    staged = tmp_path / "state" / "gemm" / "operands" / "370b1db36632bb040e183609.npy"
    for out in (staged, tmp_path / "state" / "stack.json.npy", tmp_path / "state" / "s3" / "new" / "x.npy"):
        with pytest.raises(InputError) as e:
            params(output=str(out)).check_output(None)
        # (the problem alone: a value's repr past 120 characters is cut in the message, as CI's long paths were)
        assert (e.value.argument, e.value.value) == ("output", str(out))
        assert e.value.problem == (f"is inside paperline's state directory {tmp_path / 'state'} (PAPERLINE_STATE_DIR: "
                                   "the stack's servers' data and logins, and staged operands later runs reuse); name a "
                                   "file elsewhere")
    params(output=str(tmp_path / "state-next-door.npy")).check_output(None)  # beside it: fine


@pytest.mark.parametrize(("given", "kept"), [
    ({"routine": "GEMM", "trans_a": "t", "trans_b": "T"}, {"routine": "gemm", "trans_a": "T", "trans_b": "T"}),
    ({"routine": "Trsm", "side": "r", "uplo": "l", "trans_a": "n", "diag": "u"},
     {"routine": "trsm", "side": "R", "uplo": "L", "trans_a": "N", "diag": "U"}),
    ({"routine": "syrk", "uplo": "L", "trans_a": "T"}, {"routine": "syrk", "uplo": "L", "trans_a": "T"}),
    ({"routine": "GEMM", "dtype": "FLOAT32"}, {"routine": "gemm", "dtype": "float32"}),  # (dtype too: a trial)
    # BLAS's conjugate transpose, as the kernels and scipy.linalg.blas take it for real operands
    ({"routine": "gemm", "trans_a": "C", "trans_b": "c"}, {"routine": "gemm", "trans_a": "T", "trans_b": "T"}),
])
def test_routine_and_flags_take_either_case_and_are_recorded_normalised(params, given, kept):
    """routine=GEMM was refused (lower case only) while side=r was refused (upper case only): BLAS
    users type either (a trial). MLflow records the normalised values, so runs compare as one."""
    from paperline.flows.gemm import logged_params  # noqa: PLC0415

    p = params(m=64, n=48, k=32, tile=16, **given)
    p.check_used()  # trans_a="n" is the default, not a flag TRSM would be refused for
    assert {name: getattr(p, name) for name in kept} == kept
    logged = logged_params(p, _problem(p))
    assert {name: logged[name] for name in kept} == kept
    assert _problem(p).routine == kept["routine"]


def test_a_flag_in_neither_case_is_still_refused_naming_it(params):
    from pydantic import ValidationError  # noqa: PLC0415

    for name, value in (("side", "x"), ("trans_b", "h"), ("routine", "GEMV")):
        with pytest.raises(ValidationError) as e:
            params(**{name: value})
        (error,) = e.value.errors()
        assert error["loc"] == (name,) and error["input"] == value  # the value as given, not normalised


def test_the_workers_paths_are_the_state_dir_the_npy_operands_and_a_local_outputs_directory(params, tmp_path):
    """What require_shared_paths asks a configured cluster's workers to see (infra/cluster.py)."""
    state = tmp_path / "state"
    a = tmp_path / "a.npy"

    def needs(**given):
        return [(w.argument, w.value, w.path, w.writes) for w in params(**given).worker_paths(state)]

    gemm_dir = ("PAPERLINE_STATE_DIR", str(state), str(state / "gemm"), True)
    assert needs() == [gemm_dir]  # random operands staged, the result staged for S3
    assert needs(a=str(a), b="s3://bucket/b.npy", c="random", beta=1.0) == [gemm_dir, ("a", str(a), str(a), False)]
    out = tmp_path / "out" / "c.npy"
    # nothing under the state dir: operands from files, read where they are, no sweep, a local output
    assert needs(a=str(a), b=str(a), output=str(out), scaling=False) == [
        ("a", str(a), str(a), False), ("b", str(a), str(a), False), ("output", str(out), str(out.parent), True)]
    # random operands generated where they are read (not staged): still nothing there
    assert needs(stage_random=False, output=str(out), scaling=False) == [("output", str(out), str(out.parent), True)]
    # SYRK reads no b: a b left at its default is not asked for
    assert [n[0] for n in needs(routine="syrk", a=str(a), output=str(out), scaling=False)] == ["a", "output"]


def test_parameters_a_served_deployment_keeps_or_replaces():
    """`serve` keeps a deployment's parameters set in the Prefect UI where they are still valid for
    the pipeline (a restart put the pipeline's own back, unsaid), and names the fields that differ;
    parameters a later model refuses, or not shaped {"params": {...}}, give way to the pipeline's
    own, said (the server's own copy was checked against the earlier schema)."""
    from paperline.deployments import served_parameters
    from paperline.flows.pipelines import get_pipeline

    gemm, nas = get_pipeline("gemm"), get_pipeline("nas")
    assert served_parameters(gemm, {}, "b") == ({}, None)
    assert served_parameters(gemm, None, "b") == ({}, None)
    assert served_parameters(nas, {"params": {"resume": False}}, "b") == ({"params": {"resume": False}}, None)
    # the UI's form sends every field: only those that differ are named
    form = {"params": {**get_pipeline("gemm").parameters().model_dump(mode="json"), "m": 256, "routine": "syrk"}}
    assert served_parameters(gemm, form, "b") == (
        form, "parameters as set on the Prefect server, not the pipeline's own: routine='syrk', m=256")
    assert served_parameters(gemm, {"params": {"tile": 1024}}, "b") == ({"params": {"tile": 1024}}, None)  # the default
    assert served_parameters(gemm, {"params": None}, "b") == ({"params": None}, None)  # (Prefect stores it: defaults)
    own, note = served_parameters(gemm, {"params": {"tile": 0}}, "b")
    assert own == {} and note == ("its parameters on the Prefect server are not valid for this pipeline (tile: Input "
                                  "should be greater than 0); the pipeline's own are served")
    for odd in ({"m": 5}, {"params": [1]}, {"params": {}, "other": 1}):
        assert served_parameters(gemm, odd, "b") == (
            {}, "its parameters on the Prefect server are not {\"params\": {...}}; the pipeline's own are served")
