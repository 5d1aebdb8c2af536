"""`paperline run compressed-training` refuses parameters found by a fresh-user trial in one line,
quickly, before any stack, flow run or Dask cluster starts: a huge model (it grew the CLI's memory
~90 MB/s, hung, or failed in torch's allocator while validating), a bandwidth sweep that allocated
~9 GB per worker, a powersgd_rank too large while powersgd is not run, and NaN-drill steps that
never come."""

import time

import pytest
from typer.testing import CliRunner

from paperline.flows.cli import app
from paperline.infra.settings import get_settings


@pytest.mark.parametrize("sets, fragments", [
    (['model_options={"blocks":1000000}'],
     ["model_options={'blocks': 1000000}: resnet: width=16, blocks=1000000 makes a model of 23,231,996,474 "
      "parameters (259.6 GiB with gradients and optimizer state); at most 100,000,000 parameters"]),
    (["model=lstm", 'model_options={"layers":100000}'], ["model_options={'layers': 100000}: lstm: hidden=64, "
                                                          "layers=100000 makes a model of 3,327,991,434 parameters"]),
    (['model_options={"width":100000}'], ["model_options={'width': 100000}: resnet: width=100000, blocks=1 makes"]),
    (["model=lstm", 'model_options={"hidden":100000000}'], ["model_options={'hidden': 100000000}: lstm:"]),
    (["collectives_max_bytes=100000000000"], ["collectives_max_bytes=100000000000: at most 1073741824 (1 GiB)"]),
    (["powersgd_rank=100000"], ["powersgd_rank=100000: compresses no gradient of the model",
                                "the largest that compresses any is 14"]),
    (["nan_steps=[-1]"], ["nan_steps=[-1]: global step -1 is negative"]),
    # torch.manual_seed refuses 2**64 and more: the ranks failed three times on the workers, never naming the seed
    ([f"seed={2**70}"], [f"seed={2**70}: Input should be less than {2**63}"]),
    (["nan_steps=[3,248]"], ["nan_steps=[3, 248]: global step 248 is never reached: the run has 248 steps "
                             "(4 epoch(s) of 62)"]),
])
def test_refused_in_one_line_before_anything_starts(sets, fragments, tmp_path):
    args = ["run", "compressed-training", "--preset", "demo"]
    for item in sets:
        args += ["--set", item]
    t0 = time.perf_counter()
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, args, env={"PAPERLINE_STATE_DIR": str(tmp_path / "state")})
    finally:
        get_settings.cache_clear()
    assert result.exit_code != 0, result.output
    assert "Traceback" not in result.output
    text = " ".join(result.output.split())
    assert "error:" in text
    for f in fragments:
        assert f in text, text
    assert not (tmp_path / "state").exists()  # no stack was started
    assert time.perf_counter() - t0 < 30  # (the dataset's first load is most of it)


def test_ranks_that_would_not_fit_in_memory_are_refused():
    """A wide ResNet with a big batch passed the size caps and the ranks died in the OOM killer:
    the ranks' memory is estimated (activations kept for backward, on torch's meta device, plus
    the weights' training state) and checked against the machine's available memory."""
    from paperline.flows.compressed_training import CompressedTrainingParameters
    from paperline.infra.errors import InputError

    params = CompressedTrainingParameters(batch_size=64, world_size=2)
    model = params.train_config("none").validate()  # built on torch's meta device
    params.check_rank_memory(model, available=1 << 40)  # a TiB: fits
    with pytest.raises(InputError, match=r"batch_size=64: 2 rank\(s\) on this machine would need about 0\.1 GiB "
                                         r"\(0\.0[0-9] GiB of activations kept for backward and 0\.00 GiB of weights"):
        params.check_rank_memory(model, available=1 << 20)
    cheaper = CompressedTrainingParameters(batch_size=64, world_size=2, recompute="all")
    need = {}
    for p in (params, cheaper):
        try:
            p.check_rank_memory(p.train_config("none").validate(), available=1)
        except InputError as exc:
            need[p.recompute] = float(exc.problem.split("about ")[1].split(" GiB")[0])
    assert need["all"] <= need["none"]
    # on GPUs each rank has one of its own: the estimate and a CUDA context against the least free
    from paperline.flows.compressed_training import CUDA_CONTEXT_BYTES

    params.check_rank_memory(model, available=[1 << 40, 1 << 40], device="cuda")
    with pytest.raises(InputError, match=r"batch_size=64: each rank \(one per GPU\) would need about 0\.[0-9] GiB of its "
                                         r"GPU \(0\.0[0-9] GiB of activations .* and 0\.5 GiB for its CUDA context\), more "
                                         r"than the 0\.5 GiB free on GPU 1 of 2: lower batch_size"):
        params.check_rank_memory(model, available=[1 << 40, CUDA_CONTEXT_BYTES], device="cuda")
    # no NVIDIA driver here (or NVML unavailable): GPUs' memory not known, not checked
    from paperline.infra.device import gpu_free_bytes, gpu_usable

    if not gpu_usable():
        assert gpu_free_bytes() is None
        params.check_rank_memory(model, device="cuda")


def test_isgd_settings_without_isgd_change_nothing_trained():
    """`--set isgd_stop=0` with ISGD off (the default) trained every compressor again, missing
    the demo's cached results and its earlier runs to compare with (a trial): the settings of a
    switched-off ISGD do not reach the training configuration."""
    from paperline.flows.compressed_training import CompressedTrainingParameters

    plain = CompressedTrainingParameters().train_config("fft")
    assert CompressedTrainingParameters(isgd_stop=0, isgd_epsilon=0.5).train_config("fft") == plain
    on = CompressedTrainingParameters(isgd=True, isgd_stop=0).train_config("fft")
    assert on.isgd and on.isgd_stop == 0 and on != CompressedTrainingParameters(isgd=True).train_config("fft")
    # the parent MLflow run logs what its children trained with, not the unused values
    logged = CompressedTrainingParameters(isgd_stop=0, isgd_epsilon=0.5).logged_params()
    assert (logged["isgd_stop"], logged["isgd_epsilon"]) == (plain.isgd_stop, plain.isgd_epsilon)
    assert CompressedTrainingParameters(isgd=True, isgd_stop=0).logged_params()["isgd_stop"] == 0
