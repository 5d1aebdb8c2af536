"""The local paths each pipeline's Dask workers read or write (``worker_paths``), which
``require_shared_paths`` (infra/cluster.py) asks a configured cluster's workers to see: video's
sources, tensor's data file. Gemm's are in test_gemm_params.py."""

from __future__ import annotations

import pytest


def test_video_curations_workers_read_its_local_or_demo_videos(tmp_path):
    from paperline.flows.video_curation import VideoCurationParameters
    from paperline.kernels.video.sources import demo_videos

    (tmp_path / "in" / "sub").mkdir(parents=True)
    for name in ("a.mp4", "sub/b.mkv", ".hidden.mp4", "notes.txt"):
        (tmp_path / "in" / name).write_bytes(b"x")
    local = VideoCurationParameters(source=str(tmp_path / "in"), dataset="mine").worker_paths(tmp_path)
    assert [(w.argument, w.value, w.path, w.writes) for w in local] == [
        ("source", str(tmp_path / "in"), str(tmp_path / "in" / p), False) for p in ("a.mp4", "sub/b.mkv")]
    demo = VideoCurationParameters().worker_paths(tmp_path)
    assert [w.path for w in demo] == [str(p) for p in demo_videos()] and demo
    # the demo's are this environment's package files: sharing a folder is not the way (a trial)
    assert all("install the same environment at the same path" in w.how for w in demo)
    assert VideoCurationParameters(source="s3://bucket/videos/", dataset="mine").worker_paths(tmp_path) == []


@pytest.mark.parametrize("data, asked", [(None, False), ("s3://bucket/t.parquet", False), ("file", True)])
def test_tensor_factorizations_workers_read_a_local_data_file(tmp_path, data, asked):
    from paperline.flows.tensor_factorization import TensorFactorizationParameters

    if data == "file":  # (read only by the run's checks, not here)
        data = str(tmp_path / "t.parquet")
        (tmp_path / "t.parquet").write_bytes(b"PAR1")
    params = TensorFactorizationParameters(data=data, datasets=[]) if data else TensorFactorizationParameters()
    needs = params.worker_paths(tmp_path)
    assert [(w.argument, w.path, w.writes) for w in needs] == ([("data", data, False)] if asked else [])


def test_a_long_list_of_rejected_videos_is_cut_to_five_and_counted_by_reason():
    """200 fake videos, every one rejected, printed all 200 reasons (17 KB) in the error (a trial)."""
    from paperline.flows.video_curation import _rejected_reasons

    rejected = [{"source": f"/v/clip {i}.mp4", "reason": "not_a_video" if i % 4 else "empty_file",
                 "detail": "no stream"} for i in range(200)]
    said = _rejected_reasons(rejected, "/v")
    assert said.startswith("clip 0.mp4: empty_file (no stream); clip 1.mp4: not_a_video (no stream);")
    assert "clip 5.mp4" not in said and len(said) < 400, said
    assert said.endswith("; and 195 more (147 not_a_video, 48 empty_file): all in the MLflow run's rejected.parquet")
    assert _rejected_reasons(rejected[:2], "/v/") == "clip 0.mp4: empty_file (no stream); clip 1.mp4: not_a_video (no stream)"


def test_a_rejected_input_is_named_by_its_path_under_the_source():
    """Two folders' x.mp4 were both "rejected x.mp4" (a trial)."""
    from pathlib import Path

    from paperline.flows.video_curation import shown_input

    assert shown_input("/data/raw/day2/x.mp4", "/data/raw") == "day2/x.mp4" == shown_input("/data/raw/day2/x.mp4",
                                                                                            "/data/raw/")
    assert shown_input(str(Path.home() / "v" / "a" / "x.mp4"), "~/v") == "a/x.mp4"
    assert shown_input("s3://b/in/day2/x.mp4", "s3://b/in/") == "day2/x.mp4"
    assert shown_input("/data/raw/x.mp4", "/data/raw/x.mp4") == "x.mp4"  # a file given as the source
    assert shown_input("/elsewhere/x.mp4", "/data/raw") == "x.mp4"
