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
    junk.write_bytes(b"definitely not parquet")
    with pytest.raises(InputError, match="^data=.*junk.parquet.*not a readable Parquet file"):
        read_coo_parquet(junk)
    nan = tmp_path / "nan.parquet"
    pq.write_table(pa.table({"i": [0, 1], "j": [0, 1], "t": [0, 1], "value": [1.0, float("nan")]}), nan)
    with pytest.raises(InputError, match="^data=.*nan.parquet.*values=.*1 NaN.*must be finite"):
        read_coo_parquet(nan)
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


def test_bad_column_types_name_the_column_and_the_file(tmp_path):
    floats = tmp_path / "floats.parquet"
    pq.write_table(pa.table({"i": [0.0, 1.0], "j": [0, 1], "t": [0, 1], "value": [1.0, 2.0]}), floats)
    with pytest.raises(InputError, match=r"^data\['i'\]='double'.*integers; every column but 'value' is a mode "
                                         r"index.*\(in .*floats.parquet\)"):
        read_coo_parquet(floats)
    text = tmp_path / "text.parquet"
    pq.write_table(pa.table({"i": [0, 1], "j": [0, 1], "t": [0, 1], "value": ["a", "b"]}), text)
    with pytest.raises(InputError, match=r"^data\['value'\]=.*numeric \(in .*text.parquet\)"):
        read_coo_parquet(text)


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
    with pytest.raises(InputError, match=r"^data\['j'\]='max 18446744073709551615 \(uint64\)': index too large: "
                                         r"coordinates are int64, so indices must be <= 2\*\*63 - 1 "
                                         r"\(in .*big\.parquet\)"):
        read_coo_parquet(big)
    neg = tmp_path / "neg.parquet"
    pq.write_table(pa.table({"i": [0, -3], "j": [0, 1], "t": [0, 1], "value": [1.0, 2.0]}), neg)
    with pytest.raises(InputError, match=r"^data\['i'\]='min -3 \(int64\)': index columns must be >= 0 "
                                         r"\(in .*neg\.parquet\)"):
        read_coo_parquet(neg)
    # uint64 indices that fit are read; the largest int64 index makes a mode of 2**63 (its + 1 wrapped negative)
    ok = tmp_path / "ok.parquet"
    pq.write_table(pa.table({"i": pa.array([0, 2], pa.uint64()), "j": [0, 2**63 - 1], "t": [0, 1],
                             "value": [1.0, 2.0]}), ok)
    tensor = read_coo_parquet(ok)
    assert tensor.shape == (3, 2**63, 2) and tensor.coords[:, 0].tolist() == [0, 2]
