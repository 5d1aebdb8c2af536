"""Gradient compressors for data-parallel training, each a torch DDP communication hook.

Every compressor is a state class in the :data:`compressors` registry plus the hook that reads it;
:func:`make_hook` builds the pair that ``DistributedDataParallel.register_comm_hook`` takes::

    state, hook = make_hook("fft", theta=0.1, bits=8)
    ddp_model.register_comm_hook(state, hook)
    ...                                     # train; after each backward:
    state.history[-1].bytes_sent            # bytes this rank handed to the collective, that step

=========  =================================================================  ===========
name       what each rank sends per bucket                                    collective
=========  =================================================================  ===========
none       the bucket, divided by the world size (dense mean)                 allreduce
fp16       the bucket in float16 (torch's ``fp16_compress_hook``)             allreduce
fft        top-θ rfft coefficients, range-quantized to ``bits`` [Wang2018]_   allgather
topk       top-k entries, error feedback, values + int32 indices [Lin2018]_   allgather
powersgd   rank-r factors P, Q (torch's ``powerSGD_hook``) [Vogels2019]_      allreduce
=========  =================================================================  ===========

The FFT compressor (see [Wang2018]_, Sec. 3; the steps are labelled F1-F6 in :func:`fft_compress`):

    F1. ``X = rfft(g)`` of the flattened bucket ``g`` zero-padded to a fast FFT length ``n_fft >= n``
        (``scipy.fft.next_fast_len``; ``n_fft`` reals -> ``m = n_fft // 2 + 1`` complex
        frequency coefficients), plus the residual spectrum ``E`` when error feedback is on.
    F2. Sparsify in the frequency domain: keep the ``k = ceil(θ m)`` coefficients of largest
        magnitude ``|X_j|``, in ascending frequency order.
    F3. Range-based quantization of the ``2k`` kept reals (real and imaginary parts, interleaved):
        ``lo, hi = min, max`` of them; ``2^bits`` levels evenly spaced on ``[lo, hi]``;
        ``code = round((v - lo) / step)``, ``step = (hi - lo) / (2^bits - 1)``; decoded
        ``lo + code * step``. The error per value is at most ``step / 2 <= (hi - lo) / 2^bits``.
        ``bits = 32`` means no quantization: the kept values go out as IEEE floats.
    F4. Wire format (one ``uint8`` message per rank and bucket, the same length on every rank, see
        :class:`FFTLayout`): ``[lo, hi as float64 (16 B, absent when bits = 32)]``
        ``[kept frequencies: an m-bit bitmap or k packed (ceil(log2 m))-bit positions, whichever is
        shorter]`` ``[2k codes packed at bits bits each, or 2k raw floats when bits = 32]``.
    F5. Exchange: an allgather of the messages (an allreduce of a densified spectrum would put the
        uncompressed size on the wire).
    F6. Decode every rank's message, sum the sparse spectra, ``irfft`` the sum divided by the
        world size: the mean of the ranks' reconstructions (the transform is linear).

    The imaginary parts of the DC (and, for even ``n``, Nyquist) coefficient of a real signal are
    zero; decoding sets them to exactly zero so ``irfft`` is well defined on every backend.

    Error feedback (optional; the residual memory of [Seide2014]_/[Lin2018]_ in the frequency
    domain): ``E <- X + E - decoded(X + E)`` per bucket, so over any number of steps
    ``sum(sent reconstructions) + irfft(E) == sum(gradients)`` up to float rounding.

What the abstract of [Wang2018]_ leaves open and this module decides: it names "a range-based
floating point representation" of the kept frequencies without its bit layout, so the quantizer
here is the uniform (affine) code over the data's own range ``[lo, hi]`` described in F3, with a
stated error bound; the index encoding (bitmap or packed positions) and the allgather are ours.

Conventions: ``bytes_sent`` is the payload a rank hands to the collective per step (what the
compressor controls); the transport moves about ``2 (P - 1) / P`` times that for a ring allreduce
and ``(P - 1)`` times that for an allgather (equal at ``P = 2``). Seconds are host wall seconds
(``time.perf_counter``); on CUDA kernels run asynchronously, so synchronize around a step to time
device work. Error-feedback compressors run a dense allreduce for the first ``start_iter`` steps
(at least 2): DDP rebuilds its buckets after the first iteration, which would misalign residuals
kept per bucket index (the same rule as torch's ``PowerSGDState``).

NaN/inf gradients are passed through (the mean comes back non-finite, so the training loop can
skip the step) and never enter the residual memory (nor, for ``powersgd``, its warm-start Q);
``state.nonfinite_buckets`` counts them. So is
an ``fft`` bucket whose spectrum overflows its compute dtype (float32 entries near ``3e38``: the
rfft sums them); the range quantizer itself handles every finite range (F3). A corrupt message
(an index out of range; the compressors never write one) makes ``fft_decompress``/
``topk_decompress`` raise InputError; inside the hooks, which never wait for the device, it makes
the bucket's mean NaN instead.

torch is imported lazily (``kernels/`` modules import no backend at module top), so listing the
compressors costs nothing.

.. [Wang2018] L. Wang, W. Wu, J. Zhang, H. Liu, G. Bosilca, M. Herlihy, R. Fonseca. "SuperNeurons:
   FFT-based Gradient Sparsification in the Distributed Training of Deep Neural Networks."
   arXiv:1811.08596, 2018.
.. [Lin2018] Y. Lin, S. Han, H. Mao, Y. Wang, W. Dally. "Deep Gradient Compression: Reducing the
   Communication Bandwidth for Distributed Training." ICLR 2018.
.. [Seide2014] F. Seide, H. Fu, J. Droppo, G. Li, D. Yu. "1-Bit Stochastic Gradient Descent and its
   Application to Data-Parallel Distributed Training of Speech DNNs." Interspeech 2014.
.. [Vogels2019] T. Vogels, S. P. Karimireddy, M. Jaggi. "PowerSGD: Practical Low-Rank Gradient
   Compression for Distributed Optimization." NeurIPS 2019.
"""

from __future__ import annotations

import functools
import inspect
import logging
import math
import threading
import time
from dataclasses import dataclass
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Callable, ClassVar, NamedTuple

from paperline.kernels.errors import Described, InputError, as_float, check_int, is_real, unknown_name
from paperline.kernels.registry import Registry

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "compressors",
    "make_hook",
    "compressor_names",
    "CompressorState",
    "AllreduceState",
    "FP16State",
    "FFTState",
    "TopKState",
    "PowerSGDCompressorState",
    "StepStats",
    "FFTLayout",
    "TopKLayout",
    "FFTCompressed",
    "TopKCompressed",
    "pack_bits",
    "unpack_bits",
    "range_quantize",
    "range_dequantize",
    "range_quantization_bound",
    "fft_compress",
    "fft_decode",
    "fft_decompress",
    "topk_compress",
    "topk_decode",
    "topk_decompress",
]

#: name -> state class; ``cls.hook(state, bucket)`` is the DDP communication hook.
compressors: Registry[type["CompressorState"]] = Registry("compressor")

HEADER_NBYTES = 16  # lo, hi of the range quantizer as two little-endian float64


# --------------------------------------------------------------------------------------------------
# Validation helpers


def _check_fraction(argument: str, value: object) -> float:
    if not is_real(value) or not math.isfinite(float(value)):
        raise InputError(argument, value, "must be a finite number in (0, 1]")
    if not 0.0 < float(value) <= 1.0:
        raise InputError(argument, value, "must be in (0, 1]")
    return as_float(value)


def _check_bool(argument: str, value: object) -> bool:
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool", "bool_"):
        value = bool(value)  # a NumPy bool scalar, as numpy comparisons return it
    if not isinstance(value, bool):
        raise InputError(argument, value, "must be True or False")
    return value


def _check_residual(residual: object, shape: tuple[int, ...], dtype: "torch.dtype", like: "torch.Tensor") -> None:
    """Refuse an error-feedback residual that is not what the compressor keeps: a tensor of
    ``shape`` and ``dtype`` on ``like``'s device (a residual of another dtype would change the
    payload's bytes or the dtype of the residual handed back)."""
    import torch

    if not isinstance(residual, torch.Tensor):
        raise InputError("residual", type(residual).__name__, "must be a torch.Tensor or None")
    if tuple(residual.shape) != shape or residual.dtype != dtype or residual.device != like.device:
        seen = f"{str(residual.dtype).replace('torch.', '')} {tuple(residual.shape)} on {residual.device}"
        want = f"{str(dtype).replace('torch.', '')} {shape} on {like.device}"
        raise InputError("residual", seen, f"must be {want}: the residual this compressor returned for the same "
                                           "bucket (its compute dtype follows the gradient's)")


def _check_bits(value: object) -> int:
    return check_int("bits", value, 1, 32)


def _start_iter(value: object, error_feedback: bool) -> int:
    if value is None:
        return 2 if error_feedback else 0
    start = check_int("start_iter", value, 0)
    if error_feedback and start < 2:
        raise InputError(
            "start_iter", value,
            "must be >= 2 with error_feedback: DDP rebuilds its buckets after the first iteration, "
            "which would misalign residuals kept per bucket (torch's PowerSGDState has the same rule)",
        )
    return start


def _compute_dtype(dtype: "torch.dtype") -> "torch.dtype":
    """float64 stays float64; every other floating dtype is computed in float32."""
    import torch

    if not dtype.is_floating_point:
        raise InputError("dtype", dtype, "gradients must be a floating-point tensor")
    return torch.float64 if dtype == torch.float64 else torch.float32


def _value_dtype(dtype: "torch.dtype | None", itemsize: int) -> "torch.dtype":
    """The dtype a message's values are read as: float32 or float64 of the layout's value size
    (another dtype reinterpreted the bytes, e.g. int32 gave 1072318574 for 1.8: a trial)."""
    import torch

    want = torch.float64 if itemsize == 8 else torch.float32
    if dtype is None:
        return want
    if dtype not in (torch.float32, torch.float64):
        raise InputError("dtype", dtype, "must be torch.float32 or torch.float64 (or None: the layout's)")
    if torch.empty(0, dtype=dtype).element_size() != itemsize:
        raise InputError("dtype", dtype, f"the layout's values are {itemsize}-byte floats: use {want} (or None)")
    return dtype


def _flat(x: "torch.Tensor", argument: str = "x") -> "torch.Tensor":
    import torch

    if not isinstance(x, torch.Tensor):
        raise InputError(argument, type(x).__name__, "must be a torch.Tensor")
    if x.numel() == 0:
        raise InputError(argument, tuple(x.shape), "must not be empty")
    return x.reshape(-1).to(_compute_dtype(x.dtype))


# --------------------------------------------------------------------------------------------------
# Bit packing (LSB-first bit stream)


def _byte_windows(bits: int) -> int:
    # a code of `bits` bits starting at bit offset 0..7 of a byte spans at most this many bytes
    return (bits + 7 + 7) // 8


def pack_bits(codes: "torch.Tensor", bits: int) -> "torch.Tensor":
    """Pack unsigned codes into an LSB-first bit stream, ``bits`` bits each.

    Code ``i`` occupies stream bits ``[i * bits, (i + 1) * bits)``; stream bit ``p`` is bit
    ``p % 8`` of byte ``p // 8``. Each code is shifted by its bit offset into an int64 and its (at
    most 5) bytes are added into place; codes do not overlap, so the adds act as ORs.

    Args:
        codes: ``N`` integer tensor with values in ``[0, 2^bits)`` (values outside are masked).
        bits: code width, 1 to 32.

    Returns:
        ``ceil(N * bits / 8)`` uint8 tensor on ``codes.device``.

    Raises:
        InputError: ``bits`` not an integer in 1-32, or ``codes`` not an integer torch.Tensor
            (floating or complex refused).
    """
    import torch

    bits = _check_bits(bits)
    if not isinstance(codes, torch.Tensor) or codes.dtype.is_floating_point or codes.dtype.is_complex:
        shown = codes.dtype if isinstance(codes, torch.Tensor) else type(codes).__name__
        raise InputError("codes", shown, "must be an integer torch.Tensor (a float code was truncated)")
    n = codes.numel()
    nbytes = (n * bits + 7) // 8
    if n == 0:
        return torch.zeros(0, dtype=torch.uint8, device=codes.device)
    c = codes.reshape(-1).to(torch.int64) & ((1 << bits) - 1)
    if 8 % bits == 0:  # 1, 2, 4, 8 bits: whole codes per byte, the same stream with fewer ops
        per = 8 // bits
        c = torch.cat([c, c.new_zeros(nbytes * per - n)]).view(nbytes, per)
        shifts = torch.arange(per, device=codes.device, dtype=torch.int64) * bits
        return (c << shifts).sum(dim=1).to(torch.uint8)
    pos = torch.arange(n, device=codes.device, dtype=torch.int64) * bits
    start, shift = pos >> 3, pos & 7
    v = c << shift
    windows = _byte_windows(bits)
    out = torch.zeros(nbytes + windows, dtype=torch.int64, device=codes.device)
    for j in range(windows):
        out.index_add_(0, start + j, (v >> (8 * j)) & 0xFF)
    return out[:nbytes].to(torch.uint8)


def unpack_bits(stream: "torch.Tensor", bits: int, count: int) -> "torch.Tensor":
    """Inverse of :func:`pack_bits`.

    Args:
        stream: uint8 tensor of at least ``ceil(count * bits / 8)`` bytes.
        bits: code width, 1 to 32.
        count: number of codes ``N`` to read.

    Returns:
        ``N`` int64 tensor of codes in ``[0, 2^bits)``, on ``stream.device``.

    Raises:
        InputError: ``bits`` not an integer in 1-32, ``count`` not an integer >= 0, or
            ``stream`` shorter than ``ceil(count * bits / 8)`` bytes.
    """
    import torch

    bits = _check_bits(bits)
    count = check_int("count", count, 0)
    if count == 0:
        return torch.zeros(0, dtype=torch.int64, device=stream.device)
    nbytes = (count * bits + 7) // 8
    if stream.numel() < nbytes:
        raise InputError("stream", stream.numel(), f"needs {nbytes} bytes for {count} codes of {bits} bits")
    if 8 % bits == 0:
        per = 8 // bits
        shifts = torch.arange(per, device=stream.device, dtype=torch.int64) * bits
        b = stream.reshape(-1)[:nbytes].to(torch.int64).unsqueeze(1)
        return ((b >> shifts) & ((1 << bits) - 1)).reshape(-1)[:count]
    windows = _byte_windows(bits)
    s = torch.cat([stream.reshape(-1)[:nbytes].to(torch.int64),
                   torch.zeros(windows, dtype=torch.int64, device=stream.device)])
    pos = torch.arange(count, device=stream.device, dtype=torch.int64) * bits
    start, shift = pos >> 3, pos & 7
    v = torch.zeros(count, dtype=torch.int64, device=stream.device)
    for j in range(windows):
        v |= s[start + j] << (8 * j)
    return (v >> shift) & ((1 << bits) - 1)


# --------------------------------------------------------------------------------------------------
# Range-based quantizer (F3)


def range_quantize(values: "torch.Tensor", bits: int) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """Uniform quantization over the values' own range ``[lo, hi]`` with ``2^bits`` levels (F3).

    ``step = (hi - lo) / (2^bits - 1)``, ``code = round((v - lo) / step)``; all codes are 0 when
    ``hi == lo``. Computed in float64, so the codes are exact for every width up to 31 bits.
    When ``hi - lo`` overflows float64 (finite values of both signs beyond ``±9e307``, e.g.
    ``[-1e308, 1e308]``), everything is computed on the values halved (exact in binary floating
    point), so finite input always quantizes within :func:`range_quantization_bound`; otherwise
    the scale is 1 and the arithmetic is the plain formula above.

    Args:
        values: ``N`` floating tensor.
        bits: code width, 1 to 31.

    Returns:
        ``(codes, lo, hi)``: ``N`` int64 codes in ``[0, 2^bits)`` and 0-d float64 ``lo``, ``hi``
        on ``values.device``. Non-finite input (NaN or inf) gives non-finite ``lo``/``hi`` (and
        code 0), so decoding returns NaN instead of a plausible wrong number; finite input never
        does.

    Raises:
        InputError: ``bits`` outside 1-31, ``values`` not a tensor or empty.
    """
    import torch

    bits = check_int("bits", bits, 1, 31)
    if not isinstance(values, torch.Tensor):
        raise InputError("values", type(values).__name__, "must be a torch.Tensor")
    v = values.reshape(-1).to(torch.float64)
    if v.numel() == 0:
        raise InputError("values", tuple(values.shape), "must not be empty")
    lo, hi = torch.aminmax(v)  # NaN propagates to both
    levels = (1 << bits) - 1
    scale = _range_scale(lo, hi)
    lo_s = lo * scale
    step = (hi * scale - lo_s) / levels
    safe = torch.where(step > 0, step, torch.ones_like(step))
    q = torch.round((v * scale - lo_s) / safe).clamp_(0, levels)
    q = torch.where(torch.isfinite(q) & (step > 0), q, torch.zeros_like(q))
    return q.to(torch.int64), lo, hi


def _range_scale(lo: "torch.Tensor", hi: "torch.Tensor") -> "torch.Tensor":
    """0.5 where ``hi - lo`` overflows float64 for finite ``lo``, ``hi`` (the quantizer then works
    on halved values, exactly representable), else 1.0 (a multiply by 1 changes no bit)."""
    import torch

    overflow = torch.isinf(hi - lo) & torch.isfinite(lo) & torch.isfinite(hi)
    return torch.where(overflow, torch.full_like(lo, 0.5), torch.ones_like(lo))


def range_dequantize(codes: "torch.Tensor", lo: "torch.Tensor", hi: "torch.Tensor", bits: int) -> "torch.Tensor":
    """Decode :func:`range_quantize`: ``lo + code * (hi - lo) / (2^bits - 1)``.

    When ``hi - lo`` overflows float64 the same formula is evaluated on ``lo / 2`` and ``hi / 2``
    and the result doubled (see :func:`range_quantize`).

    Args:
        codes: ``N`` integer codes; lo, hi: 0-d float64 tensors; bits: code width, 1 to 31.

    Returns:
        ``N`` float64 tensor.

    Raises:
        InputError: ``bits`` outside 1-31.
    """
    import torch

    bits = check_int("bits", bits, 1, 31)
    lo, hi = lo.to(torch.float64), hi.to(torch.float64)
    scale = _range_scale(lo, hi)
    lo_s = lo * scale
    step = (hi * scale - lo_s) / ((1 << bits) - 1)
    return (lo_s + codes.to(torch.float64) * step) / scale


def range_quantization_bound(lo: float, hi: float, bits: int) -> float:
    """The worst-case error per value of :func:`range_quantize`, stated as ``(hi - lo) / 2^bits``.

    The exact worst case is half a step, ``(hi - lo) / (2 (2^bits - 1))``, which is at most the
    stated bound for every ``bits >= 1``. Units: those of the values. Evaluated as
    ``hi / 2^bits - lo / 2^bits`` when ``hi - lo`` overflows (the same number: dividing by a power
    of two is exact), so it stays finite for a range wider than the largest float, e.g.
    ``[-1e308, 1e308]``.

    Raises:
        InputError: ``bits`` outside 1-31, ``lo``/``hi`` not real numbers (NaN included) or
            ``lo > hi``.
    """
    scale = float(2 ** check_int("bits", bits, 1, 31))
    for name, v in (("lo", lo), ("hi", hi)):
        if not is_real(v) or math.isnan(float(v)):
            raise InputError(name, v, "must be a real number")
    lo, hi = float(lo), float(hi)
    if lo > hi:
        raise InputError("lo", lo, f"must be <= hi ({hi}): the range is [lo, hi]")
    bound = (hi - lo) / scale
    if math.isinf(bound) and math.isfinite(lo) and math.isfinite(hi):
        bound = hi / scale - lo / scale
    return bound


# --------------------------------------------------------------------------------------------------
# FFT compressor (F1-F6)


@functools.lru_cache(maxsize=1024)
def _fast_len(n: int) -> int:
    from scipy.fft import next_fast_len

    return int(next_fast_len(n, real=True))


@dataclass(frozen=True)
class FFTLayout:
    """The wire format of one FFT-compressed bucket (F4); a pure function of ``(n, θ, bits)``.

    Attributes:
        n: bucket length (number of gradient elements).
        theta: fraction of the ``m`` frequency coefficients kept, in (0, 1].
        bits: bits per quantized real value, 1 to 32 (32: raw floats, no quantization).
        value_itemsize: bytes of a raw float when ``bits == 32`` (4 for float32 compute, 8 for
            float64).

    Raises:
        InputError: ``n`` < 1, θ outside (0, 1], ``bits`` outside 1-32, or ``value_itemsize`` not
            4 or 8.
    """

    n: int
    theta: float
    bits: int
    value_itemsize: int = 4

    def __post_init__(self) -> None:
        check_int("n", self.n, 1)
        _check_fraction("theta", self.theta)
        _check_bits(self.bits)
        if self.value_itemsize not in (4, 8):
            raise InputError("value_itemsize", self.value_itemsize, "must be 4 or 8")

    @property
    def n_fft(self) -> int:
        """Transform length: the smallest length >= ``n`` that FFT libraries handle fast (5-smooth
        for real input, ``scipy.fft.next_fast_len``); the bucket is zero-padded to it. A bucket of
        19,706 floats (2 x 59 x 167) took 1.4 ms per rfft, 20x the padded length's."""
        return _fast_len(self.n)

    @property
    def m(self) -> int:
        """Number of rfft coefficients, ``n_fft // 2 + 1``."""
        return self.n_fft // 2 + 1

    @property
    def k(self) -> int:
        """Coefficients kept, ``ceil(θ m)`` clipped to ``[1, m]`` (a 1e-9 slack absorbs float noise)."""
        return max(1, min(self.m, math.ceil(self.theta * self.m - 1e-9)))

    @property
    def quantized(self) -> bool:
        """Whether the kept reals are range-quantized (F3): ``bits < 32``."""
        return self.bits < 32

    @property
    def index_bits(self) -> int:
        """Bits of one packed position, ``ceil(log2 m)`` (at least 1)."""
        return max(1, (self.m - 1).bit_length())

    @property
    def index_encoding(self) -> str:
        """``"bitmap"`` (m bits) or ``"positions"`` (k * index_bits bits), whichever is shorter."""
        bitmap = (self.m + 7) // 8
        positions = (self.k * self.index_bits + 7) // 8
        return "bitmap" if bitmap <= positions else "positions"

    @property
    def header_nbytes(self) -> int:
        """Bytes of the ``lo, hi`` float64 header: 16 when quantized, else 0."""
        return HEADER_NBYTES if self.quantized else 0

    @property
    def index_nbytes(self) -> int:
        """Bytes of the kept-frequency index (:attr:`index_encoding`), rounded up to whole bytes."""
        if self.index_encoding == "bitmap":
            return (self.m + 7) // 8
        return (self.k * self.index_bits + 7) // 8

    @property
    def value_nbytes(self) -> int:
        """Bytes of the ``2k`` kept reals: ``ceil(2k * bits / 8)`` quantized, else
        ``2k * value_itemsize``."""
        if self.quantized:
            return (2 * self.k * self.bits + 7) // 8
        return 2 * self.k * self.value_itemsize

    @property
    def nbytes(self) -> int:
        """Bytes of one rank's message for this bucket (what goes into the allgather)."""
        return self.header_nbytes + self.index_nbytes + self.value_nbytes


class FFTCompressed(NamedTuple):
    """What :func:`fft_compress` returns for one bucket on one rank.

    Attributes:
        payload: ``layout.nbytes`` uint8 message (F4).
        indices: ``k`` int64 kept frequencies, ascending.
        values: ``k`` complex tensor, the kept coefficients as the receivers decode them.
        residual: ``m`` complex residual spectrum for the next step (``X + E - decoded``), or
            ``None`` when no residual was passed in (error feedback off).
        finite: 0-d bool tensor, False when the input had NaN/inf (the residual is then the one
            passed in, unchanged).
        layout: the :class:`FFTLayout`.
    """

    payload: "torch.Tensor"
    indices: "torch.Tensor"
    values: "torch.Tensor"
    residual: "torch.Tensor | None"
    finite: "torch.Tensor"
    layout: FFTLayout


def _zero_real_bins(values: "torch.Tensor", indices: "torch.Tensor", n: int) -> "torch.Tensor":
    """Set the imaginary part of the DC and (even ``n``) Nyquist coefficients to exactly zero."""
    import torch

    real_bin = indices == 0
    if n % 2 == 0:
        real_bin = real_bin | (indices == n // 2)
    return torch.where(real_bin, torch.complex(values.real, torch.zeros_like(values.real)), values)


def fft_compress(
    x: "torch.Tensor", *, theta: float, bits: int, residual: "torch.Tensor | None" = None
) -> FFTCompressed:
    """Compress one flattened gradient bucket in the frequency domain. See [Wang2018]_, Sec. 3.

    Args:
        x: gradient, any shape with ``n`` elements, floating dtype (computed in float32, or
            float64 for float64 input).
        theta: fraction of frequency coefficients kept, in (0, 1].
        bits: bits per quantized real value, 1 to 32 (32: no quantization). Python or NumPy
            integers.
        residual: ``m = n_fft // 2 + 1`` complex residual spectrum from the previous step (error
            feedback), or None: complex64 for float32 compute, complex128 for float64, on
            ``x.device`` -- what the previous call returned as ``residual``.

    Returns:
        :class:`FFTCompressed`. ``finite`` is False when the kept spectrum is not finite: NaN/inf
        in ``x`` or ``residual``, or a spectrum that overflows the compute dtype (a float32 bucket
        whose coefficients exceed about ``3.4e38``, e.g. entries near ``3e38``: compress such
        buckets in float64); its reconstruction is then non-finite, as for a NaN gradient.

    Raises:
        InputError: bad θ, bits, empty or non-floating ``x``, or a residual that is not a tensor
            of shape ``(m,)``, of the complex dtype above and on ``x``'s device.
    """
    import torch

    xr = _flat(x)
    layout = FFTLayout(xr.numel(), _check_fraction("theta", theta), _check_bits(bits), xr.element_size())
    n, m, k = layout.n_fft, layout.m, layout.k
    if residual is not None:
        ctype = torch.complex128 if xr.dtype == torch.float64 else torch.complex64
        _check_residual(residual, (m,), ctype, xr)
    # F1. spectrum of the bucket (zero-padded to the fast length n_fft), plus the remembered residual
    spectrum = torch.fft.rfft(xr, n=n)
    if residual is not None:
        spectrum = spectrum + residual
    # F2. keep the k coefficients of largest magnitude, in ascending frequency order
    if k == m:
        indices = torch.arange(m, device=xr.device)
    else:
        indices = torch.topk(spectrum.abs(), k, sorted=False).indices.sort().values
    kept = torch.view_as_real(spectrum[indices]).reshape(-1)  # 2k reals: re0, im0, re1, im1, ...
    finite = torch.isfinite(kept).all()
    # F3. range-based quantization of the kept reals
    if layout.quantized:
        codes, lo, hi = range_quantize(kept, layout.bits)
        header = torch.stack([lo, hi]).to(torch.float64).view(torch.uint8)
        value_bytes = pack_bits(codes, layout.bits)
        decoded = range_dequantize(codes, lo, hi, layout.bits).to(xr.dtype)
    else:
        header = torch.zeros(0, dtype=torch.uint8, device=xr.device)
        value_bytes = kept.contiguous().view(torch.uint8)
        decoded = kept
    values = _zero_real_bins(torch.view_as_complex(decoded.reshape(k, 2).contiguous()), indices, n)
    # F4. one message: header | kept frequencies | values
    if layout.index_encoding == "bitmap":
        mask = torch.zeros(m, dtype=torch.int64, device=xr.device)
        mask[indices] = 1
        index_bytes = pack_bits(mask, 1)
    else:
        index_bytes = pack_bits(indices, layout.index_bits)
    payload = torch.cat([header, index_bytes, value_bytes])
    if payload.numel() != layout.nbytes:  # an internal invariant (inputs are checked above), kept under -O
        raise RuntimeError(f"fft_compress wrote {payload.numel()} bytes, its layout says {layout.nbytes}: {layout}")
    # error feedback: what was not sent (dropped coefficients and quantization error) is remembered
    new_residual = None
    if residual is not None:
        new_residual = spectrum
        new_residual[indices] = spectrum[indices] - values
        new_residual = torch.where(finite, new_residual, residual)
    return FFTCompressed(payload, indices, values, new_residual, finite, layout)


def _check_payload(argument: str, payload: object, nbytes: int) -> None:
    import torch

    if not isinstance(payload, torch.Tensor):
        raise InputError(argument, type(payload).__name__, f"must be a tensor of {nbytes} uint8 bytes")
    if payload.dtype != torch.uint8 or payload.numel() != nbytes:
        raise InputError(argument, (payload.dtype, payload.numel()), f"must be {nbytes} uint8 bytes")


_CORRUPT = "the message is corrupt or was written with another layout"


def _out_of_range(indices: "torch.Tensor", size: int) -> "torch.Tensor":
    """0-d bool tensor: some position is outside ``[0, size)`` (computed on the device, no sync)."""
    return ((indices < 0) | (indices >= size)).any()


def _raise_out_of_range(argument: str, indices: "torch.Tensor", size: int, what: str) -> None:
    bad = (indices < 0) | (indices >= size)
    if bool(bad.any()):  # one host sync
        raise InputError(argument, Described(f"{what} {int(indices[bad][0])}"), f"out of range [0, {size}): {_CORRUPT}")


def _fft_decode(payload: "torch.Tensor", layout: FFTLayout, dtype: "torch.dtype | None", argument: str,
                check: bool = True) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """``(indices, values, corrupt)``; with ``check`` a corrupt message raises (one host sync),
    without it ``corrupt`` (a 0-d bool tensor) says so and the caller must not use the rest."""
    import torch

    dtype = _value_dtype(dtype, layout.value_itemsize)
    _check_payload(argument, payload, layout.nbytes)
    k, m = layout.k, layout.m
    off = layout.header_nbytes
    section = payload[off:off + layout.index_nbytes]
    if layout.index_encoding == "bitmap":
        mask = unpack_bits(section, 1, m)
        if k < m:
            ones = mask.sum()
            corrupt = ones != k
            if check and bool(corrupt):
                raise InputError(argument, Described(f"{int(ones)} frequencies marked in its bitmap"),
                                 f"must mark exactly k = {k} of the m = {m} frequencies: {_CORRUPT}")
            indices = torch.nonzero_static(mask, size=k).reshape(-1)
        else:
            indices = torch.arange(m, device=payload.device)
            corrupt = torch.zeros((), dtype=torch.bool, device=payload.device)
    else:
        indices = unpack_bits(section, layout.index_bits, k)
        if check:
            _raise_out_of_range(argument, indices, m, "frequency")
        corrupt = _out_of_range(indices, m)
    off += layout.index_nbytes
    section = payload[off:off + layout.value_nbytes]
    if layout.quantized:
        lo, hi = payload[:HEADER_NBYTES].clone().view(torch.float64)
        codes = unpack_bits(section, layout.bits, 2 * k)
        values = range_dequantize(codes, lo, hi, layout.bits).to(dtype)
    else:
        values = section.clone().view(dtype)
    values = _zero_real_bins(torch.view_as_complex(values.reshape(k, 2).contiguous()), indices, layout.n_fft)
    return indices, values, corrupt


def fft_decode(payload: "torch.Tensor", layout: FFTLayout, dtype: "torch.dtype | None" = None
               ) -> tuple["torch.Tensor", "torch.Tensor"]:
    """Decode one rank's message (F4 -> F6).

    Args:
        payload: ``layout.nbytes`` uint8 tensor.
        layout: the :class:`FFTLayout` it was written with.
        dtype: real compute dtype (float32 or float64); default from ``layout.value_itemsize``.

    Returns:
        ``(indices, values)``: ``k`` int64 ascending frequencies and ``k`` complex coefficients.

    Raises:
        InputError: naming ``payload``: not ``layout.nbytes`` uint8 bytes, or corrupt (a packed
            frequency outside ``[0, m)``, or a bitmap that does not mark exactly ``k`` frequencies).
            The index check reads one number back to the host (a device sync on GPU).
    """
    indices, values, _ = _fft_decode(payload, layout, dtype, "payload")
    return indices, values


def _check_payloads(payloads: object) -> None:
    import torch

    if not isinstance(payloads, torch.Tensor) or payloads.dim() != 2 or payloads.shape[0] < 1:
        shown = tuple(payloads.shape) if isinstance(payloads, torch.Tensor) else type(payloads).__name__
        raise InputError("payloads", shown, "must be P x nbytes with P >= 1")


def _refuse_corrupt_rows(decode: Callable, payloads: "torch.Tensor", corrupt: list["torch.Tensor"]) -> None:
    """Raise the error of the first corrupt row (one host sync for all rows when none is)."""
    import torch

    flags = torch.stack(corrupt)
    if bool(flags.any()):
        r = int(flags.nonzero()[0, 0])
        decode(payloads[r], f"payloads[{r}]")  # raises the row's precise InputError
        raise InputError(f"payloads[{r}]", Described("corrupt message"), _CORRUPT)  # pragma: no cover - decode raised


def fft_decompress(payloads: "torch.Tensor", layout: FFTLayout, dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """Mean of the ranks' reconstructions from their gathered messages (F6).

    Args:
        payloads: ``P x layout.nbytes`` uint8, row ``r`` the message of rank ``r``.
        layout: the :class:`FFTLayout` of the bucket.
        dtype: real compute dtype; default from the layout.

    Returns:
        ``n`` tensor of the compute dtype: ``irfft(sum_r spectrum_r / P, n_fft)[:n]``.

    Raises:
        InputError: ``payloads`` not a 2-D tensor with at least one row, or a row that
            :func:`fft_decode` refuses (named ``payloads[r]``; one host sync checks every row).
    """
    return _fft_decompress(payloads, layout, dtype, strict=True)


def _fft_decompress(payloads: "torch.Tensor", layout: FFTLayout, dtype: "torch.dtype | None", *, strict: bool
                    ) -> "torch.Tensor":
    """:func:`fft_decompress`; ``strict=False`` (the hook) never syncs with the device: a corrupt
    row makes the whole result NaN instead of raising."""
    import torch

    decode = functools.partial(_fft_decode, layout=layout, dtype=dtype)
    spectrum, bad = _mean_of_rows(decode, payloads, layout.m, strict)
    return _nan_where(bad, torch.fft.irfft(spectrum, n=layout.n_fft)[: layout.n])


def _mean_of_rows(decode: Callable, payloads: "torch.Tensor", size: int, strict: bool
                  ) -> tuple["torch.Tensor", "torch.Tensor | None"]:
    """The mean over the rows of ``payloads`` of each row's ``(indices, values)`` scattered into
    ``size`` zeros, and (``strict=False``) the flag of a corrupt row, else None.

    ``decode(payload, argument=..., check=...)`` is :func:`_fft_decode` or :func:`_topk_decode`
    with its layout. ``strict``: a corrupt row raises (one host sync checks every row); else its
    indices are replaced by 0 (an out-of-range index_add_ is a device-side assert on CUDA) and the
    flag returned, for :func:`_nan_where`, without a sync.
    """
    import torch

    _check_payloads(payloads)
    world = payloads.shape[0]
    rows = [decode(payloads[r], argument=f"payloads[{r}]", check=False) for r in range(world)]
    if strict:
        _refuse_corrupt_rows(lambda row, argument: decode(row, argument=argument), payloads,
                             [corrupt for _, _, corrupt in rows])
    total, bad = None, None
    for indices, values, corrupt in rows:
        if total is None:
            total = torch.zeros(size, dtype=values.dtype, device=values.device)
        if not strict:
            indices = torch.where(corrupt, torch.zeros_like(indices), indices)
            bad = corrupt if bad is None else bad | corrupt
        total.index_add_(0, indices, values)
    return total / world, bad


def _nan_where(bad: "torch.Tensor | None", out: "torch.Tensor") -> "torch.Tensor":
    """``out``, or all NaN where ``bad`` (a 0-d bool tensor) is set; None: ``out``."""
    import torch

    return out if bad is None else torch.where(bad, torch.full_like(out, math.nan), out)


# --------------------------------------------------------------------------------------------------
# Top-k compressor


@dataclass(frozen=True)
class TopKLayout:
    """Wire format of one top-k bucket: ``k`` values then ``k`` int32 indices (little endian).

    Attributes:
        n: bucket length; fraction: kept fraction in (0, 1]; value_itemsize: 4 (float32) or 8.

    Raises:
        InputError: ``n`` outside ``[1, 2^31 - 1]`` (int32 indices), ``fraction`` outside (0, 1],
            or ``value_itemsize`` not 4 or 8.
    """

    n: int
    fraction: float
    value_itemsize: int = 4

    def __post_init__(self) -> None:
        check_int("n", self.n, 1, 2**31 - 1)
        _check_fraction("fraction", self.fraction)
        if self.value_itemsize not in (4, 8):
            raise InputError("value_itemsize", self.value_itemsize, "must be 4 or 8")

    @property
    def k(self) -> int:
        """Entries sent, ``ceil(fraction n)`` clipped to ``[1, n]``."""
        return max(1, min(self.n, math.ceil(self.fraction * self.n - 1e-9)))

    @property
    def nbytes(self) -> int:
        """Message bytes, ``k * (value_itemsize + 4)``."""
        return self.k * (self.value_itemsize + 4)


class TopKCompressed(NamedTuple):
    """What :func:`topk_compress` returns: ``payload`` (``layout.nbytes`` uint8), ``indices``
    (``k`` int64), ``values`` (``k``), ``residual`` (``n`` or None), ``finite`` (0-d bool), layout."""

    payload: "torch.Tensor"
    indices: "torch.Tensor"
    values: "torch.Tensor"
    residual: "torch.Tensor | None"
    finite: "torch.Tensor"
    layout: TopKLayout


def topk_compress(x: "torch.Tensor", *, fraction: float, residual: "torch.Tensor | None" = None) -> TopKCompressed:
    """Top-k sparsification with error feedback (DGC's residual memory, [Lin2018]_ Sec. 3.1).

    ``u = x + residual``; send the ``k`` entries of largest ``|u|``; the new residual is ``u`` with
    those entries zeroed.

    Args:
        x: gradient with ``n`` elements, floating (float32 compute, float64 kept).
        fraction: kept fraction in (0, 1] (a Python or NumPy number).
        residual: ``n`` residual of the previous step, or None (no error feedback): of the compute
            dtype (float32, or float64 for float64 ``x``) and on ``x.device`` -- what the previous
            call returned as ``residual``.

    Returns:
        :class:`TopKCompressed`.

    Raises:
        InputError: bad fraction, empty or non-floating ``x``, or a residual that is not a tensor
            of shape ``(n,)``, of the compute dtype and on ``x``'s device.
    """
    import torch

    u = _flat(x)
    layout = TopKLayout(u.numel(), _check_fraction("fraction", fraction), u.element_size())
    if residual is not None:
        _check_residual(residual, (layout.n,), u.dtype, u)
        u = u + residual
    indices = torch.topk(u.abs(), layout.k, sorted=False).indices
    values = u[indices]
    finite = torch.isfinite(u).all()
    payload = torch.cat([values.contiguous().view(torch.uint8), indices.to(torch.int32).view(torch.uint8)])
    if payload.numel() != layout.nbytes:  # an internal invariant (inputs are checked above)
        raise RuntimeError(f"topk_compress wrote {payload.numel()} bytes, its layout says {layout.nbytes}: {layout}")
    new_residual = None
    if residual is not None:
        new_residual = u  # a fresh tensor (x + residual); the values were copied out above
        new_residual[indices] = 0
        new_residual = torch.where(finite, new_residual, residual)
    return TopKCompressed(payload, indices, values, new_residual, finite, layout)


def _topk_decode(payload: "torch.Tensor", layout: TopKLayout, dtype: "torch.dtype | None", argument: str,
                 check: bool = True) -> tuple["torch.Tensor", "torch.Tensor", "torch.Tensor"]:
    """``(indices, values, corrupt)``, as :func:`_fft_decode`."""
    import torch

    dtype = _value_dtype(dtype, layout.value_itemsize)
    _check_payload(argument, payload, layout.nbytes)
    split = layout.k * layout.value_itemsize
    values = payload[:split].clone().view(dtype)
    indices = payload[split:].clone().view(torch.int32).to(torch.int64)
    if check:
        _raise_out_of_range(argument, indices, layout.n, "index")
    return indices, values, _out_of_range(indices, layout.n)


def topk_decode(payload: "torch.Tensor", layout: TopKLayout, dtype: "torch.dtype | None" = None
                ) -> tuple["torch.Tensor", "torch.Tensor"]:
    """``(indices, values)``, ``k`` each, from one rank's message.

    Args:
        payload: ``layout.nbytes`` uint8 tensor (``k`` values, then ``k`` int32 indices).
        layout: the :class:`TopKLayout` it was written with.
        dtype: value dtype (float32 or float64); default from ``layout.value_itemsize``.

    Returns:
        ``(indices, values)``: ``k`` int64 positions in ``[0, n)`` and ``k`` values.

    Raises:
        InputError: naming ``payload``: not ``layout.nbytes`` uint8 bytes, or corrupt (an index
            outside ``[0, n)``). The index check reads one number back to the host (a device sync
            on GPU).
    """
    indices, values, _ = _topk_decode(payload, layout, dtype, "payload")
    return indices, values


def topk_decompress(payloads: "torch.Tensor", layout: TopKLayout, dtype: "torch.dtype | None" = None) -> "torch.Tensor":
    """Mean over ranks of the scattered top-k entries: ``P x nbytes`` uint8 -> ``n`` tensor.

    Raises:
        InputError: ``payloads`` not a 2-D tensor with at least one row, or a row that
            :func:`topk_decode` refuses (named ``payloads[r]``; one host sync checks every row).
    """
    return _topk_decompress(payloads, layout, dtype, strict=True)


def _topk_decompress(payloads: "torch.Tensor", layout: TopKLayout, dtype: "torch.dtype | None", *, strict: bool
                     ) -> "torch.Tensor":
    """:func:`topk_decompress`; ``strict=False`` as in :func:`_fft_decompress`."""
    decode = functools.partial(_topk_decode, layout=layout, dtype=dtype)
    mean, bad = _mean_of_rows(decode, payloads, layout.n, strict)
    return _nan_where(bad, mean)


# --------------------------------------------------------------------------------------------------
# States and hooks


@dataclass
class StepStats:
    """Accounting of one training step (one backward pass, all buckets) on one rank.

    Attributes:
        step: step index, from 0.
        warmup: True for the dense warm-up steps of error-feedback compressors (``step <
            start_iter``) and of PowerSGD (``step < start_powerSGD_iter``).
        bytes_sent: payload bytes this rank handed to collectives.
        dense_bytes: bytes of the uncompressed buckets (``n * itemsize`` summed).
        compress_seconds: host seconds spent in the hooks before the collectives.
        decompress_seconds: host seconds spent decoding after them.
        buckets: number of buckets.
    """

    step: int
    warmup: bool = False
    bytes_sent: int = 0
    dense_bytes: int = 0
    compress_seconds: float = 0.0
    decompress_seconds: float = 0.0
    buckets: int = 0

    @property
    def compression_ratio(self) -> float:
        """``dense_bytes / bytes_sent`` (dimensionless)."""
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else float("nan")


class CompressorState:
    """Base of the compressor states: process group, step counter and per-step accounting.

    Class attributes: ``name`` (the registry key) and ``collective`` (``"allreduce"`` or
    ``"allgather"``, so a benchmark can turn ``bytes_sent`` into transport bytes for its P).

    Attributes:
        process_group: the group to communicate on (None: the default group). Dropped when pickled.
        step: completed steps seen by the hook.
        history: one :class:`StepStats` per completed step.
    """

    name: ClassVar[str] = ""
    collective: ClassVar[str] = "allreduce"

    def __init__(self, process_group: Any = None):
        self.process_group = process_group
        self.step = 0
        self.history: list[StepStats] = []
        self._open = StepStats(step=0)
        self._lock = threading.Lock()

    # -- the hook signature DDP checks: (state, bucket) without annotations
    @staticmethod
    def hook(state, bucket):  # pragma: no cover - overridden
        """The DDP communication hook, registered with the state by
        ``ddp_model.register_comm_hook(state, hook)``: ``state`` a compressor state, ``bucket`` a
        ``dist.GradBucket``; returns a ``Future[Tensor]`` of the bucket's ``n`` mean gradient over
        the ranks. Each compressor overrides it.

        Raises:
            NotImplementedError: in this base class.
        """
        raise NotImplementedError

    @property
    def group(self) -> Any:
        """The process group used: :attr:`process_group`, or ``dist.group.WORLD`` when None."""
        import torch.distributed as dist

        return self.process_group if self.process_group is not None else dist.group.WORLD

    @property
    def world_size(self) -> int:
        """Ranks in :attr:`group` (needs an initialized process group)."""
        import torch.distributed as dist

        return dist.get_world_size(self.group)

    @property
    def bytes_sent(self) -> list[int]:
        """Payload bytes sent per completed step."""
        return [s.bytes_sent for s in self.history]

    @property
    def dense_bytes(self) -> list[int]:
        """Uncompressed bytes per completed step."""
        return [s.dense_bytes for s in self.history]

    def compression_ratio(self, skip_warmup: bool = True) -> float:
        """``sum(dense_bytes) / sum(bytes_sent)`` over the history (without warm-up steps by default)."""
        rows = [s for s in self.history if not (s.warmup and skip_warmup)]
        sent = sum(s.bytes_sent for s in rows)
        return sum(s.dense_bytes for s in rows) / sent if sent else float("nan")

    def _record(self, bucket, *, bytes_sent: int, dense_bytes: int, warmup: bool, seconds: float) -> StepStats:
        """Add one bucket to the open step; close the step on DDP's last bucket."""
        with self._lock:
            rec = self._open
            rec.bytes_sent += int(bytes_sent)
            rec.dense_bytes += int(dense_bytes)
            rec.compress_seconds += seconds
            rec.warmup = rec.warmup or warmup
            rec.buckets += 1
            if bucket.is_last():
                self.history.append(rec)
                self.step += 1
                self._open = StepStats(step=self.step)
        return rec

    def _add_decompress(self, rec: StepStats, seconds: float) -> None:
        with self._lock:
            rec.decompress_seconds += seconds

    def _allreduce_mean(self, bucket, *, warmup: bool):
        """The dense hook: divide by P, allreduce (sum), as torch's ``allreduce_hook``."""
        import torch.distributed as dist

        t0 = time.perf_counter()
        buf = bucket.buffer()
        buf.div_(self.world_size)
        fut = dist.all_reduce(buf, group=self.group, async_op=True).get_future()
        self._record(bucket, bytes_sent=buf.numel() * buf.element_size(),
                     dense_bytes=buf.numel() * buf.element_size(), warmup=warmup,
                     seconds=time.perf_counter() - t0)
        return fut.then(lambda f: f.value()[0])

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["process_group"] = None  # not serializable; set it again after loading
        state.pop("_lock", None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    def options(self) -> dict[str, Any]:
        """The hyperparameters, as :func:`make_hook` takes them."""
        return {}

    def check_compresses(self, parameters: Iterable[Any]) -> None:
        """Refuse options under which this compressor would compress none of ``parameters``'
        gradients (checked before any rank starts). Every compressor compresses every bucket
        unless it says otherwise (PowerSGD skips small matrices).

        Raises:
            InputError: naming the option.
        """

    def memory_state(self) -> dict[str, Any]:
        """The compressor's memory a checkpoint keeps (error-feedback residuals, PowerSGD's
        factors), as CPU tensors keyed by bucket index; empty for memoryless compressors."""
        return {}

    def load_memory_state(self, memory: dict[str, Any], device: Any) -> list[int]:
        """Restore :meth:`memory_state` on ``device`` after a restart.

        The memory is kept per bucket of DDP's *rebuilt* layout (the one from its second
        iteration on): the step counter stays at 0 here, so a first step after loading is a
        dense warm-up step that leaves the memory alone while DDP rebuilds its buckets; then
        :meth:`restore_step` continues the count (``paperline.kernels.train.ddp`` takes that
        first step as a throwaway, so a resumed run goes on exactly as an uninterrupted one).

        Returns:
            The bucket indices restored.
        """
        return []

    def restore_step(self, step: int) -> None:
        """Set the completed-step counter to ``step`` (a checkpoint's ``step``) and forget the
        history recorded since construction (a throwaway priming step's): the warm-up, counted
        in steps, is not run again after a restart."""
        with self._lock:
            self.step = int(step)
            self.history = []
            self._open = StepStats(step=self.step)

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.options().items())
        return f"{type(self).__name__}({opts}; step={self.step})"


class _ResidualMixin:
    """Per-bucket residual memory (error feedback) and the non-finite counter."""

    def _init_memory(self) -> None:
        self.residuals: dict[int, Any] = {}
        self._nonfinite: Any = None  # a device int64 counter: no host sync per bucket
        self.residual_resets = 0

    @property
    def nonfinite_buckets(self) -> int:
        """Buckets that had NaN/inf gradients (passed through, kept out of the residuals)."""
        return 0 if self._nonfinite is None else int(self._nonfinite)

    def _count_nonfinite(self, finite: "torch.Tensor") -> None:
        import torch

        bad = (~finite).to(torch.int64)
        self._nonfinite = bad if self._nonfinite is None else self._nonfinite + bad.to(self._nonfinite.device)

    def memory_state(self) -> dict[str, Any]:
        return {"residuals": {int(k): v.detach().cpu().clone() for k, v in self.residuals.items()},
                "bucket_n": dict(getattr(self, "_bucket_n", {}))}

    def load_memory_state(self, memory: dict[str, Any], device: Any) -> list[int]:
        self.residuals = {int(k): v.to(device) for k, v in (memory.get("residuals") or {}).items()}
        if hasattr(self, "_bucket_n"):
            self._bucket_n.update({int(k): int(v) for k, v in (memory.get("bucket_n") or {}).items()})
        return sorted(self.residuals)

    def _residual(self, index: int, shape: tuple[int, ...], like: "torch.Tensor", dtype: "torch.dtype"):
        import torch

        r = self.residuals.get(index)
        if r is not None and (tuple(r.shape) != shape or r.dtype != dtype or r.device != like.device):
            logger.warning("bucket %d changed from %s to %s: its residual memory is reset",
                           index, tuple(r.shape), shape)
            self.residual_resets += 1
            r = None
        if r is None:
            r = torch.zeros(shape, dtype=dtype, device=like.device)
        return r


@compressors.register("none")
class AllreduceState(CompressorState):
    """``none``: the dense mean by allreduce (what DDP does without a hook). Bytes: ``n * itemsize``."""

    name = "none"

    def __init__(self, process_group: Any = None):
        super().__init__(process_group)

    @staticmethod
    def hook(state, bucket):
        """DDP hook: ``state`` an :class:`AllreduceState`, ``bucket`` a ``dist.GradBucket``;
        returns a ``Future[Tensor]`` of the bucket's mean over ranks."""
        return state._allreduce_mean(bucket, warmup=False)


@compressors.register("fp16")
class FP16State(CompressorState):
    """``fp16``: torch's ``default_hooks.fp16_compress_hook`` (cast to float16, divide by P,
    allreduce, cast back). Bytes: ``2 n``. Error per element about ``2^-10`` of the mean magnitude."""

    name = "fp16"

    def __init__(self, process_group: Any = None):
        super().__init__(process_group)

    @staticmethod
    def hook(state, bucket):
        """DDP hook around torch's ``fp16_compress_hook``."""
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        t0 = time.perf_counter()
        n = bucket.buffer().numel()
        fut = default_hooks.fp16_compress_hook(state.process_group, bucket)
        state._record(bucket, bytes_sent=2 * n, dense_bytes=n * bucket.buffer().element_size(),
                      warmup=False, seconds=time.perf_counter() - t0)
        return fut


@compressors.register("fft")
class FFTState(_ResidualMixin, CompressorState):
    """``fft``: SuperNeurons' frequency-domain sparsification with range-based quantization.

    See the module docstring (steps F1-F6) and [Wang2018]_. Deterministic: no randomness is
    involved (top-k ties are broken the same way on every rank for the same input).

    Args:
        process_group: group to communicate on (None: default group).
        theta: fraction of the ``n_fft // 2 + 1`` rfft coefficients kept per bucket, in (0, 1].
        bits: bits per kept real value, 1 to 32; 32 sends raw float32 (no quantization).
        error_feedback: keep the per-bucket residual spectrum and add it before compressing.
        start_iter: dense-allreduce steps before compressing; default 2 with error feedback
            (minimum 2, see module docstring), else 0.

    Attributes:
        residuals: bucket index -> ``m`` complex residual spectrum (error feedback).
        nonfinite_buckets: buckets whose gradients had NaN/inf.

    Raises:
        InputError: θ outside (0, 1], bits outside 1-32, a non-bool ``error_feedback``, a bad
            start_iter (< 0, or < 2 with error feedback).
    """

    name = "fft"
    collective = "allgather"

    def __init__(self, process_group: Any = None, *, theta: float = 0.1, bits: int = 8,
                 error_feedback: bool = False, start_iter: int | None = None):
        super().__init__(process_group)
        self.theta = _check_fraction("theta", theta)
        self.bits = _check_bits(bits)
        self.error_feedback = _check_bool("error_feedback", error_feedback)
        self.start_iter = _start_iter(start_iter, self.error_feedback)
        self._init_memory()

    def options(self) -> dict[str, Any]:
        """The hyperparameters, as :func:`make_hook` takes them: ``theta``, ``bits``,
        ``error_feedback`` and ``start_iter`` (resolved)."""
        return {"theta": self.theta, "bits": self.bits, "error_feedback": self.error_feedback,
                "start_iter": self.start_iter}

    def layout(self, n: int, dtype: "torch.dtype") -> FFTLayout:
        """The :class:`FFTLayout` of a bucket of ``n`` elements of ``dtype``."""
        import torch

        return FFTLayout(n, self.theta, self.bits, torch.empty(0, dtype=_compute_dtype(dtype)).element_size())

    def residual(self, bucket_index: int) -> "torch.Tensor | None":
        """The residual of a bucket in gradient space, ``irfft(E, n_fft)[:n]`` (``n`` real), or None."""
        import torch

        spec = self.residuals.get(bucket_index)
        if spec is None:
            return None
        n = self._bucket_n[bucket_index]
        return torch.fft.irfft(spec, n=_fast_len(n))[:n]

    def _init_memory(self) -> None:
        super()._init_memory()
        self._bucket_n: dict[int, int] = {}

    @staticmethod
    def hook(state, bucket):
        """DDP hook: ``state`` an :class:`FFTState`, ``bucket`` a ``dist.GradBucket`` (flattened
        ``n`` floating buffer); returns a ``Future[Tensor]`` of the ``n`` mean reconstruction."""
        import torch
        import torch.distributed as dist

        if state.step < state.start_iter:
            return state._allreduce_mean(bucket, warmup=True)
        t0 = time.perf_counter()
        buf = bucket.buffer()
        index, n = bucket.index(), buf.numel()
        residual = None
        if state.error_feedback:
            ctype = torch.complex128 if _compute_dtype(buf.dtype) == torch.float64 else torch.complex64
            residual = state._residual(index, (_fast_len(n) // 2 + 1,), buf, ctype)
        c = fft_compress(buf, theta=state.theta, bits=state.bits, residual=residual)
        if state.error_feedback:
            state.residuals[index] = c.residual
            state._bucket_n[index] = n
        state._count_nonfinite(c.finite)
        gathered = [torch.empty_like(c.payload) for _ in range(state.world_size)]
        work = dist.all_gather(gathered, c.payload, group=state.group, async_op=True)
        rec = state._record(bucket, bytes_sent=c.layout.nbytes, dense_bytes=n * buf.element_size(),
                            warmup=False, seconds=time.perf_counter() - t0)
        compute = _compute_dtype(buf.dtype)

        def decompress(fut):
            t1 = time.perf_counter()
            fut.wait()
            buf.copy_(_fft_decompress(torch.stack(gathered), c.layout, compute, strict=False))
            state._add_decompress(rec, time.perf_counter() - t1)
            return buf

        return work.get_future().then(decompress)


@compressors.register("topk")
class TopKState(_ResidualMixin, CompressorState):
    """``topk``: top-k sparsification with error feedback (DGC-style residual memory, [Lin2018]_).

    Each rank sends its ``k = ceil(fraction n)`` largest-magnitude entries (values in float32, or
    float64 for float64 buckets, plus int32 indices) by allgather; the mean of the scattered
    entries is returned. Deterministic (no RNG); DGC's momentum correction and warm-up schedule are
    not part of it.

    Args:
        process_group: group to communicate on (None: default group).
        fraction: kept fraction of each bucket, in (0, 1].
        error_feedback: keep the unsent entries and add them next step.
        start_iter: dense steps first; default 2 with error feedback (minimum 2), else 0.

    Raises:
        InputError: fraction outside (0, 1], a non-bool ``error_feedback``, a bad start_iter (< 0,
            or < 2 with error feedback).
    """

    name = "topk"
    collective = "allgather"

    def __init__(self, process_group: Any = None, *, fraction: float = 0.01, error_feedback: bool = True,
                 start_iter: int | None = None):
        super().__init__(process_group)
        self.fraction = _check_fraction("fraction", fraction)
        self.error_feedback = _check_bool("error_feedback", error_feedback)
        self.start_iter = _start_iter(start_iter, self.error_feedback)
        self._init_memory()

    def options(self) -> dict[str, Any]:
        """The hyperparameters, as :func:`make_hook` takes them: ``fraction``,
        ``error_feedback`` and ``start_iter`` (resolved)."""
        return {"fraction": self.fraction, "error_feedback": self.error_feedback, "start_iter": self.start_iter}

    def residual(self, bucket_index: int) -> "torch.Tensor | None":
        """The ``n`` residual of a bucket, or None."""
        return self.residuals.get(bucket_index)

    @staticmethod
    def hook(state, bucket):
        """DDP hook: ``state`` a :class:`TopKState`, ``bucket`` a ``dist.GradBucket``; returns a
        ``Future[Tensor]`` of the ``n`` mean of the ranks' top-k entries."""
        import torch
        import torch.distributed as dist

        if state.step < state.start_iter:
            return state._allreduce_mean(bucket, warmup=True)
        t0 = time.perf_counter()
        buf = bucket.buffer()
        index, n = bucket.index(), buf.numel()
        compute = _compute_dtype(buf.dtype)
        residual = state._residual(index, (n,), buf, compute) if state.error_feedback else None
        c = topk_compress(buf, fraction=state.fraction, residual=residual)
        if state.error_feedback:
            state.residuals[index] = c.residual
        state._count_nonfinite(c.finite)
        gathered = [torch.empty_like(c.payload) for _ in range(state.world_size)]
        work = dist.all_gather(gathered, c.payload, group=state.group, async_op=True)
        rec = state._record(bucket, bytes_sent=c.layout.nbytes, dense_bytes=n * buf.element_size(),
                            warmup=False, seconds=time.perf_counter() - t0)

        def decompress(fut):
            t1 = time.perf_counter()
            fut.wait()
            buf.copy_(_topk_decompress(torch.stack(gathered), c.layout, compute, strict=False))
            state._add_decompress(rec, time.perf_counter() - t1)
            return buf

        return work.get_future().then(decompress)


@compressors.register("powersgd")
class PowerSGDCompressorState(CompressorState):
    """``powersgd``: torch's ``powerSGD_hook`` with its ``PowerSGDState`` ([Vogels2019]_), as the peer.

    The arguments are ``PowerSGDState``'s, forwarded unchanged (``random_seed`` seeds the RNG that
    draws the same Q initializations on every rank). ``bytes_sent`` is the growth of
    ``PowerSGDState.total_numel_after_compression`` (P and Q factors plus the tensors it leaves
    uncompressed) times the itemsize; dense warm-up steps count ``n * itemsize``. Only the hook
    call is timed (``compress_seconds``); PowerSGD decompresses inside torch's callbacks.

    On gloo the hook waits for each bucket's result before returning: torch's ``powerSGD_hook``
    launches its second allreduce (the Qs) from a future callback, which gloo runs on its worker
    thread, so with more than one bucket the ranks can issue collectives in different orders (a
    collective mismatch that aborted our 2-rank tests). NCCL completes futures in the launching
    thread, so it keeps the overlap there.

    Attributes:
        powersgd: the wrapped ``torch...powerSGD_hook.PowerSGDState``.
        nonfinite_buckets: buckets whose mean came back NaN/inf (their residual and Q kept from
            before the step; torch's hook alone would carry the NaN into every later step).

    Raises:
        InputError: ``matrix_approximation_rank`` < 1, ``start_powerSGD_iter`` < 2 with error
            feedback or warm start (< 0 without), a negative ``random_seed``, a non-bool
            ``use_error_feedback``/``warm_start``/``batch_tensors_with_same_shape``, or
            ``min_compression_rate``/``orthogonalization_epsilon`` not a finite number >= 0.
    """

    name = "powersgd"

    def __init__(self, process_group: Any = None, *, matrix_approximation_rank: int = 1,
                 start_powerSGD_iter: int = 2, min_compression_rate: float = 2.0,
                 use_error_feedback: bool = True, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, random_seed: int = 0,
                 batch_tensors_with_same_shape: bool = False):
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        super().__init__(process_group)
        # NumPy scalars are accepted and handed on as Python ints/floats/bools
        matrix_approximation_rank = check_int("matrix_approximation_rank", matrix_approximation_rank, 1)
        use_error_feedback = _check_bool("use_error_feedback", use_error_feedback)
        warm_start = _check_bool("warm_start", warm_start)
        batch_tensors_with_same_shape = _check_bool("batch_tensors_with_same_shape", batch_tensors_with_same_shape)
        random_seed = check_int("random_seed", random_seed, 0)
        start_powerSGD_iter = check_int("start_powerSGD_iter", start_powerSGD_iter,
                                         2 if (use_error_feedback or warm_start) else 0)
        for arg, v in (("min_compression_rate", min_compression_rate),
                       ("orthogonalization_epsilon", orthogonalization_epsilon)):
            if not is_real(v) or not math.isfinite(float(v)) or v < 0:
                raise InputError(arg, v, "must be a finite number >= 0")
        min_compression_rate = as_float(min_compression_rate)
        orthogonalization_epsilon = as_float(orthogonalization_epsilon)
        self.random_seed = random_seed
        self._nonfinite = 0
        self.powersgd = PowerSGDState(
            process_group=process_group,
            matrix_approximation_rank=matrix_approximation_rank,
            start_powerSGD_iter=start_powerSGD_iter,
            min_compression_rate=min_compression_rate,
            use_error_feedback=use_error_feedback,
            warm_start=warm_start,
            orthogonalization_epsilon=orthogonalization_epsilon,
            random_seed=random_seed,
            batch_tensors_with_same_shape=batch_tensors_with_same_shape,
        )

    _OPTIONS = ("matrix_approximation_rank", "start_powerSGD_iter", "min_compression_rate",
                "use_error_feedback", "warm_start", "orthogonalization_epsilon", "batch_tensors_with_same_shape")

    def options(self) -> dict[str, Any]:
        """The hyperparameters, as :func:`make_hook` takes them: the wrapped
        ``PowerSGDState``'s (``matrix_approximation_rank``, ``start_powerSGD_iter``, ...) and
        ``random_seed``."""
        return {**{name: getattr(self.powersgd, name) for name in self._OPTIONS}, "random_seed": self.random_seed}

    def check_compresses(self, parameters: Iterable[Any]) -> None:
        """Refuse a rank that compresses none of ``parameters``' gradients.

        ``powerSGD_hook`` sends a gradient of shape ``(n, ...)`` as its ``n x m`` matrix
        (``m`` = the rest) and compresses it only when ``(n + m) * rank * min_compression_rate <
        n * m`` (torch's ``_should_compress``); vectors always go dense. A rank too large for every
        matrix of the model turns PowerSGD into a dense allreduce with compression ratio 1.

        Raises:
            InputError: naming ``matrix_approximation_rank`` and the largest rank that compresses
                some gradient (none at all: the model has no matrix large enough).
        """
        ps = self.powersgd
        rate = max(ps.min_compression_rate, 1e-12)
        useful = 0  # the largest rank that compresses at least one matrix
        for p in parameters:
            if p.dim() > 1:
                n, m = p.shape[0], p.numel() // p.shape[0]
                useful = max(useful, math.ceil(n * m / ((n + m) * rate)) - 1)
        if ps.matrix_approximation_rank > useful:
            hint = (f"the largest that compresses any is {useful}" if useful >= 1 else
                    "no weight matrix of this model is large enough for PowerSGD")
            raise InputError("matrix_approximation_rank", ps.matrix_approximation_rank,
                             f"compresses no gradient of the model (each would be sent dense: ratio 1); {hint} "
                             f"(min_compression_rate {ps.min_compression_rate:g})")

    _MEMORY = ("error_dict", "p_memory_dict", "q_memory_dict")

    def memory_state(self) -> dict[str, Any]:
        """``PowerSGDState``'s ``error_dict``, ``p_memory_dict`` and ``q_memory_dict`` (CPU tensors
        by bucket index) and ``rng_state``, its Q-initialization RNG as plain values."""
        memory: dict[str, Any] = {name: {int(k): v.detach().cpu().clone()
                                         for k, v in getattr(self.powersgd, name).items()} for name in self._MEMORY}
        # the RNG that draws Q's initialization (every step without warm_start): plain values only,
        # so the checkpoint loads with weights_only=True
        kind, keys, pos, has_gauss, cached = self.powersgd.rng.get_state()
        memory["rng_state"] = [str(kind), [int(k) for k in keys], int(pos), int(has_gauss), float(cached)]
        return memory

    def load_memory_state(self, memory: dict[str, Any], device: Any) -> list[int]:
        """Restore :meth:`memory_state` on ``device`` after a restart (see
        :meth:`CompressorState.load_memory_state`): ``error_dict``, ``p_memory_dict`` and
        ``q_memory_dict`` (a missing one becomes empty), and the Q-initialization RNG when
        ``rng_state`` is there.

        Returns:
            The bucket indices restored: those of ``error_dict``, or of ``p_memory_dict`` when it
            is empty (no error feedback).
        """
        import numpy as np

        for name in self._MEMORY:
            setattr(self.powersgd, name, {int(k): v.to(device) for k, v in (memory.get(name) or {}).items()})
        if memory.get("rng_state"):
            kind, keys, pos, has_gauss, cached = memory["rng_state"]
            self.powersgd.rng.set_state((kind, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
        return sorted(self.powersgd.error_dict or self.powersgd.p_memory_dict)

    def restore_step(self, step: int) -> None:
        """As :meth:`CompressorState.restore_step`, and set torch's own counter
        ``PowerSGDState.iter`` to ``step``: the warm-up up to ``start_powerSGD_iter`` is not run
        again."""
        super().restore_step(step)
        self.powersgd.iter = int(step)  # torch's own counter: warm-up until start_powerSGD_iter

    @staticmethod
    def hook(state, bucket):
        """DDP hook around torch's ``powerSGD_hook``."""
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import powerSGD_hook

        import torch.distributed as dist

        ps = state.powersgd
        ps.process_group = state.process_group
        t0 = time.perf_counter()
        buf = bucket.buffer()
        warmup = ps.iter < ps.start_powerSGD_iter
        before = ps.total_numel_after_compression
        memory = None if warmup else state._memory_before(bucket.index())
        fut = powerSGD_hook(ps, bucket)
        if not warmup and dist.get_backend(state.group) == "gloo":
            fut.wait()  # see the class docstring: keeps the ranks' collective order identical on gloo
        numel = buf.numel() if warmup else ps.total_numel_after_compression - before
        state._record(bucket, bytes_sent=numel * buf.element_size(), dense_bytes=buf.numel() * buf.element_size(),
                      warmup=warmup, seconds=time.perf_counter() - t0)
        if memory is None:
            return fut
        return fut.then(lambda f: state._keep_memory_finite(bucket.index(), memory, f.value()))

    def _memory_before(self, index: int) -> dict[str, Any]:
        """What ``powerSGD_hook`` will replace or overwrite of bucket ``index``'s memory: the
        residual (replaced, so the old tensor is kept as is) and the warm-start Q (overwritten in
        place: copied; it is small, ``m x rank`` per matrix). P is recomputed from Q every step."""
        ps = self.powersgd
        q = ps.q_memory_dict.get(index)
        return {"error_dict": ps.error_dict.get(index), "p_memory_dict": ps.p_memory_dict.get(index),
                "q_memory_dict": None if q is None else q.clone()}

    def _keep_memory_finite(self, index: int, memory: dict[str, Any], mean: "torch.Tensor") -> "torch.Tensor":
        """A bucket whose mean came back non-finite (a rank's gradient had NaN/inf: the allreduced
        P and Q carry it to every rank) gets its memory from before the step back, on every rank
        alike: torch's hook would keep the NaN residual and Q, and every later step would be NaN."""
        import torch

        if bool(torch.isfinite(mean).all()):
            return mean
        self._nonfinite += 1
        ps = self.powersgd
        for name, old in memory.items():
            held = getattr(ps, name)
            if old is None or (name != "error_dict" and not ps.warm_start):
                held.pop(index, None)  # (without warm start torch clears P and Q after every step)
            else:
                held[index] = old
        return mean

    @property
    def nonfinite_buckets(self) -> int:
        """Buckets whose mean came back non-finite (NaN/inf gradients; the memory kept from before)."""
        return self._nonfinite

    def __getstate__(self) -> dict[str, Any]:
        state = super().__getstate__()
        ps = state.pop("powersgd")
        state["_powersgd_slots"] = {s: getattr(ps, s) for s in type(ps).__slots__ if s != "process_group"}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState

        slots = state.pop("_powersgd_slots")
        super().__setstate__(state)
        ps = PowerSGDState.__new__(PowerSGDState)
        for slot, value in slots.items():
            setattr(ps, slot, value)
        ps.process_group = None
        self.powersgd = ps
        self.__dict__.setdefault("_nonfinite", 0)


# --------------------------------------------------------------------------------------------------
# Factory


def compressor_names() -> list[str]:
    """The registered compressor names, sorted."""
    return compressors.names()


def make_hook(name: str, process_group: Any = None, **options: Any) -> tuple[CompressorState, Callable]:
    """Build ``(state, hook)`` for ``ddp_model.register_comm_hook(state, hook)``.

    Args:
        name: a registered compressor (:func:`compressor_names`).
        process_group: the group to communicate on; None for the default group.
        **options: the state class's keyword arguments (e.g. ``theta``, ``bits`` for ``fft``).

    Returns:
        ``(state, hook)``; ``hook(state, bucket) -> Future[Tensor]``.

    Raises:
        InputError: an unknown name (the message lists the known ones), an option the compressor
            does not take (the message lists the ones it does), or a bad option value.
    """
    if not isinstance(name, str) or name not in compressors:
        raise InputError("name", name, unknown_name("compressor", name, compressor_names()))
    cls = compressors[name]
    accepted = [p for p in inspect.signature(cls.__init__).parameters if p not in ("self", "process_group")]
    for option, value in options.items():
        if option not in accepted:
            raise InputError(option, value, f"not an option of compressor {name!r}; "
                             f"its options: {', '.join(accepted) or 'none'}")
    state = cls(process_group, **options)
    return state, cls.hook
