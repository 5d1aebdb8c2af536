"""Compressed training on CUDA: one NCCL rank (world size 1: NCCL refuses two ranks on one GPU, so
the two-rank NCCL test in test_collectives needs two GPUs) runs DDP with the FFT compressor's hook
on the GPU, cost-aware recomputation and a checkpoint that resumes on the GPU, against the same run on the CPU (gloo). Run on a GPU machine:
``.venv/bin/python -m pytest -m gpu``."""

import io

import pytest

from paperline.infra.device import gpu_usable

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_usable(), reason="no usable CUDA device")]


def test_one_nccl_rank_trains_with_fft_and_recomputation_and_resumes(free_port):
    import torch

    from paperline.kernels.train.ddp import TrainConfig, train_rank

    cfg = TrainConfig(model="resnet", model_options={"width": 8, "blocks": 1}, epochs=2, batch_size=64,
                      compressor="fft", compressor_options={"theta": 0.2, "bits": 8, "error_feedback": True},
                      recompute="cost-aware", seed=0)
    saved: dict[int, bytes] = {}
    r = train_rank(0, 1, f"tcp://127.0.0.1:{free_port()}", cfg, device="cuda",
                   save_checkpoint=lambda e, b: saved.__setitem__(e, b))
    cpu = train_rank(0, 1, f"tcp://127.0.0.1:{free_port()}", cfg, device="cpu")  # gloo: the reference
    epochs = r["epochs"]
    assert [e["epoch"] for e in epochs] == [0, 1]
    # Same seeds and data order; cuDNN and cuFFT round differently, so the runs agree in accuracy only.
    assert abs(epochs[-1]["test_accuracy_pct"] - cpu["epochs"][-1]["test_accuracy_pct"]) <= 5.0
    assert epochs[-1]["test_accuracy_pct"] > 50.0
    assert epochs[-1]["train_loss"] < epochs[0]["train_loss"]
    assert epochs[-1]["bytes_sent_per_step"] * 4 < r["dense_bytes_per_step"]
    state = torch.load(io.BytesIO(saved[0]), map_location="cpu", weights_only=False)  # readable without a GPU
    assert state["epoch"] == 0 and all(torch.isfinite(t).all() for t in state["model"].values())
    resumed = train_rank(0, 1, f"tcp://127.0.0.1:{free_port()}", cfg, device="cuda", resume_bytes=saved[0])
    assert resumed["epochs"][-1]["epoch"] == 1
    assert abs(resumed["epochs"][-1]["test_accuracy_pct"] - epochs[-1]["test_accuracy_pct"]) <= 5.0


def test_free_gpu_memory_is_read_without_a_cuda_context():
    """check_rank_memory's GPU branch reads each device's free memory through NVML (pynvml, with
    dask-cuda): a count per visible device, at most its total, and no CUDA context made here."""
    import json
    import subprocess
    import sys

    import torch

    # in a process of its own: this module's other tests have made a context here already
    probe = ("import json, torch; from paperline.flows.compressed_training import CompressedTrainingParameters as P; "
             "from paperline.infra.device import gpu_free_bytes; p = P(batch_size=64, world_size=1); "
             "p.check_rank_memory(p.train_config('none').validate(), device='cuda'); "
             "print(json.dumps([gpu_free_bytes(), torch.cuda.is_initialized()]))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]  # a small ResNet fits
    free, initialized = json.loads(out.stdout.splitlines()[-1])
    assert not initialized
    assert free is not None and len(free) == torch.cuda.device_count(), free
    assert all(0 < f <= torch.cuda.get_device_properties(i).total_memory for i, f in enumerate(free)), free
