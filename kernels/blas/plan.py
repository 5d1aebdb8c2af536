"""Level-3 BLAS problems and their tile plans (BLASX, Wang et al. 2016, Sec. 3: tile algorithms).

A :class:`Problem` is one routine call with validated operands. :func:`plan_tasks` turns it into
:class:`TileTask` s: each computes one output tile as ``alpha * sum_p L_p @ R_p + beta * C0``
over the k-panels ``p``, optionally followed by a triangular solve (TRSM) or a triangle-only write
(SYRK/SYR2K diagonal tiles). Operand tiles are named by :class:`TileRef`: the stored tile plus a
mask (triangle, unit diagonal, symmetric completion) and a transpose applied after loading. Every
matrix is cut into ``tile`` x ``tile`` tiles (edge tiles smaller), so tile ``(i, j)`` of any
operand covers rows ``i*tile:(i+1)*tile`` and columns ``j*tile:(j+1)*tile``.

Semantics are the reference BLAS ones (as in ``scipy.linalg.blas``), with the output returned
rather than overwritten:

- GEMM:  ``C = alpha op(A) op(B) + beta C``; ``op(A)`` is m x k, ``op(B)`` k x n.
- SYMM:  ``C = alpha A B + beta C`` (side L, A m x m) or ``alpha B A + beta C`` (side R, A n x n);
  A is symmetric and only its ``uplo`` triangle is read.
- SYRK:  ``C = alpha op(A) op(A)^T + beta C`` on the ``uplo`` triangle of the n x n C; the other
  triangle of C is returned unchanged (zeros without C).
- SYR2K: ``C = alpha (op(A) op(B)^T + op(B) op(A)^T) + beta C``, same triangle rule.
- TRMM:  ``B = alpha op(A) B`` (side L) or ``alpha B op(A)`` (side R); A triangular (``uplo``,
  ``diag`` U: unit diagonal, not read).
- TRSM:  ``B = X`` solving ``op(A) X = alpha B`` (side L) or ``X op(A) = alpha B`` (side R).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from paperline.kernels.blas.sources import TileSource, as_source
from paperline.kernels.errors import Described, InputError
from paperline.kernels.registry import Registry

ROUTINES: Registry[str] = Registry("BLAS routine")
for _name, _doc in [("gemm", "general matrix-matrix multiply"), ("symm", "symmetric matrix-matrix multiply"),
                    ("syrk", "symmetric rank-k update"), ("syr2k", "symmetric rank-2k update"),
                    ("trmm", "triangular matrix-matrix multiply"), ("trsm", "triangular solve, many right-hand sides")]:
    ROUTINES.register(_name)(_doc)


@dataclass(frozen=True)
class TileRef:
    """One operand tile as a task uses it.

    Attributes:
        operand: ``"a"``, ``"b"``, ``"c"`` (the input C) or ``"x"`` (an output tile, for TRSM).
        i, j: the stored tile's row and column index.
        mask: ``""`` (as stored), ``"U"``/``"L"`` (that triangle, diagonal included),
            ``"Uu"``/``"Lu"`` (that triangle with a unit diagonal), ``"symU"``/``"symL"``
            (the symmetric matrix whose ``U``/``L`` triangle is stored).
        trans: transpose after masking.
    """

    operand: str
    i: int
    j: int
    mask: str = ""
    trans: bool = False

    @property
    def stored(self) -> tuple[str, int, int]:
        """``(operand, i, j)``: the stored tile read (the cache key part), before mask/transpose."""
        return (self.operand, self.i, self.j)


@dataclass(frozen=True)
class TileTask:
    """Compute output tile ``out`` (BLASX's unit of work).

    ``acc = alpha * sum(L @ R for L, R in terms) + beta * c0``; then, for TRSM, ``solve`` the
    triangular system with the diagonal tile ``solve`` on side ``side``; then, when ``keep`` is
    ``"U"``/``"L"``, only that triangle of ``acc`` is written and the rest comes from ``c0``
    unchanged; ``copy`` tasks return ``c0`` unchanged (SYRK tiles outside the triangle).

    Attributes:
        index: position in the plan (dependencies refer to it).
        deps: indices of tasks whose output tiles this one reads (TRSM).
    """

    index: int
    out: tuple[int, int]
    terms: tuple[tuple[TileRef, TileRef], ...]
    alpha: float
    beta: float
    c0: TileRef | None = None
    keep: str = ""
    copy: bool = False
    solve: TileRef | None = None
    solve_lower: bool = True
    side: str = "L"
    deps: tuple[int, ...] = ()

    def refs(self) -> list[TileRef]:
        """Every operand tile the task reads, panel by panel (the solve tile last)."""
        out = [r for pair in self.terms for r in pair]
        if self.c0 is not None:
            out.append(self.c0)
        if self.solve is not None:
            out.append(self.solve)
        return out


@dataclass
class Problem:
    """One validated level-3 BLAS call (see the module docstring for the semantics).

    Attributes:
        routine: one of :data:`ROUTINES`.
        a, b, c: operand sources (``b``/``c`` None where the routine or the call has none).
        out_shape: ``(m, n)`` of the result.
        inner: the inner (k) dimension, for the flop count and the verification tolerance.
        dtype: float32 or float64, shared by every operand.
        flops: floating-point operations of the reference algorithm.
    """

    routine: str
    a: TileSource
    b: TileSource | None
    c: TileSource | None
    alpha: float
    beta: float
    trans_a: bool
    trans_b: bool
    side: str
    lower: bool
    unit_diagonal: bool
    tile: int
    out_shape: tuple[int, int]
    inner: int
    dtype: np.dtype
    flops: float
    extra: dict[str, Any] = field(default_factory=dict)

    def operands(self) -> dict[str, TileSource]:
        """The operands given, by name (``"a"``, ``"b"``, ``"c"``); those that are None are left out."""
        return {k: v for k, v in (("a", self.a), ("b", self.b), ("c", self.c)) if v is not None}

    def describe(self) -> str:
        """One line for logs, e.g. ``GEMM 4096x4096 (k=4096) float64 tile=1024 trans_a=N trans_b=N``."""
        flags = {"gemm": f"trans_a={'T' if self.trans_a else 'N'} trans_b={'T' if self.trans_b else 'N'}",
                 "symm": f"side={self.side} uplo={'L' if self.lower else 'U'}",
                 "syrk": f"trans={'T' if self.trans_a else 'N'} uplo={'L' if self.lower else 'U'}",
                 "syr2k": f"trans={'T' if self.trans_a else 'N'} uplo={'L' if self.lower else 'U'}"}.get(
            self.routine, f"side={self.side} uplo={'L' if self.lower else 'U'} trans_a={'T' if self.trans_a else 'N'} "
                          f"diag={'U' if self.unit_diagonal else 'N'}")
        m, n = self.out_shape
        inner = f"k={self.inner}" if self.routine in ("gemm", "syrk", "syr2k") else f"A {self.inner}x{self.inner}"
        whole = " (each matrix one tile)" if self.tile >= max(m, n, self.inner) else ""  # tiles are clipped
        return f"{self.routine.upper()} {m}x{n} ({inner}) {self.dtype} tile={self.tile}{whole} {flags}"


def parse_flag(argument: str, value: Any, choices: dict[Any, Any]) -> Any:
    """The meaning of a BLAS flag in ``choices`` (e.g. :data:`TRANS`): a letter, case-insensitive,
    or its integer code (a bool counts as 0/1).

    Raises:
        InputError: ``value`` is not a key of ``choices``; the message lists the letters.
    """
    key = value.upper() if isinstance(value, str) else value
    if isinstance(key, bool):
        key = int(key)
    if key not in choices:
        raise InputError(argument, value, f"expected one of {', '.join(repr(c) for c in choices if isinstance(c, str))}")
    return choices[key]


TRANS = {"N": False, "T": True, "C": True, 0: False, 1: True, 2: True}
SIDE = {"L": "L", "R": "R", 0: "L", 1: "R"}
UPLO = {"U": False, "L": True, 0: False, 1: True}  # -> lower
DIAG = {"N": False, "U": True, 0: False, 1: True}  # -> unit diagonal


# The operands and flags each routine reads besides a, alpha and the tile (reference BLAS semantics);
# the same table as the gemm flow's, which refuses the others in the same words.
ROUTINE_USES = {
    "gemm": frozenset({"b", "c", "beta", "trans_a", "trans_b"}),
    "symm": frozenset({"b", "c", "beta", "side", "uplo"}),
    "syrk": frozenset({"c", "beta", "trans_a", "uplo"}),
    "syr2k": frozenset({"b", "c", "beta", "trans_a", "uplo"}),
    "trmm": frozenset({"b", "side", "uplo", "trans_a", "diag"}),
    "trsm": frozenset({"b", "side", "uplo", "trans_a", "diag"}),
}


def _unused(routine: str, name: str, value: Any) -> InputError:
    """The error for an operand or flag ``routine`` does not read, worded as the gemm flow's."""
    uses = ROUTINE_USES[routine]
    shown = _shown(value) if name in ("b", "c") else value
    return InputError(name, shown, f"{routine.upper()} does not use it (it takes "
                                    f"{', '.join(sorted(uses))}); leave it out")


def _shown(operand: Any) -> Any:
    """An operand as an error shows it: a path as given, an array by its type and shape."""
    if isinstance(operand, (str, os.PathLike)):
        return str(operand)
    shape = getattr(operand, "shape", None)
    return Described(f"{type(operand).__name__} of shape {tuple(shape)}" if shape is not None else type(operand).__name__)


def _scalar(argument: str, value: Any) -> float:
    if isinstance(value, (str, bytes, bool, np.bool_)):
        raise InputError(argument, value, "expected a real number")
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise InputError(argument, value, "expected a real number") from None
    except OverflowError:  # an int beyond float64 (10**400): was a bare OverflowError (a trial)
        shown = str(value)
        raise InputError(argument, value if len(shown) <= 40 else Described(f"{shown[:12]}...({len(shown)} digits)"),
                         "must be finite (it is beyond float64)") from None
    if not math.isfinite(v):
        raise InputError(argument, value, "must be finite")
    return v


def make_problem(routine: str, a: Any, b: Any = None, c: Any = None, *, alpha: Any = 1.0, beta: Any = 0.0,
                 trans_a: Any = "N", trans_b: Any = "N", side: Any = "L", uplo: Any = "U", diag: Any = "N",
                 tile: Any = 1024) -> Problem:
    """Validate one call and describe it as a :class:`Problem`.

    Args:
        routine: ``gemm``, ``symm``, ``syrk``, ``syr2k``, ``trmm`` or ``trsm`` (either case).
        a, b, c: 2-D float32/float64 arrays (not ``numpy.ma.MaskedArray``), ``.npy`` paths or
            :class:`TileSource` s. ``b`` is required except for SYRK, which takes none; ``c`` is
            optional for GEMM/SYMM/SYRK/SYR2K (zeros when absent, also with a nonzero ``beta``, as
            in ``scipy.linalg.blas``) and taken by neither TRMM nor TRSM.
        alpha, beta: finite real scalars (``beta`` is read by GEMM/SYMM/SYRK/SYR2K only).
        trans_a, trans_b: ``"N"``/``"T"`` (``"C"`` = ``"T"`` for real matrices; also 0/1/2).
            ``trans_b`` is GEMM's only; SYRK/SYR2K take ``trans_a`` as their ``trans``; SYMM reads
            neither.
        side: ``"L"``/``"R"`` (SYMM, TRMM, TRSM). uplo: ``"U"``/``"L"`` (all but GEMM).
            diag: ``"N"``/``"U"`` (TRMM, TRSM).
        tile: tile edge in entries (> 0).

    An operand or flag the routine does not read (see above; the gemm flow's table
    :data:`ROUTINE_USES`) is refused when given other than its default (``None`` for operands,
    ``beta = 0``, ``"N"``/``"L"``/``"U"``/``"N"`` for the flags), rather than silently ignored.

    Raises:
        InputError: unknown routine or flag, an operand or flag the routine does not use (``c``
            with TRMM/TRSM, ``b`` with SYRK, ``trans_b`` with any routine but GEMM, ...), a masked
            array, an empty operand (a dimension of 0), shapes that do not conform, mixed dtypes,
            a tile size below 1, non-finite or non-numeric alpha/beta (strings and bools are
            refused), a TRSM diagonal entry equal to zero (checked here for in-memory and file
            operands, during the solve otherwise). An error about an operand read from a file or
            S3 names the path or URI as the value seen.
    """
    shown = routine
    routine = routine.lower() if isinstance(routine, str) else routine  # GEMM too, as the flags take either case
    if routine not in ROUTINES:
        raise InputError("routine", shown, f"unknown BLAS routine; known: {', '.join(ROUTINES.names())}")
    if isinstance(tile, bool) or not isinstance(tile, (int, np.integer)) or tile < 1:
        raise InputError("tile", tile, "the tile size must be a positive integer")
    alpha, beta = _scalar("alpha", alpha), _scalar("beta", beta)
    ta, tb = parse_flag("trans_a", trans_a, TRANS), parse_flag("trans_b", trans_b, TRANS)
    sd, lower, unit = parse_flag("side", side, SIDE), parse_flag("uplo", uplo, UPLO), parse_flag("diag", diag, DIAG)
    uses = ROUTINE_USES[routine]
    given = {"b": (b, b is not None), "c": (c, c is not None), "beta": (beta, beta != 0.0),
             "trans_a": (trans_a, ta), "trans_b": (trans_b, tb), "side": (side, sd != "L"),
             "uplo": (uplo, lower), "diag": (diag, unit)}
    for name, (value, set_) in given.items():
        if set_ and name not in uses:
            raise _unused(routine, name, value)
    for name, operand in (("a", a), ("b", b), ("c", c)):
        if isinstance(operand, np.ma.MaskedArray):
            raise InputError(name, _shown(operand), "a masked array: its mask would be dropped silently; "
                                                    "pass operand.filled(value) or the plain data")
    A = as_source(a, "a")
    B = None if routine == "syrk" else as_source(b, "b")
    C = None if c is None else as_source(c, "c")
    for name, s in (("b", B), ("c", C)):
        # (byte order aside: a big-endian float64 beside a native one was "mixed dtypes": a trial)
        if s is not None and s.dtype.newbyteorder("=") != A.dtype.newbyteorder("="):
            differs = f"differs from a ({A.dtype}); mixed dtypes are not supported"
            if _where(s) is not None:  # the file or URI is the value seen, its dtype leads the reason
                raise InputError(name, _where(s), f"dtype {s.dtype} {differs}")
            raise InputError(name, str(s.dtype), f"dtype {differs}")

    def square(name: str, s: TileSource) -> int:
        if s.shape[0] != s.shape[1]:
            raise _shape_error(name, s, f"{routine.upper()} needs a square {name}")
        return s.shape[0]

    def conform(name: str, s: TileSource, want: tuple[int, int], why: str) -> None:
        if tuple(s.shape) != tuple(want):
            raise _shape_error(name, s, f"shape does not conform: expected {tuple(want)} ({why})")

    if routine == "gemm":
        m, k = A.shape[::-1] if ta else A.shape
        kb, n = B.shape[::-1] if tb else B.shape
        if kb != k:
            raise _shape_error("b", B, f"shape does not conform: op(b) has {kb} rows, op(a) has {k} columns")
        flops = 2.0 * m * n * k
    elif routine in ("syrk", "syr2k"):
        n, k = A.shape[::-1] if ta else A.shape
        m = n
        if B is not None:
            conform("b", B, A.shape, "SYR2K needs a and b of one shape")
        flops = (1.0 if routine == "syrk" else 2.0) * n * (n + 1) * k
    else:  # symm, trmm, trsm: a square A on side L (m x m) or R (n x n) of B (m x n)
        na = square("a", A)
        m, n = B.shape
        if (m if sd == "L" else n) != na:
            raise _shape_error("b", B, f"shape does not conform with a {tuple(A.shape)} on side {sd}")
        k = na
        flops = (2.0 if routine == "symm" else 1.0) * m * n * k
    if C is not None:
        conform("c", C, (m, n), "the result's shape")
    if min(m, n, k) < 1:
        raise InputError("shape", (m, n, k), "empty problem: every dimension must be at least 1")
    problem = Problem(routine, A, B, C, alpha, beta, ta, tb, sd, lower, unit, int(tile), (int(m), int(n)), int(k),
                      A.dtype.newbyteorder("="), flops)  # native order, as scipy's result
    if routine == "trsm" and not unit and A.kind in ("memory", "file"):
        check_trsm_diagonal(A)
    return problem


def _where(s: TileSource) -> str | None:
    """The file path or S3 URI operand ``s`` was read from (None: an in-memory or generated matrix)."""
    return getattr(s, "where", None)


def _shape_error(name: str, s: TileSource, problem: str) -> InputError:
    """A shape error about operand ``name``: the value seen is its file or URI, the shape then
    leads the reason (``b='/data/B.npy': shape (100, 128) does not conform: ...``, as a
    non-finite entry's error names the file); else the shape is the value seen."""
    where = _where(s)
    if where is None:
        return InputError(name, tuple(s.shape), problem)
    shape = f"shape {tuple(s.shape)}"
    return InputError(name, where, problem.replace("shape", shape, 1) if problem.startswith("shape")
                      else f"{shape}: {problem}")


def zero_diagonal_error(i: int, where: str | None) -> InputError:
    """The error for a zero at ``a[i,i]`` of a TRSM's triangular matrix: the value seen is the
    file or URI ``where`` (``a='/data/A.npy': TRSM needs a nonzero diagonal, found a[37,37] = 0``),
    else (an in-memory or generated matrix), as for a non-finite entry, the entry itself."""
    entry = f"a[{i},{i}] = 0"
    if where is None:
        return InputError("a", entry, "TRSM needs a nonzero diagonal (the triangular matrix is singular)")
    return InputError("a", where, f"TRSM needs a nonzero diagonal, found {entry} (the triangular matrix is singular)")


def check_trsm_diagonal(a: TileSource, band: int = 256) -> None:
    """Refuse a triangular matrix with a zero on its diagonal (singular: TRSM would divide by zero).

    Raises:
        InputError: naming the first zero entry and the operand's file (:func:`zero_diagonal_error`).
    """
    n = a.shape[0]
    for r in range(0, n, band):
        r1 = min(n, r + band)
        block = a.read(slice(r, r1), slice(r, r1))
        zeros = np.flatnonzero(np.diagonal(block) == 0)
        if zeros.size:
            raise zero_diagonal_error(r + int(zeros[0]), _where(a))


def n_tiles(size: int, tile: int) -> int:
    """Tiles of side ``tile`` along ``size`` elements, ``ceil(size / tile)`` (the last may be smaller)."""
    return -(-size // tile)


MAX_TILE_TASKS = 100_000  # a plan finer than these takes longer to schedule than to compute
MAX_PANEL_PRODUCTS = 10_000_000


def check_plan_size(p: Problem) -> None:
    """Refuse a plan too fine to schedule, before it is built (a ``10**6``-square gemm at tile
    1024 planned for minutes and gigabytes before failing).

    Raises:
        InputError: naming ``tile``, when ``p`` has more than :data:`MAX_TILE_TASKS` output tiles
            or more than :data:`MAX_PANEL_PRODUCTS` tile products.
    """
    (m, n), k, t = p.out_shape, p.inner, p.tile
    tasks = n_tiles(m, t) * n_tiles(n, t)
    products = tasks * n_tiles(k, t)
    if tasks > MAX_TILE_TASKS or products > MAX_PANEL_PRODUCTS:
        raise InputError("tile", t, f"{tasks:,} tile tasks, {products:,} panel products for a {m}x{n} (k={k}) "
                                    f"problem (limits {MAX_TILE_TASKS:,} / {MAX_PANEL_PRODUCTS:,}); raise the "
                                    "tile size or lower m, n, k")


def plan_tasks(p: Problem) -> list[TileTask]:
    """The tile tasks of ``p``, in an order that respects their dependencies.

    Output tiles are listed row-major; consecutive tasks share operand panels (what locality-aware
    placement exploits). TRSM tasks list the output tiles they read in ``deps``.
    """
    t = p.tile
    mt, nt, kt = n_tiles(p.out_shape[0], t), n_tiles(p.out_shape[1], t), n_tiles(p.inner, t)
    ta, lower, unit = p.trans_a, p.lower, p.unit_diagonal

    def op(name: str, i: int, j: int, trans: bool) -> TileRef:
        return TileRef(name, j, i, "", True) if trans else TileRef(name, i, j)

    def sym(i: int, j: int) -> TileRef:
        if i == j:
            return TileRef("a", i, i, "symL" if lower else "symU")
        stored_here = (i > j) if lower else (i < j)
        return TileRef("a", i, j) if stored_here else TileRef("a", j, i, "", True)

    def tri(i: int, j: int) -> TileRef | None:
        si, sj = (j, i) if ta else (i, j)
        if si == sj:
            return TileRef("a", si, si, ("L" if lower else "U") + ("u" if unit else ""), ta)
        inside = (si > sj) if lower else (si < sj)
        return TileRef("a", si, sj, "", ta) if inside else None

    c0 = (lambda i, j: TileRef("c", i, j)) if (p.c is not None and p.beta != 0.0) else (lambda i, j: None)
    tasks: list[TileTask] = []

    def add(**kw: Any) -> None:
        tasks.append(TileTask(index=len(tasks), **kw))

    r = p.routine
    if r == "gemm":
        for i in range(mt):
            for j in range(nt):
                add(out=(i, j), terms=tuple((op("a", i, q, ta), op("b", q, j, p.trans_b)) for q in range(kt)),
                    alpha=p.alpha, beta=p.beta, c0=c0(i, j))
    elif r == "symm":
        for i in range(mt):
            for j in range(nt):
                if p.side == "L":
                    terms = tuple((sym(i, q), TileRef("b", q, j)) for q in range(kt))
                else:
                    terms = tuple((TileRef("b", i, q), sym(q, j)) for q in range(kt))
                add(out=(i, j), terms=terms, alpha=p.alpha, beta=p.beta, c0=c0(i, j))
    elif r in ("syrk", "syr2k"):
        keep_tri = "L" if lower else "U"
        raw_c = (lambda i, j: TileRef("c", i, j)) if p.c is not None else (lambda i, j: None)
        for i in range(mt):
            for j in range(nt):
                inside = (i >= j) if lower else (i <= j)
                if not inside:
                    add(out=(i, j), terms=(), alpha=0.0, beta=1.0, c0=raw_c(i, j), copy=True)
                    continue
                if r == "syrk":
                    terms = tuple((op("a", i, q, ta), op("a", q, j, not ta)) for q in range(kt))
                else:
                    terms = tuple(pair for q in range(kt) for pair in (
                        (op("a", i, q, ta), op("b", q, j, not ta)), (op("b", i, q, ta), op("a", q, j, not ta))))
                diag_tile = i == j
                add(out=(i, j), terms=terms, alpha=p.alpha, beta=p.beta,
                    c0=raw_c(i, j) if (diag_tile or p.beta != 0.0) else None, keep=keep_tri if diag_tile else "")
    elif r == "trmm":
        for i in range(mt):
            for j in range(nt):
                if p.side == "L":
                    terms = tuple((a_t, TileRef("b", q, j)) for q in range(kt) if (a_t := tri(i, q)) is not None)
                else:
                    terms = tuple((TileRef("b", i, q), a_t) for q in range(kt) if (a_t := tri(q, j)) is not None)
                add(out=(i, j), terms=terms, alpha=p.alpha, beta=0.0)
    elif r == "trsm":
        lower_eff = lower != ta
        index: dict[tuple[int, int], int] = {}
        if p.side == "L":  # op(A) X = alpha B: block forward (lower) or backward (upper) substitution
            rows = range(mt) if lower_eff else range(mt - 1, -1, -1)
            order = [(i, j) for i in rows for j in range(nt)]
        else:  # X op(A) = alpha B: over block columns, left to right (upper) or right to left (lower)
            cols = range(nt - 1, -1, -1) if lower_eff else range(nt)
            order = [(i, j) for j in cols for i in range(mt)]
        for i, j in order:
            if p.side == "L":
                before = range(i) if lower_eff else range(i + 1, mt)
                terms = tuple((tri(i, q), TileRef("x", q, j)) for q in before if tri(i, q) is not None)
                deps = tuple(index[(q, j)] for q in before)
                diag_ref = tri(i, i)
            else:
                before = range(j + 1, nt) if lower_eff else range(j)
                terms = tuple((TileRef("x", i, q), tri(q, j)) for q in before if tri(q, j) is not None)
                deps = tuple(index[(i, q)] for q in before)
                diag_ref = tri(j, j)
            index[(i, j)] = len(tasks)
            add(out=(i, j), terms=terms, alpha=-1.0, beta=p.alpha, c0=TileRef("b", i, j), solve=diag_ref,
                solve_lower=lower_eff, side=p.side, deps=deps)
    return tasks
