"""Benchmark: tiled GEMM (paperline) against numpy.matmul on all cores, against dask.array matmul
on the same LocalCluster, and out-of-core against in-core.

Run with ``.venv/bin/python benchmarks/gemm.py`` (about 7 minutes on 2 cores; ``--sizes 4096``
for a quick look). Everything is measured in this run on the same machine and the same operands
(seeded, written once as ``.npy`` files, so every contender reads the same bytes from the page
cache):

* ``numpy.matmul`` with NumPy's BLAS as configured (threadpoolctl reports which), operands in memory;
* paperline on a LocalCluster of one single-threaded worker per core (the flows' cluster), operands
  as memory-mapped ``.npy`` files streamed tile by tile, the result written tile by tile into a
  ``.npy`` file (what the flow does with its output destination) and opened here as a memory map;
  also with the result gathered over Dask's comms into this process's memory instead;
* ``dask.array`` matmul on the same cluster, chunks = paperline's tiles read from the same files,
  result gathered into this process;
* paperline out of core: each worker's tile budget a quarter of the operands' bytes, against a
  budget that holds them all.

Each timing is the best of ``--repeats`` runs. The page cache is warmed before timing.
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np


def best_of(repeats: int, fn) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def write_operands(tmp: str, n: int, dtype: str) -> tuple[str, str]:
    from paperline.kernels.blas.sources import RandomSource, read_all

    paths = []
    for stream, name in enumerate("ab"):
        path = os.path.join(tmp, f"{name}-{n}-{dtype}.npy")
        np.save(path, read_all(RandomSource((n, n), dtype, seed=0, stream=stream)))
        paths.append(path)
    return paths[0], paths[1]


def dask_matmul(client, a_path: str, b_path: str, tile: int) -> np.ndarray:
    import dask.array as da

    def block(path: str, shape: tuple[int, int], dtype: np.dtype, chunks: int) -> da.Array:
        def read(block_info=None):
            (r0, r1), (c0, c1) = block_info[None]["array-location"]
            return np.ascontiguousarray(np.load(path, mmap_mode="r")[r0:r1, c0:c1])

        return da.map_blocks(read, chunks=da.core.normalize_chunks(chunks, shape), dtype=dtype, meta=np.empty((0, 0), dtype))

    a = np.load(a_path, mmap_mode="r")
    b = np.load(b_path, mmap_mode="r")
    x = block(a_path, a.shape, a.dtype, tile)
    y = block(b_path, b.shape, b.dtype, tile)
    return client.compute(x @ y).result()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", default="4096,8192")
    parser.add_argument("--dtypes", default="float32,float64")
    parser.add_argument("--tile", type=int, default=0, help="tile edge (default: n/4)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args()

    from distributed import Client, LocalCluster
    from threadpoolctl import threadpool_info

    from paperline.infra.cluster import configure_local_workers
    from paperline.kernels.blas import NpySource, make_problem
    from paperline.kernels.blas.runtime import DaskRuntime, run

    blas = [f"{i['internal_api']} {i.get('version')} ({i['num_threads']} threads, {i.get('architecture')})"
            for i in threadpool_info() if i["user_api"] == "blas"]
    print(f"NumPy {np.__version__}; BLAS seen by threadpoolctl: {'; '.join(blas)}")
    configure_local_workers()
    rows = []
    with tempfile.TemporaryDirectory(prefix="paperline-bench-gemm-") as tmp, \
            LocalCluster(n_workers=args.workers, threads_per_worker=1, processes=True, host="127.0.0.1",
                         dashboard_address=None) as cluster, Client(cluster) as client:
        rt = DaskRuntime(client)
        print(f"cluster: {len(rt.workers())} single-threaded workers")
        for n in [int(s) for s in args.sizes.split(",")]:
            for dtype in args.dtypes.split(","):
                tile = args.tile or n // 4
                a_path, b_path = write_operands(tmp, n, dtype)
                flops = 2.0 * n ** 3
                a, b = np.load(a_path), np.load(b_path)
                t_np = best_of(args.repeats, lambda: np.matmul(a, b))
                problem = make_problem("gemm", NpySource(a_path, "a"), NpySource(b_path, "b"), tile=tile)
                ref = np.matmul(a, b)
                del a, b
                out_path = os.path.join(tmp, f"c-{n}-{dtype}.npy")

                def to_file(problem=problem, out_path=out_path) -> None:
                    run(problem, rt, output=out_path, check_finite=False).commit()

                t_pl = best_of(args.repeats, to_file)
                err = float(np.abs(np.load(out_path, mmap_mode="r") - ref).max() / np.abs(ref).max())
                os.unlink(out_path)
                results = []
                t_gather = best_of(args.repeats, lambda: results.append(run(problem, rt, check_finite=False)))
                err = max(err, float(np.abs(results[-1].output - ref).max() / np.abs(ref).max()))
                results.clear()
                t_da = best_of(args.repeats, lambda: dask_matmul(client, a_path, b_path, tile))
                del ref
                rows.append((n, dtype, tile, flops, t_np, t_pl, t_da, t_gather, err))
                print(f"n={n} {dtype} tile={tile}: numpy {flops / t_np / 1e9:.1f} GFLOP/s, paperline "
                      f"{flops / t_pl / 1e9:.1f} (gathered {flops / t_gather / 1e9:.1f}), dask.array "
                      f"{flops / t_da / 1e9:.1f}; paperline/numpy {t_np / t_pl:.3f}, paperline/dask.array "
                      f"{t_da / t_pl:.3f} (max rel. error {err:.1e})", flush=True)
        # Out of core: the largest size, float64, budget a quarter of the operands' bytes.
        n = max(int(s) for s in args.sizes.split(","))
        tile = args.tile or n // 4
        a_path, b_path = write_operands(tmp, n, "float64")
        operand_bytes = 2 * n * n * 8
        problem = make_problem("gemm", NpySource(a_path, "a"), NpySource(b_path, "b"), tile=tile)
        stats = {}

        def once(budget: int, label: str) -> None:
            stats[label] = run(problem, rt, memory_budget=budget, check_finite=False)

        t_in = best_of(args.repeats, lambda: once(2 * operand_bytes, "in"))
        t_out = best_of(args.repeats, lambda: once(operand_bytes // 4, "out"))
        print(f"out of core n={n} float64: budget {operand_bytes // 4 / 2**20:.0f} MiB per worker "
              f"(operands {operand_bytes / 2**20:.0f} MiB): {2.0 * n**3 / t_out / 1e9:.1f} GFLOP/s, hit rate "
              f"{stats['out'].cache_hit_rate:.2f}; in core {2.0 * n**3 / t_in / 1e9:.1f} GFLOP/s, hit rate "
              f"{stats['in'].cache_hit_rate:.2f}")

    print("\nratios (> 1: paperline faster)")
    print(f"{'n':>6} {'dtype':>8} {'tile':>6} {'vs numpy.matmul':>16} {'vs dask.array':>14} "
          f"{'gathered vs numpy':>18} {'gathered vs dask.array':>23}")
    for n, dtype, tile, flops, t_np, t_pl, t_da, t_gather, err in rows:
        print(f"{n:>6} {dtype:>8} {tile:>6} {t_np / t_pl:>16.3f} {t_da / t_pl:>14.3f} {t_np / t_gather:>18.3f} "
              f"{t_da / t_gather:>23.3f}")
    print(f"out of core (4x budget) / in core: {t_in / t_out:.3f}")


if __name__ == "__main__":
    main()
