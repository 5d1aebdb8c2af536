"""Bundled real datasets and the user Parquet format."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from paperline.kernels.errors import InputError
from paperline.kernels.tensor.coo import COOTensor
from paperline.kernels.tensor.datasets import (
    dataset_info,
    dataset_names,
    load_dataset,
    read_coo_parquet,
    write_coo_parquet,
)


@pytest.mark.parametrize("name, shape, nnz", [
    ("kinetic", (64, 12, 10, 60), 459_046),   # 0.38% missing by design
    ("produc", (48, 8, 17), 48 * 8 * 17),
    ("flights", (3, 105, 365), 3 * 105 * 365),
])
def test_bundled_dataset_shapes_and_standardization(name, shape, nnz):
    t = load_dataset(name)
    assert t.shape == shape == dataset_info(name).shape
    assert t.nnz == nnz
    assert np.isfinite(t.values).all()
    assert abs(t.values.mean()) < 1e-9 and t.values.std() == pytest.approx(1.0)


def test_flights_tensor_counts_every_departure():
    # z = (count - mean) / std over 3*105*365 cells; undo it with the known total of 336,776
    # departures in 2013: the cells must then hold non-negative integers.
    t = load_dataset("flights")
    z = t.values
    n = z.size
    # counts = a z + b with sum(counts) = 336776 and min(counts) = 0 (some route-days have none)
    b = 336_776 / n
    a = -b / z.min()
    counts = a * z + b
    np.testing.assert_allclose(counts, np.round(counts), atol=1e-6)
    assert set(dataset_names()) >= {"kinetic", "produc", "flights"}


def test_unknown_dataset_names_the_value():
    with pytest.raises(InputError, match="^dataset='nope': unknown dataset; known: flights, kinetic, produc"):
        load_dataset("nope")


def test_parquet_round_trip(tmp_path):
    rng = np.random.default_rng(0)
    t = COOTensor.from_dense(rng.normal(size=(3, 4, 5)), rng.random((3, 4, 5)) < 0.5)
    write_coo_parquet(t, tmp_path / "x.parquet")
    back = read_coo_parquet(tmp_path / "x.parquet")
    np.testing.assert_array_equal(back.coords, t.coords)
    np.testing.assert_array_equal(back.values, t.values)


def test_bad_parquet_files_get_clear_errors(tmp_path):
    junk = tmp_path / "junk.parquet"
    junk.write_bytes(b"\x00\x01definitely not parquet")  # (text is named as text: below)
    with pytest.raises(InputError, match="^data=.*junk.parquet.*not a readable Parquet file"):
        read_coo_parquet(junk)
    nan = tmp_path / "nan.parquet"
    pq.write_table(pa.table({"i": [0, 1], "j": [0, 1], "t": [0, 1], "value": [1.0, float("nan")]}), nan)
    # the column and the file, one name=value (it was "data='...nan.parquet': values='1 NaN ...'": a trial)
    with pytest.raises(InputError, match=r"^data\['value'\]=<1 NaN and 0 inf of 2>: observed values must be finite "
                                         r"\(leave missing entries out instead\) \(in .*nan\.parquet\)$"):
        read_coo_parquet(nan)
    nulls = tmp_path / "nulls.parquet"  # pandas writes a NaN of a float column as null
    pq.write_table(pa.table({"i": [0, 1], "j": [0, 1], "t": [0, 1], "value": [1.0, None]}), nulls)
    with pytest.raises(InputError, match=r"^data\['value'\]=<1 null>: observed values must be present \(a NaN written "
                                         r"by pandas is a null\): leave missing entries out"):
        read_coo_parquet(nulls)
    # every value 0: the fits ran, then TensorLy's baseline failed the run, "Singular matrix" (a trial)
    zeros = tmp_path / "zeros.parquet"
    pq.write_table(pa.table({"i": [0, 1], "j": [0, 1], "t": [0, 1], "value": [0.0, -0.0]}), zeros)
    with pytest.raises(InputError, match=r"^data\['value'\]=<all 2 zero>: every observed value is 0: a CP model of it "
                                         r"is all zeros, with nothing to fit; check the column \(in .*zeros\.parquet\)$"):
        read_coo_parquet(zeros)
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"i": pa.array([], pa.int64()), "j": pa.array([], pa.int64()),
                             "t": pa.array([], pa.int64()), "value": pa.array([], pa.float64())}), empty)
    with pytest.raises(InputError, match="empty tensor"):
        read_coo_parquet(empty)
    cols = tmp_path / "cols.parquet"
    pq.write_table(pa.table({"i": [0], "value": [1.0]}), cols)
    with pytest.raises(InputError, match="needs integer index columns, one of them 't' \\(time\\), and a 'value' column"):
        read_coo_parquet(cols)
    # one or two modes: named as such (a 't'-only file was refused for duplicated coordinates)
    for name, table in (("t_only", {"t": [0, 0, 1], "value": [1.0, 2.0, 3.0]}),
                        ("two", {"i": [0, 1], "t": [0, 1], "value": [1.0, 2.0]})):
        pq.write_table(pa.table(table), tmp_path / f"{name}.parquet")
        with pytest.raises(InputError, match=rf"^data=.*{name}.parquet.*need a tensor with N >= 3 modes .*found "
                                             rf"{len(table) - 1}"):
            read_coo_parquet(tmp_path / f"{name}.parquet")


def test_the_time_column_is_found_by_name_and_is_the_last_mode(tmp_path):
    pq.write_table(pa.table({"t": [0, 2], "i": [1, 0], "j": [0, 3], "value": [1.0, 2.0]}), tmp_path / "tfirst.parquet")
    tensor = read_coo_parquet(tmp_path / "tfirst.parquet")
    assert tensor.mode_names == ("i", "j", "t") and tensor.shape == (2, 4, 3)
    np.testing.assert_array_equal(tensor.coords, [[1, 0, 0], [0, 3, 2]])


def test_occupied_shape_counts_the_distinct_indices_of_each_mode():
    """The shape with each mode renumbered 0, 1, ...: ids spread over a large range (a trial's 'i'
    of 20 values up to 95000) make a dense shape of mostly empty indices."""
    from paperline.kernels.tensor.datasets import occupied_shape  # (here: the others need not wait for it)

    coords = np.array([[0, 0, 0], [95000, 2, 0], [5000, 2, 3], [95000, 0, 3]])
    tensor = COOTensor(coords, np.ones(4), (95001, 3, 4), ("i", "j", "t"))
    assert occupied_shape(tensor) == (3, 2, 2)


def test_bad_column_types_name_the_column_and_the_file(tmp_path):
    """Each with the way on for its type: a float index of whole numbers (what pandas makes of
    integers after a merge or a NaN) was told to "drop other columns" (a trial)."""
    import datetime

    def refused(name, index_i, pattern, value=(1.0, 2.0)):
        pq.write_table(pa.table({"i": index_i, "j": [0, 1], "t": [0, 1], "value": list(value)}), tmp_path / name)
        with pytest.raises(InputError, match=pattern + rf" \(in .*{name}\)$"):
            read_coo_parquet(tmp_path / name)

    refused("whole.parquet", [0.0, 1.0], r"^data\['i'\]='double': index columns must be integers; 'i' holds whole "
                                         r"numbers stored as double: cast it to int64 \(pandas: df\['i'\] = "
                                         r"df\['i'\]\.astype\('int64'\)\), or drop the column if it is not a mode "
                                         r"\(every column but 'value' is a mode index \('t' the last\)\)")
    refused("gaps.parquet", [0.0, None], r"^data\['i'\]='double': .*'i' holds whole numbers stored as double: drop "
                                         r"its 1 row\(s\) without a number, then cast it to int64 \(pandas: .*\)")
    # an extra numeric column (not a mode) cast to int64 as told became a fourth mode, nothing said (a fresh-user trial)
    pq.write_table(pa.table({"i": [0, 1], "j": [0, 1], "t": [0, 1], "extra": [1.0, 1.0], "value": [1.0, 2.0]}),
                   tmp_path / "extra.parquet")
    with pytest.raises(InputError, match=r"^data\['extra'\]='double': .*'extra' holds whole numbers stored as double: "
                                         r"cast it to int64 \(pandas: .*\), or drop the column if it is not a mode "
                                         r"\(every column but 'value' is a mode index \('t' the last\)\) \(in .*extra"):
        read_coo_parquet(tmp_path / "extra.parquet")
    refused("fraction.parquet", [0.5, 1.0], r"^data\['i'\]='double': index columns must be integers; 'i' holds "
                                            r"fractional numbers \(every column but 'value' is a mode index \('t' the last\)\)")
    refused("labels.parquet", ["a", "b"], r"^data\['i'\]='string': index columns must be integers; 'i' holds "
                                          r"labels: number them 0, 1, \.\.\. \(pandas\.factorize\), or drop the column .*")
    refused("times.parquet", [datetime.date(2020, 1, 1), datetime.date(2020, 1, 2)],
            r"^data\['i'\]='date32\[day\]': .*'i' holds date32\[day\] values: number its steps 0, 1, \.\.\. .*")
    refused("text.parquet", [0, 1], r"^data\['value'\]='string': the value column must hold numbers \(integer, float "
                                    r"or decimal\)", value=("a", "b"))
    # a decimal value column (a database's NUMERIC) is numbers: read as float64
    import decimal

    pq.write_table(pa.table({"i": [0, 1], "j": [0, 1], "t": [0, 1],
                             "value": pa.array([decimal.Decimal("1.25"), decimal.Decimal("-2.5")],
                                               pa.decimal128(12, 6))}), tmp_path / "decimal.parquet")
    np.testing.assert_array_equal(read_coo_parquet(tmp_path / "decimal.parquet").values, [1.25, -2.5])


def test_a_csv_or_other_non_parquet_file_is_named_for_what_it_is(tmp_path):
    """A CSV (the likeliest mistake) got Parquet's "magic bytes not found ... corrupted?" (a trial)."""
    import gzip

    csv = "i,j,t,value\n0,0,0,1.5\n1,1,1,2.5\n"
    files = {"a.csv": csv.encode(), "bom.csv": b"\xef\xbb\xbf" + csv.replace("\n", "\r\n").encode(),
             "a.csv.gz": gzip.compress(csv.encode()), "a.npy": b"\x93NUMPY\x01\x00v\x00{'descr': '<f8'}",
             "junk.bin": bytes(range(256)), "long.csv": ("\u00e9" * 400).encode()}
    for name, content in files.items():
        (tmp_path / name).write_bytes(content)
    taken = r"this takes a Parquet table of the observed entries .*README, 'Your own tensor'"
    csv_hint = taken + r"; convert a CSV with pandas: pandas\.read_csv\(path\)\.to_parquet\('data\.parquet', index=False\)$"
    for name, pattern in (("a.csv", r"a text file \(CSV\?\); " + csv_hint),
                          ("bom.csv", r"a text file \(CSV\?\); " + csv_hint),
                          ("long.csv", r"a text file \(CSV\?\); " + csv_hint),  # a character cut at 512 bytes
                          ("a.csv.gz", r"a gzip file \(a compressed CSV\?\); " + csv_hint),
                          ("a.npy", r"a NumPy \.npy file; " + taken + "$"),
                          ("junk.bin", r"not a readable Parquet file \(")):
        with pytest.raises(InputError, match=rf"^data='{tmp_path / name}': {pattern}"):
            read_coo_parquet(tmp_path / name)
    with pytest.raises(InputError, match=r"^data='<\d+ bytes>': a text file \(CSV\?\)"):  # bytes (from S3) too
        read_coo_parquet(csv.encode())


def test_loaded_tensors_are_read_only(tmp_path):
    """Bundled and user tensors own their entries: a write into them fails instead of silently
    changing a validated tensor (its shape, its finiteness)."""
    t = load_dataset("produc")
    with pytest.raises(ValueError, match="read-only"):
        t.values[0] = np.nan
    pq.write_table(pa.table({"i": [0, 1], "j": [0, 1], "t": [0, 1], "value": [1.0, 2.0]}), tmp_path / "x.parquet")
    user = read_coo_parquet(tmp_path / "x.parquet")
    with pytest.raises(ValueError, match="read-only"):
        user.coords[0, 0] = 7
    from paperline.kernels.tensor import load_dataset as exported

    assert exported is load_dataset


def test_index_out_of_int64_range_names_the_column_and_the_value(tmp_path):
    """A uint64 index above 2**63 - 1 wrapped to a negative int64 and was refused as "index columns
    must be >= 0", naming neither the column nor the value in the file."""
    big = tmp_path / "big.parquet"
    pq.write_table(pa.table({"i": [0, 1], "j": pa.array([0, 2**64 - 1], pa.uint64()), "t": [0, 1],
                             "value": [1.0, 2.0]}), big)
    with pytest.raises(InputError, match=r"^data\['j'\]=<max 18446744073709551615 \(uint64\)>: index too large: "
                                         r"coordinates are int64, so indices must be <= 2\*\*63 - 1 "
                                         r"\(in .*big\.parquet\)"):
        read_coo_parquet(big)
    neg = tmp_path / "neg.parquet"
    pq.write_table(pa.table({"i": [0, -3], "j": [0, 1], "t": [0, 1], "value": [1.0, 2.0]}), neg)
    with pytest.raises(InputError, match=r"^data\['i'\]=<min -3 \(int64\)>: index columns must be >= 0 "
                                         r"\(in .*neg\.parquet\)"):
        read_coo_parquet(neg)
    # uint64 indices that fit are read; the largest int64 index makes a mode of 2**63 (its + 1 wrapped negative)
    ok = tmp_path / "ok.parquet"
    pq.write_table(pa.table({"i": pa.array([0, 2], pa.uint64()), "j": [0, 2**63 - 1], "t": [0, 1],
                             "value": [1.0, 2.0]}), ok)
    tensor = read_coo_parquet(ok)
    assert tensor.shape == (3, 2**63, 2) and tensor.coords[:, 0].tolist() == [0, 2]
