"""Probe a video: container, codec, duration, frame rate, resolution and audio, or a reason to
reject it ([NeMoVideo2025]_ Sec. 2: inputs that cannot be decoded are dropped before splitting).

A rejection is data, not an exception: :func:`probe` returns a :class:`Rejected` row, so one bad
file never stops the others.
"""

from __future__ import annotations

import hashlib
import math
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from paperline.kernels.video.sources import VIDEO_EXTENSIONS



@dataclass(frozen=True)
class VideoInfo:
    """What the probe read from a container.

    Attributes:
        source: The path (or URI) as given.
        sha256: Hex SHA-256 of the file's bytes (cache key and source id).
        size_bytes: File size in bytes.
        container: FFmpeg demuxer name (e.g. ``"mov,mp4,m4a,3gp,3g2,mj2"``).
        codec: Video codec name (e.g. ``"h264"``).
        duration_s: Duration in seconds (container's, else stream's; 0 when unknown).
        fps: Average frame rate in frames per second.
        width, height: Frame size in pixels as displayed: after ``display_filters`` (a phone's
            portrait clip, coded 1920x1080 with a 90 degree display matrix, is 1080x1920).
        frames: Frame count declared by the container (0 when unknown).
        has_audio: Whether the container has an audio stream.
        rotation: The display matrix's rotation in degrees counterclockwise, in [-180, 180], as
            ``ffprobe`` and PyAV's ``VideoFrame.rotation`` report it (``-90`` for a phone held
            upright); 0 when the stream has no display matrix.
        display_filters: The FFmpeg filter chain that turns decoded frames upright (``""``,
            ``"transpose=clock"``, ``"hflip,vflip"``, ...): the one ``ffmpeg`` inserts when it
            autorotates (:func:`autorotate_filters`). Clips are cut from the upright frames.
    """

    source: str
    sha256: str
    size_bytes: int
    container: str
    codec: str
    duration_s: float
    fps: float
    width: int
    height: int
    frames: int
    has_audio: bool
    rotation: int = 0
    display_filters: str = ""

    def as_dict(self) -> dict[str, Any]:
        """The fields as a JSON-able dict."""
        return asdict(self)


@dataclass(frozen=True)
class Rejected:
    """An input that will not be curated, and why.

    Attributes:
        source: The path (or URI) as given.
        reason: One of ``missing``, ``empty_file``, ``unsupported_extension``, ``unreadable``
            (the file's permissions refuse this process), ``not_a_video`` (no demuxer accepts
            it, or the container is truncated), ``no_video_stream``,
            ``unsupported_codec``, ``too_few_frames``, ``decode_error``, ``truncated``, and
            (from the flow's curate task) ``no_clips``: decoded, but every shot is shorter than
            ``min_clip_s``; (from the listing, never probed) ``bad_name``: a name that is not valid
            UTF-8 (:func:`paperline.kernels.video.sources.reject_bad_names`).
        detail: The decoder's message or the numbers behind the decision.
    """

    source: str
    reason: str
    detail: str

    def as_dict(self) -> dict[str, Any]:
        """``{"source", "reason", "detail"}``."""
        return asdict(self)


def display_rotation(matrix: Any) -> float:
    """The rotation of a display matrix, degrees counterclockwise in [-180, 180] (NaN when its
    rotation part is degenerate): FFmpeg's ``av_display_rotation_get`` (libavutil/display.c).

    Args:
        matrix: The ``DISPLAYMATRIX`` side data: 9 int32 (3x3, row major; a, b, c, d in 16.16
            fixed point), as bytes or a sequence.
    """
    m = _matrix(matrix)
    scale0, scale1 = math.hypot(m[0], m[3]), math.hypot(m[1], m[4])
    if scale0 == 0 or scale1 == 0:
        return math.nan
    return -math.degrees(math.atan2(m[1] / scale1, m[0] / scale0))


def autorotate_filters(matrix: Any) -> str:
    """The FFmpeg filter chain that displays frames upright, given their display matrix.

    The same choice as ``ffmpeg``'s autorotation (fftools/ffmpeg_filter.c,
    ``configure_input_video_filter``): a quarter turn is a ``transpose`` (with its flip folded
    in), a half turn ``hflip,vflip``, no turn a ``vflip`` when the matrix mirrors vertically, and
    any other angle FFmpeg's ``rotate`` filter (frame size kept, corners cut).

    Args:
        matrix: ``DISPLAYMATRIX`` side data (see :func:`display_rotation`), or None.

    Returns:
        The filter chain (``","``-separated ``name`` or ``name=argument``), ``""`` for none.
    """
    if matrix is None:
        return ""
    m = _matrix(matrix)
    rot = display_rotation(m)
    if math.isnan(rot):
        return ""
    theta = -round(rot)  # clockwise, as ffmpeg's get_rotation()
    theta -= 360 * math.floor(theta / 360 + 0.9 / 360)
    if abs(theta - 90) < 1.0:
        return "transpose=cclock_flip" if m[3] > 0 else "transpose=clock"
    if abs(theta - 180) < 1.0:
        return ",".join(f for f, flip in (("hflip", m[0] < 0), ("vflip", m[4] < 0)) if flip)
    if abs(theta - 270) < 1.0:
        return "transpose=clock_flip" if m[3] < 0 else "transpose=cclock"
    if abs(theta) > 1.0:
        return f"rotate={theta:g}*PI/180"
    return "vflip" if m[4] < 0 else ""


def _matrix(matrix: Any) -> list[int]:
    """Nine ints from ``DISPLAYMATRIX`` side data (bytes, or already a sequence)."""
    import numpy as np  # noqa: PLC0415

    if isinstance(matrix, (bytes, bytearray, memoryview)) or hasattr(matrix, "buffer_size"):
        m = np.frombuffer(bytes(matrix), dtype="<i4").tolist()
    else:
        m = [int(v) for v in matrix]
    if len(m) != 9:
        raise ValueError(f"a display matrix has 9 entries; got {len(m)}")
    return m


def file_sha256(path: str | Path) -> str:
    """Hex SHA-256 of a file's bytes. Raises OSError when it cannot be read."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def probe(path: str | Path, *, min_frames: int = 2) -> VideoInfo | Rejected:
    """Read a video's container and first video frame.

    Args:
        path: Local file.
        min_frames: Fewest decodable frames a usable video has (a one-frame "video" is an image).

    Returns:
        :class:`VideoInfo`, or :class:`Rejected` with the reason (never raises for bad files).
    """
    import av  # noqa: PLC0415 - PyAV loads FFmpeg; keep `import paperline.kernels.video` light

    p = Path(path)
    src = str(path)
    try:
        found = p.exists()
    except PermissionError as exc:  # a directory on the path that this user may not search
        return _unreadable(src, exc, "a directory on its path")
    if not found:
        return Rejected(src, "missing", missing_detail(p))
    if not p.is_file():  # a FIFO would block the decoder's open until a writer came
        return Rejected(src, "decode_error", "not a regular file (a FIFO, socket or device)")
    size = p.stat().st_size
    if size == 0:
        return Rejected(src, "empty_file", "0 bytes")
    if p.suffix.lower() not in VIDEO_EXTENSIONS:
        return Rejected(src, "unsupported_extension", f"{p.suffix or '(none)'} is not one of {', '.join(VIDEO_EXTENSIONS)}")
    try:
        container = av.open(str(p), metadata_errors="ignore")
    except PermissionError as exc:  # av.error.PermissionError is one too: not a fault of the bytes
        return _unreadable(src, exc, "the file")
    except av.error.FFmpegError as exc:  # InvalidDataError: text, truncated moov, ...
        return Rejected(src, "not_a_video", _message(exc))
    except (OSError, UnicodeDecodeError) as exc:
        return Rejected(src, "not_a_video", _message(exc))
    with container:
        if not container.streams.video:
            kinds = sorted({s.type for s in container.streams}) or ["none"]
            return Rejected(src, "no_video_stream", f"streams: {', '.join(kinds)}")
        stream = container.streams.video[0]
        ctx = stream.codec_context
        codec = getattr(ctx, "name", None) or "none"
        if getattr(ctx, "codec", None) is None or codec == "none":
            tag = getattr(ctx, "codec_tag", "") or "?"
            return Rejected(src, "unsupported_codec", f"no decoder for codec tag {tag!r}")
        width, height = int(ctx.width or 0), int(ctx.height or 0)
        rate = stream.average_rate or stream.guessed_rate or stream.base_rate
        fps = float(rate) if rate else 0.0
        duration = float(container.duration) / 1e6 if container.duration else (
            float(stream.duration * stream.time_base) if stream.duration and stream.time_base else 0.0)
        frames = int(stream.frames or 0)
        has_audio = bool(container.streams.audio)
        # Decode up to min_frames frames: catches a stream the decoder cannot read at all.
        decoded = 0
        matrix = None  # FFmpeg attaches the stream's display matrix to every decoded frame
        try:
            for frame in container.decode(stream):
                if decoded == 0:
                    matrix = frame.side_data.get("DISPLAYMATRIX")
                    matrix = bytes(matrix) if matrix is not None else None
                decoded += 1
                if decoded >= min_frames:
                    break
        except av.error.FFmpegError as exc:
            if decoded == 0:
                return Rejected(src, "decode_error", _message(exc))
        if decoded < min_frames:
            return Rejected(src, "too_few_frames", f"{decoded} decodable frame(s); at least {min_frames} needed")
        if width <= 0 or height <= 0 or fps <= 0:
            return Rejected(src, "decode_error", f"bad stream geometry {width}x{height} at {fps} fps")
    angle = math.nan if matrix is None else display_rotation(matrix)
    rotation = 0 if math.isnan(angle) else round(angle)
    filters = autorotate_filters(matrix)
    if "transpose" in filters:
        width, height = height, width
    return VideoInfo(src, file_sha256(p), size, container.format.name, codec, duration, fps, width, height,
                     frames, has_audio, rotation, filters)


def _unreadable(src: str, exc: OSError, what: str) -> Rejected:
    """``unreadable``, naming the user the (worker) process runs as and what to change."""
    return Rejected(src, "unreadable", f"{_message(exc)} for uid {os.getuid()}, the user this worker runs as: "
                                       f"make {what} readable to it")


def missing_detail(p: Path) -> str:
    """Why a listed path does not exist: a broken or looping symbolic link, or nothing there."""
    import errno  # noqa: PLC0415
    import os  # noqa: PLC0415

    if not p.is_symlink():
        return "no such file"
    try:
        os.stat(p)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return f"a symbolic link loop ({p} -> {os.readlink(p)})"
    return f"a symbolic link to a missing target ({p} -> {os.readlink(p)})"


def _message(exc: BaseException) -> str:
    """The error's own words: for FFmpeg's, its ``strerror`` ("Invalid data found when processing
    input"), without PyAV's ``[Errno 1094995529]`` (the AVERROR code, opaque to a reader) and
    the path the caller names anyway."""
    text = (getattr(exc, "strerror", None) or str(exc)).strip() or type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."
