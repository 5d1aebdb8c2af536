"""One decode pass per video: shot detection, clip transcoding, filter scores and embeddings
([NeMoVideo2025]_ Sec. 2.1-2.3: splitting, transcoding and filtering).

Every source frame is decoded once. Each decoded frame is scaled twice by FFmpeg's scaler: to the
analysis size (48x27 RGB, for the detector, motion, black/flat and perceptual hashes) and to the
output size (YUV 4:2:0, encoded as is and used for sharpness). A frame waits in memory only until
the detector has decided it (its lookahead), then it is appended to the open clip's H.264 encoder.

Frames are timed by their presentation timestamps, so a variable-frame-rate source (phones record
them) gives clips whose times are the source's and whose output frames (constant rate) follow
the source's clock: a source frame is repeated or dropped to fill the output ticks inside its
display interval, as FFmpeg's ``fps`` filter does. Clip lengths (``min_clip_s``, ``max_clip_s``)
are measured on that clock too (to within half an average frame), as are the ``stride``
splitter's windows (``stride_s``); TransNetV2's context counts frames (its model's input). A
stream with a display matrix (a phone's portrait video) is turned upright first, by the FFmpeg filters
``ffmpeg`` itself would insert (:attr:`VideoInfo.display_filters`).
"""

from __future__ import annotations

import hashlib
import io
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from paperline.kernels.errors import InputError
from paperline.kernels.video.detect import ANALYSIS_SIZE, DROPPED, LAST_OF_SHOT, ShotSegmenter, hsv_histograms, make_detector
from paperline.kernels.video.probe import Rejected, VideoInfo

THUMB_WIDTH = 160
MIN_HEIGHT = 16  # output height in pixels at the least (ClipConfig.height)
_EMBEDDERS = ("auto", "transnetv2", "hsv-histogram")


@dataclass(frozen=True)
class ClipConfig:
    """How clips are cut and encoded.

    Attributes:
        splitter: Shot detector (``transnetv2``, ``content``, ``stride``).
        splitter_options: Keyword options of the detector.
        min_clip_s: Shots (and the last window of a long shot) shorter than this are dropped, seconds.
        max_clip_s: Longer shots are cut into windows of this length, seconds.
        height: Output height in pixels of the upright frame (never upscaled; even); width keeps
            the aspect ratio (a portrait 1080x1920 phone video at 360 gives 202x360 clips).
        fps: Output frame rate; None keeps the source's.
        encoder: ``libx264`` or ``h264_nvenc``.
        crf: Constant rate factor (libx264) / constant quality (NVENC), 0-51.
        preset: Encoder preset (libx264: ``ultrafast`` ... ``veryslow``; NVENC: ``p1`` ... ``p7``).
        embedder: ``transnetv2`` (its 1024-d penultimate features), ``hsv-histogram`` (256-d) or
            ``auto`` (the splitter's own features: TransNetV2's when it splits, else histograms).
        device: Torch device for TransNetV2 (``cpu``/``cuda``).
        sharpness_every: Sharpness is measured on every n-th output frame.
        encoder_threads: libx264 threads per clip (the flow's parallelism is one video per worker
            core). x264's bytes are not repeatable run to run (seen with PyAV 18 / x264 core 165,
            at equal quality, even with one thread), so a dataset's identity is its clip keys.

    Raises:
        InputError: at construction, ``min_clip_s`` not > 0, ``max_clip_s < min_clip_s``,
            ``height`` < 16, ``fps`` outside (0, 240] or under 2 frames per ``min_clip_s``, ``crf``
            outside 0-51, an unknown ``encoder`` or ``embedder``, or ``encoder_threads`` or
            ``sharpness_every`` < 1. The splitter and its options are checked when the detector is
            made.
    """

    splitter: str = "content"
    splitter_options: dict[str, Any] = field(default_factory=dict)
    min_clip_s: float = 2.0
    max_clip_s: float = 10.0
    height: int = 360
    fps: float | None = None
    encoder: str = "libx264"
    crf: int = 23
    preset: str = "veryfast"
    embedder: str = "auto"
    device: str = "cpu"
    sharpness_every: int = 5
    encoder_threads: int = 1

    def __post_init__(self) -> None:
        if not self.min_clip_s > 0:
            raise InputError("min_clip_s", self.min_clip_s, "must be positive")
        if not self.max_clip_s >= self.min_clip_s:
            raise InputError("max_clip_s", self.max_clip_s, f"must be >= min_clip_s ({self.min_clip_s})")
        if self.height < MIN_HEIGHT:
            raise InputError("height", self.height, f"must be >= {MIN_HEIGHT} pixels")
        if self.fps is not None and not 0 < self.fps <= 240:
            raise InputError("fps", self.fps, "must be in (0, 240] frames per second, or None (source rate)")
        if self.fps is not None and self.fps * self.min_clip_s < 2:  # fps=0.01 made one-frame "clips" (a trial)
            raise InputError("fps", self.fps, f"gives fewer than 2 frames in a clip of min_clip_s={self.min_clip_s} s; "
                                              f"use fps >= {2 / self.min_clip_s:g} (or a longer min_clip_s)")
        if not 0 <= self.crf <= 51:
            raise InputError("crf", self.crf, "must be in 0..51")
        if self.encoder not in ("libx264", "h264_nvenc"):
            raise InputError("encoder", self.encoder, "must be libx264 or h264_nvenc")
        if self.embedder not in _EMBEDDERS:
            raise InputError("embedder", self.embedder, f"must be one of {', '.join(_EMBEDDERS)}")
        if self.encoder_threads < 1:
            raise InputError("encoder_threads", self.encoder_threads, "must be >= 1")
        if self.sharpness_every < 1:
            raise InputError("sharpness_every", self.sharpness_every, "must be >= 1")

    def resolved_embedder(self) -> str:
        """The embedder used: ``embedder``, or for ``auto`` ``transnetv2`` when TransNetV2 splits,
        else ``hsv-histogram``."""
        if self.embedder != "auto":
            return self.embedder
        return "transnetv2" if self.splitter == "transnetv2" else "hsv-histogram"


@dataclass(frozen=True)
class FilterConfig:
    """Filter thresholds ([NeMoVideo2025]_ Sec. 2.3); a clip failing any is kept in the index with
    its reasons but not sharded.

    Attributes:
        min_motion: Least mean absolute frame difference (luma, 0-1 scale) of a moving clip.
        min_sharpness: Least mean variance of the Laplacian of the output luma (8-bit units²).
        max_black_fraction: Most frames that may be black (mean luma < ``black_luma``) or flat
            (luma standard deviation < ``flat_std``), as a fraction.
        black_luma: Mean luma (0-255) under which a frame is black.
        flat_std: Luma standard deviation (0-255) under which a frame is flat.
        min_duration_s: Shortest clip kept, seconds.
        min_height: Lowest source resolution kept (pixels of height).
    """

    min_motion: float = 0.002
    min_sharpness: float = 15.0
    max_black_fraction: float = 0.5
    black_luma: float = 20.0
    flat_std: float = 3.0
    min_duration_s: float = 0.0
    min_height: int = 64

    def decide(self, clip: Clip) -> list[str]:
        """The filter reasons a clip fails (empty: kept)."""
        reasons = []
        if clip.duration_s < self.min_duration_s:
            reasons.append("too_short")
        if clip.source_height < self.min_height:
            reasons.append("low_resolution")
        if clip.motion < self.min_motion:
            reasons.append("static")
        if clip.sharpness < self.min_sharpness:
            reasons.append("blurry")
        if clip.black_fraction > self.max_black_fraction:
            reasons.append("black_or_flat")
        return reasons


@dataclass
class Clip:
    """One clip: where it came from, its scores, decisions and (if kept) its H.264 mp4 bytes.

    Times are seconds from the start of the source; frame indices are source frames
    (``end_frame`` exclusive). Sizes are of upright frames: ``source_width``/``source_height`` as
    displayed (after the source's display matrix, whose rotation is ``source_rotation``, degrees
    counterclockwise as ``ffprobe`` reports it), ``width``/``height`` the clip's (which carries no
    display matrix: its frames are stored upright).
    """

    key: str
    source: str
    source_sha256: str
    start_frame: int
    end_frame: int
    start_s: float
    end_s: float
    duration_s: float
    frames: int
    fps: float
    width: int
    height: int
    source_width: int
    source_height: int
    source_rotation: int
    motion: float
    sharpness: float
    black_fraction: float
    content_sha256: str
    phash: list[str]
    embedding: list[float]
    filter_reasons: list[str] = field(default_factory=list)
    kept: bool = True
    mp4: bytes | None = None
    mp4_sha256: str | None = None
    mp4_size_bytes: int = 0
    thumbnail_jpeg: bytes | None = None

    def row(self) -> dict[str, Any]:
        """The clip's index fields (no bytes)."""
        d = asdict(self)
        for k in ("mp4", "thumbnail_jpeg", "embedding"):
            d.pop(k)
        return d


@dataclass
class VideoResult:
    """What one video gave: clips (kept and filtered), or a rejection, and counters."""

    info: VideoInfo
    clips: list[Clip]
    rejected: Rejected | None
    frames_decoded: int
    shots: int
    short_dropped: int
    seconds: float

    @property
    def video_s(self) -> float:
        """Seconds of video decoded, ``frames_decoded / fps`` (0.0 when the rate is unknown)."""
        return self.frames_decoded / self.info.fps if self.info.fps else 0.0


def output_size(width: int, height: int, target_height: int) -> tuple[int, int]:
    """Output (width, height): ``target_height`` capped at the source's, both even, aspect kept."""
    h = min(target_height, height)
    h -= h % 2
    w = round(width * h / height / 2) * 2
    return max(w, 2), max(h, 2)


class _Clock:
    """Decoded frames' presentation times, seconds from the first frame (exact: ``pts`` x
    ``time_base``). A frame without a timestamp is one average frame after the one before."""

    def __init__(self, rate: Fraction):
        self.step = 1 / rate
        self.origin: Fraction | None = None
        self.last: Fraction | None = None

    def __call__(self, frame: Any) -> Fraction:
        after = self.last + self.step if self.last is not None else Fraction(0)
        if frame.pts is None or frame.time_base is None:
            t = after
        else:
            at = frame.pts * frame.time_base  # int x Fraction: exact
            if self.origin is None:
                self.origin = at - after
            t = at - self.origin
        self.last = t
        return t


class _Autorotate:
    """Turns decoded frames upright through an FFmpeg filter graph (``transpose``, ``hflip``, ...),
    rebuilt when the frames' size or format changes mid-stream."""

    def __init__(self, filters: str, time_base: Fraction | None):
        self.filters = [f.partition("=") for f in filters.split(",") if f]
        self.time_base = time_base
        self.graph: Any = None
        self.shape: tuple[int, int, str] | None = None

    def __call__(self, frame: Any) -> Any:
        if not self.filters:
            return frame
        shape = (frame.width, frame.height, frame.format.name)
        if shape != self.shape:
            import av.filter  # noqa: PLC0415

            graph = av.filter.Graph()
            node = graph.add_buffer(width=frame.width, height=frame.height, format=frame.format.name,
                                    time_base=frame.time_base or self.time_base or Fraction(1, 1000))
            for name, _, arg in self.filters:
                nxt = graph.add(name, arg or None)
                node.link_to(nxt)
                node = nxt
            node.link_to(graph.add("buffersink"))
            graph.configure()
            self.graph, self.shape = graph, shape
        self.graph.push(frame)
        return self.graph.pull()


X264_PRESETS = ("ultrafast", "superfast", "veryfast", "faster", "fast", "medium", "slow", "slower", "veryslow",
                "placebo")


def check_x264_preset(preset: str) -> None:
    """Refuse a preset libx264 does not know (x264's ``x264_preset_names``; a bad preset made every
    video fail to encode, reported as broken sources, and the run "succeeded" with no clips).

    Raises:
        InputError: naming ``preset`` and libx264's presets.
    """
    if preset not in X264_PRESETS:
        raise InputError("preset", preset, f"not a libx264 preset; known: {', '.join(X264_PRESETS)}")


def key_stem(source: str) -> str:
    """The key-safe part of a source's file stem that clip keys start with: ``[A-Za-z0-9_-]`` only
    (each run of other characters becomes one ``_``), at most 48 characters, ``"video"`` if empty."""
    import re  # noqa: PLC0415
    from pathlib import PurePosixPath  # noqa: PLC0415

    return re.sub(r"[^A-Za-z0-9_-]+", "_", PurePosixPath(source.replace("\\", "/")).stem)[:48] or "video"


def source_id(info: VideoInfo) -> str:
    """A key-safe id of a source: :func:`key_stem` of its path and 10 hex digits of its SHA-256
    (WebDataset keys end at the first dot)."""
    return f"{key_stem(info.source)}-{info.sha256[:10]}"


@dataclass(frozen=True)
class _FrameStats:
    """Per-frame analysis, computed for a batch of frames at once (see ``_analyse``)."""

    diff: float  # mean |luma - previous frame's luma| / 255 (analysis size)
    dark: bool  # black (mean luma < black_luma) or flat (luma std < flat_std)
    hist: np.ndarray | None  # HSV histogram, when the splitter or the embedder uses it


_LUMA = np.array([0.299, 0.587, 0.114], np.float32)
_BATCH = 32  # analysis frames processed together (vectorised); adds this many frames of lookahead


def _analyse(smalls: np.ndarray, prev_gray: np.ndarray | None, filt: FilterConfig, hists: bool
             ) -> tuple[list[_FrameStats], np.ndarray]:
    """Motion, black/flat flags and (optionally) HSV histograms of ``uint8 (N, 27, 48, 3)`` frames;
    returns the stats and the last frame's luma (for the next batch's first difference)."""
    gray = smalls.astype(np.float32) @ _LUMA
    ref = np.concatenate([gray[:1] if prev_gray is None else prev_gray[None], gray[:-1]])
    diffs = np.abs(gray - ref).mean(axis=(1, 2)) / 255.0
    dark = (gray.mean(axis=(1, 2)) < filt.black_luma) | (gray.std(axis=(1, 2)) < filt.flat_std)
    hs = hsv_histograms(smalls) if hists else [None] * len(smalls)
    return [_FrameStats(float(d), bool(k), h) for d, k, h in zip(diffs, dark, hs)], gray[-1]


class _ClipEncoder:
    """An H.264 mp4 being written in memory, with the clip's running scores."""

    def __init__(self, cfg: ClipConfig, start: int, width: int, height: int, src_rate: Fraction,
                 out_rate: Fraction, thumb_at: int, min_frames: int):
        self.start, self.n = start, 0
        self.t0 = Fraction(0)  # the first frame's time from the video's first frame, seconds
        self.held: Any = None  # the newest frame: its display interval ends when the next one starts
        self.last_t = Fraction(0)  # the newest frame's time from t0
        self.end: Fraction | None = None  # where the last frame's display ends (the next frame's time), from t0
        self.cfg, self.width, self.height = cfg, width, height
        self.container: Any = None  # opened once the clip reaches min_frames: short shots are never encoded
        self.waiting: list[tuple[Any, Fraction]] = []  # (frame, end of its interval) until the encoder opens
        self.min_frames = min_frames
        self.src_rate, self.out_rate = src_rate, out_rate
        self.tick = 1 / out_rate  # seconds between output frames
        self.out_n = 0
        self.thumb_at = thumb_at
        self.thumb: Any = None
        self.diffs: list[float] = []
        self.sharp: list[float] = []
        self.dark = 0
        self.smalls: list[np.ndarray] = []  # first/middle/last kept for hashes (all small frames: 3.9 KB each)
        self.feats: list[np.ndarray] = []
        self.sha = hashlib.sha256()

    def _open(self) -> None:
        import av  # noqa: PLC0415

        cfg = self.cfg
        self.buf = io.BytesIO()
        self.container = av.open(self.buf, mode="w", format="mp4")
        st = self.container.add_stream(cfg.encoder, rate=self.out_rate)
        st.width, st.height, st.pix_fmt = self.width, self.height, "yuv420p"
        if cfg.encoder == "libx264":
            st.options = {"crf": str(cfg.crf), "preset": cfg.preset, "threads": str(cfg.encoder_threads)}
        else:
            st.options = {"cq": str(cfg.crf), "preset": cfg.preset}
        self.stream = st
        waiting, self.waiting = self.waiting, []
        for frame, until in waiting:
            self._encode(frame, until)

    def _encode(self, big: Any, until: Fraction) -> None:
        # As many output frames as output ticks fall before the end of this frame's interval
        # (seconds from the clip's start): repeated or dropped when the rates differ
        if self.container is None:
            self.waiting.append((big, until))
            return
        while self.out_n * self.tick < until:
            big.pts = self.out_n
            big.time_base = self.tick
            for packet in self.stream.encode(big):
                self.container.mux(packet)
            self.out_n += 1

    def add(self, big: Any, small: np.ndarray, feat: np.ndarray | None, stats: _FrameStats, t: Fraction) -> None:
        """Append a frame shown from ``t`` (seconds from the video's first frame)."""
        if self.n == 0:
            self.t0 = t
        rel = max(t - self.t0, self.last_t)  # a timestamp going back: the frame before gets no time
        if self.held is not None:
            self._encode(self.held, rel)
        self.held, self.last_t = big, rel
        if self.container is None and self.n + 1 >= self.min_frames:
            self._open()
        if self.n == 0 or self.n == self.thumb_at:
            self.thumb = big
        if self.n > 0:  # motion: the difference to the previous frame of this clip
            self.diffs.append(stats.diff)
        self.dark += stats.dark
        if self.n % self.cfg.sharpness_every == 0:
            from scipy.ndimage import laplace  # noqa: PLC0415

            luma = big.to_ndarray()[: big.height].astype(np.float32)  # yuv420p: the Y plane comes first
            self.sharp.append(float(laplace(luma).var()))
        self.smalls.append(small)
        if feat is not None:
            self.feats.append(feat)
        self.sha.update(small.tobytes())
        self.n += 1

    @property
    def duration(self) -> Fraction:
        """Seconds from the first frame to the end of the last one: the next frame's time when
        known, else one average frame after the last one's."""
        if self.end is not None and self.end > self.last_t:
            return self.end
        return self.last_t + 1 / self.src_rate

    def close(self) -> bytes:
        if self.container is None:
            self._open()
        if self.held is not None:
            self._encode(self.held, self.duration)
            self.held = None
        for packet in self.stream.encode():
            self.container.mux(packet)
        self.container.close()
        return self.buf.getvalue()

    def abort(self) -> None:
        self.waiting = []
        if self.container is None:
            return
        try:
            self.container.close()
        except Exception:  # noqa: BLE001 - an encoder that never got a frame may refuse to close
            pass


def extract_clips(info: VideoInfo, cfg: ClipConfig, filt: FilterConfig | None = None,
                  on_clip: Callable[[Clip], None] | None = None) -> VideoResult:
    """Split, transcode, score and embed one video in a single decode pass.

    Args:
        info: The probe's result for the (local) file.
        cfg: Splitting and encoding settings.
        filt: Filter thresholds (default :class:`FilterConfig`). Filtered clips keep no mp4 bytes.
        on_clip: Called with each finished clip as soon as it is closed (e.g. to upload it);
            the clip's bytes are released afterwards when given.

    Returns:
        :class:`VideoResult`. A video that stops decoding early (truncated, corrupt) is returned
        as ``rejected`` with no clips: reason ``decode_error`` when the decoder failed on its data
        (corrupt), ``truncated`` when it ended quietly short of the frames the container declares or,
        where it declares none (Matroska, WebM), well short of the video's declared duration.

    Raises:
        InputError: bad configuration (unknown splitter or option).
    """
    import av  # noqa: PLC0415
    import imagehash  # noqa: PLC0415
    from av.video.reformatter import VideoReformatter  # noqa: PLC0415
    from PIL import Image  # noqa: PLC0415

    filt = filt or FilterConfig()
    t0 = time.perf_counter()
    embedder = cfg.resolved_embedder()
    opts = dict(cfg.splitter_options)
    if cfg.splitter == "transnetv2":
        opts.setdefault("device", cfg.device)
    clips: list[Clip] = []
    sid = source_id(info)
    with av.open(info.source) as container:
        stream = container.streams.video[0]
        stream.thread_type = "AUTO"
        src_rate = Fraction(stream.average_rate or stream.guessed_rate or Fraction(info.fps).limit_denominator(1001))
        out_rate = Fraction(cfg.fps).limit_denominator(1001) if cfg.fps else src_rate
        detector = make_detector(cfg.splitter, float(src_rate), **opts)
        feature_source = None  # a second detector run only for its features
        if embedder == "transnetv2" and cfg.splitter != "transnetv2":
            feature_source = make_detector("transnetv2", float(src_rate), device=cfg.device)
        width, height = output_size(info.width, info.height, cfg.height)
        min_frames = max(2, round(cfg.min_clip_s * float(src_rate)))  # where a clip's encoder opens
        # a clip's length is its frames' time (a VFR source's slow part has fewer frames per second
        # than the average: counting frames dropped its long shots), within half an average frame
        half_frame = 1 / (2 * src_rate)
        min_s, max_s = Fraction(cfg.min_clip_s) - half_frame, Fraction(max(cfg.max_clip_s, cfg.min_clip_s)) - half_frame
        thumb_at = min_frames // 2
        segmenter = ShotSegmenter()
        pending: deque[tuple[Any, np.ndarray, _FrameStats, Fraction]] = deque()  # frames not yet decided
        need_hists = cfg.splitter == "content" or embedder == "hsv-histogram"
        batch: list[tuple[Any, np.ndarray, Fraction]] = []  # decoded, not yet analysed

        def analyse_batch() -> None:
            if not batch:
                return
            stats, state["prev_gray"] = _analyse(np.stack([b[1] for b in batch]), state["prev_gray"], filt, need_hists)
            for (big, small, t), st in zip(batch, stats):
                pending.append((big, small, st, t))
                if cfg.splitter == "content":
                    detector.push(small, hist=st.hist)
                elif cfg.splitter == "stride":  # windows of the video's clock (a VFR video's too)
                    detector.push(small, t=t)
                else:
                    detector.push(small)
                if feature_source is not None:
                    feature_source.push(small)
            batch.clear()
            drain(ready())
        # "ending": a shot's clip waiting for the next frame's time, where its last frame's display ends
        state: dict[str, Any] = {"enc": None, "ending": None, "decided": 0, "shots": 0, "short": 0,
                                 "prev_gray": None}

        def features(i: int) -> np.ndarray | None:
            if embedder == "transnetv2" or cfg.splitter == "content":
                src = feature_source or detector
                feat, src.features[i] = src.features[i], None  # consumed: memory stays bounded
                return feat
            return pending[0][2].hist

        def close(enc: _ClipEncoder, end: Fraction | None) -> None:
            enc.end = end
            if enc.n < 2 or enc.duration < min_s:
                enc.abort()
                state["short"] += 1
                return
            clips.append(_finish_clip(enc, info, sid, filt, imagehash, Image, on_clip))

        def drain(limit: int) -> None:
            while state["decided"] < limit:
                i = state["decided"]
                big, small, stats, t = pending[0]
                role = segmenter.role(detector.flags[i])
                feat = features(i)
                pending.popleft()
                state["decided"] += 1
                ending, state["ending"] = state["ending"], None
                if ending is not None:
                    close(ending, t - ending.t0)
                if role == DROPPED:
                    continue
                enc = state["enc"]
                if enc is not None and t - enc.t0 >= max_s:  # a full window: this frame starts the next
                    close(enc, t - enc.t0)
                    enc = None
                if enc is None:
                    enc = state["enc"] = _ClipEncoder(cfg, i, width, height, src_rate, out_rate, thumb_at, min_frames)
                enc.add(big, small, feat, stats, t)
                if role == LAST_OF_SHOT:
                    state["shots"] += 1
                    state["enc"], state["ending"] = None, enc

        def ready() -> int:
            r = detector.ready
            return min(r, feature_source.ready) if feature_source is not None else r

        decoded = 0
        error: str | None = None
        to_small, to_big = VideoReformatter(), VideoReformatter()  # reused: one scaler context each
        upright = _Autorotate(info.display_filters, stream.time_base)
        clock = _Clock(src_rate)
        latest: Fraction | None = None  # the latest decoded frame's time
        try:
            for frame in container.decode(stream):
                t = clock(frame)
                latest = t if latest is None or t > latest else latest
                frame = upright(frame)
                small = to_small.reformat(frame, width=ANALYSIS_SIZE[0], height=ANALYSIS_SIZE[1],
                                          format="rgb24").to_ndarray()
                if frame.width == width and frame.height == height and frame.format.name == "yuv420p":
                    big = frame  # already the output size and format
                else:
                    big = to_big.reformat(frame, width=width, height=height, format="yuv420p")
                big.pict_type = 0  # let the encoder choose frame types (the source's are not ours)
                batch.append((big, small, t))
                decoded += 1
                if len(batch) >= _BATCH:
                    analyse_batch()
        except av.error.FFmpegError as exc:
            error = str(exc)
        analyse_batch()
        detector.finish()
        if feature_source is not None:
            feature_source.finish()
        declared = info.frames
        # Matroska/WebM declare no frame count (0), only durations: a cut MKV decoded quietly to its
        # cut and was curated as if whole (a trial). Without a count, the stream is cut when the
        # decoded frames' time (first frame to the last one's end, one average frame) falls well
        # short of the duration declared for it. Time, not frames x average rate: a variable-rate
        # MKV's declared rate is its first frames' (a complete 75-frame file of 2 s at 25 fps then
        # 2 s at 12.5 fps "expects" 99 frames), and times do not depend on it. Complete files written
        # by FFmpeg (MKV, WebM, MP4 at 1 to 60 fps, 0.12 to 10 s, variable-rate ones, with a longer
        # audio track) end within one frame of the video's own declared duration: the slack there is
        # the frame count's (2 %) plus two frames. Only the container's duration (no duration of the
        # stream's own) gets 5 % plus 0.5 s: it is the longest track's, and an audio track may run on.
        span, own = _declared_video_s(container, stream) if not declared else (0.0, False)
        # (the clock counts from the first frame; a declared end counts from 0: a complete MKV whose
        # video starts at 1 s, after its audio, read 4 s of 5 s declared: a review)
        start = clock.origin if clock.origin is not None and clock.origin > 0 else 0
        covered = float(start + latest + 1 / src_rate) if latest is not None else 0.0
        short_of_span = bool(span) and covered < (span * 0.98 - 2 / float(src_rate) if own else span * 0.95 - 0.5)
        if error is not None or (declared and decoded < declared * 0.98 - 1) or short_of_span:
            for enc in (state["ending"], state["enc"]):
                if enc is not None:
                    enc.abort()
            # the decoder failing on the stream's data is corruption; a stream that ends quietly short
            # of its declared frames (or duration) is cut off ("truncated" named a full-length file
            # with corrupt chunks: a trial)
            why = "decode_error" if error is not None else "truncated"
            if declared or not span:
                detail = f"decoded {decoded} of {declared or '?'} declared frames"
            else:
                detail = (f"decoded {decoded} of about {round(span * float(src_rate))} expected frames "
                          f"({covered:.2f} s of the {span:.2f} s declared, at {float(src_rate):.4g} fps)")
            detail += f": {error}" if error else ""
            return VideoResult(info, [], Rejected(info.source, why, detail), decoded, 0, 0,
                               time.perf_counter() - t0)
        drain(ready())
        if state["ending"] is not None:  # the video's last frame ended a shot
            close(state["ending"], None)
        if state["enc"] is not None:
            state["shots"] += 1
            close(state["enc"], None)
    return VideoResult(info, clips, None, decoded, state["shots"], state["short"], time.perf_counter() - t0)


def _declared_video_s(container: Any, stream: Any) -> tuple[float, bool]:
    """The duration in seconds a container declares for its video ``stream``, and whether it is the
    stream's own: the stream's duration (MP4), else its Matroska ``DURATION`` tag
    (``"00:00:06.000000000"``, written by FFmpeg and mkvmerge), else the container's (``False``:
    the longest track's, an audio track's when it runs on); ``(0.0, False)`` when none."""
    if stream.duration and stream.time_base:
        return float(stream.duration * stream.time_base), True
    tag = next((v for k, v in (stream.metadata or {}).items() if k.upper().startswith("DURATION")), None)
    if tag:
        try:
            h, m, sec = str(tag).strip().split(":")
            return int(h) * 3600 + int(m) * 60 + float(sec), True
        except ValueError:
            pass  # an unreadable tag: the container's
    return (float(container.duration) / 1e6, False) if container.duration else (0.0, False)


def _finish_clip(enc: _ClipEncoder, info: VideoInfo, sid: str, filt: FilterConfig, imagehash: Any, image: Any,
                 on_clip: Callable[[Clip], None] | None) -> Clip:
    data = enc.close()
    width, height, out_rate = enc.width, enc.height, enc.out_rate
    start, end = enc.start, enc.start + enc.n
    duration = enc.duration
    picks = [enc.smalls[0], enc.smalls[len(enc.smalls) // 2], enc.smalls[-1]]
    phash = [str(imagehash.phash(image.fromarray(s))) for s in picks]
    emb = np.mean(np.stack(enc.feats), axis=0) if enc.feats else np.zeros(1, np.float32)
    norm = float(np.linalg.norm(emb))
    emb = emb / norm if norm > 0 else emb
    thumb = enc.thumb.reformat(width=THUMB_WIDTH, height=max(2, round(THUMB_WIDTH * height / width)),
                               format="rgb24").to_ndarray()
    jpeg = io.BytesIO()
    image.fromarray(thumb).save(jpeg, format="JPEG", quality=80)
    clip = Clip(
        key=f"{sid}-{start:06d}", source=info.source, source_sha256=info.sha256, start_frame=start, end_frame=end,
        start_s=float(enc.t0), end_s=float(enc.t0 + duration), duration_s=float(duration),
        frames=enc.out_n, fps=float(out_rate), width=width, height=height, source_width=info.width,
        source_height=info.height, source_rotation=info.rotation, motion=float(np.mean(enc.diffs)) if enc.diffs else 0.0,
        sharpness=float(np.mean(enc.sharp)) if enc.sharp else 0.0, black_fraction=enc.dark / enc.n,
        content_sha256=enc.sha.hexdigest(), phash=phash, embedding=[float(v) for v in emb],
        thumbnail_jpeg=jpeg.getvalue())
    clip.filter_reasons = filt.decide(clip)
    clip.kept = not clip.filter_reasons
    if clip.kept:
        clip.mp4 = data
        clip.mp4_sha256 = hashlib.sha256(data).hexdigest()
        clip.mp4_size_bytes = len(data)
    if on_clip is not None:
        on_clip(clip)
    return clip


def nvenc_usable() -> bool:
    """Whether FFmpeg's ``h264_nvenc`` encoder is present and opens on this machine (a one-frame
    trial encode; the answer is cached per process)."""
    global _NVENC
    if _NVENC is None:
        import av  # noqa: PLC0415

        try:
            buf = io.BytesIO()
            with av.open(buf, mode="w", format="mp4") as out:
                st = out.add_stream("h264_nvenc", rate=25)
                st.width, st.height, st.pix_fmt = 256, 256, "yuv420p"
                frame = av.VideoFrame.from_ndarray(np.zeros((256, 256, 3), np.uint8), format="rgb24")
                for packet in st.encode(frame.reformat(format="yuv420p")):
                    out.mux(packet)
                for packet in st.encode():
                    out.mux(packet)
            _NVENC = True
        except Exception:  # noqa: BLE001 - missing codec, no GPU, driver too old: all mean "not usable"
            _NVENC = False
    return _NVENC


_NVENC: bool | None = None
