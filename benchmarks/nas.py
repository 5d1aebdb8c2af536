"""Benchmark: sample efficiency of the search campaigns, with at least 5 seeds each.

Run with ``.venv/bin/python benchmarks/nas.py`` (budget 100; at budget 60 all four problems took
about 40 minutes on 2 cores, NAS-Bench-201 alone at 100 7.4 minutes; ``--quick`` for a smaller
one). Everything is measured in this run, on the same machine, with the same seeds; for a seed,
every optimizer starts from the same scrambled-Sobol initial design.

* Multi-objective: LaMOO (qEHVI inside), qEHVI, NSGA-II and random on NAS-Bench-201 cifar10
  (validation accuracy against model size) and on VehicleSafety (3 objectives).
* Single-objective: LA-MCTS (BO inside), TuRBO, BO (qLogEI) and random on Ackley-20d and Levy-20d.

For each problem it prints, per optimizer, the number of samples needed to reach 95% of the best
hypervolume (or of the best value's improvement over the initial design, for single objectives)
that any optimizer reached with any seed, as mean ± sd over the seeds (a seed that never reaches it
counts as the budget, and is reported) and as the median (such a seed counted as never), the
ratio to the peer (qEHVI, or TuRBO), the final hypervolume or best value, and the time per
suggestion (seconds per ask of a batch of q).
Seeds run two at a time in separate processes, each with one torch thread.

Held-out and pooled readings: ``--first-seed 5 --seeds 10`` runs seeds 5-14; ``--save runs.json``
keeps every campaign's trace, and ``--load a.json b.json`` reports over saved runs together (the
target is then the best of all of them), without running anything:

    benchmarks/nas.py --problems nasbench201-cifar10 --seeds 5 --save s0.json
    benchmarks/nas.py --problems nasbench201-cifar10 --first-seed 5 --seeds 10 --save s5.json
    benchmarks/nas.py --load s0.json s5.json          # 15 seeds

An optimizer with other options is reported under its own name, against the same peer:

    benchmarks/nas.py --problems vehicle-safety --optimizers lamoo --options 'lamoo={"kernel": "rbf"}'
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed

import numpy as np
from _args import at_least, each_once, interruptible, one_line_errors, output_file, positive  # benchmarks/_args.py

MULTI = {
    "nasbench201-cifar10": ({"objectives": ["val_accuracy_pct", "model_size_mb"]}, ["lamoo", "qehvi", "nsga2", "random"]),
    "vehicle-safety": ({}, ["lamoo", "qehvi", "nsga2", "random"]),
}
SINGLE = {
    "ackley": ({"dim": 20}, ["lamcts", "turbo", "bo", "random"]),
    "levy": ({"dim": 20}, ["lamcts", "turbo", "bo", "random"]),
}
PEER = {"lamoo": "qehvi", "lamcts": "turbo"}


def one(args: tuple) -> dict:
    """One seeded campaign in a worker process: its score trace and seconds per suggestion."""
    problem, options, optimizer, seed, budget, q, n_init, optimizer_options = args
    import warnings

    import torch

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    from paperline.kernels.search.campaign import Campaign, run_campaign

    t0 = time.perf_counter()
    c = run_campaign(Campaign(problem, optimizer, budget=budget, q=q, seed=seed, n_init=n_init,
                              problem_options=options, optimizer_options=optimizer_options))
    asks = [s for b, s in enumerate(c.suggest_seconds) if b * q >= n_init]  # model asks, not the design
    return {"problem": problem, "optimizer": label(optimizer, optimizer_options), "seed": seed,
            "trace": c.score_trace().tolist(),
            "suggest_s": float(np.mean(asks)) if asks else math.nan, "wall_s": time.perf_counter() - t0}


def label(optimizer: str, options: dict) -> str:
    """An optimizer's name in the report: with non-default options, ``lamoo[kernel=rbf]``."""
    return optimizer + (f"[{','.join(f'{k}={v}' for k, v in sorted(options.items()))}]" if options else "")


def base(name: str) -> str:
    """An optimizer's name without its options label (``lamoo[kernel=rbf]`` ->
    ``lamoo``)."""
    return name.partition("[")[0]


def samples_to(trace: list[float], target: float, budget: int) -> tuple[float, bool]:
    """``(samples until the trace first reaches target, True)``, or ``(budget, False)``
    when it never does."""
    hit = np.flatnonzero(np.asarray(trace) >= target)
    return (float(hit[0] + 1), True) if hit.size else (float(budget), False)


def mean_finite(values: list[float]) -> float:
    """The mean of the finite values (nan when there are none)."""
    finite = [v for v in values if math.isfinite(v)]
    return float(np.mean(finite)) if finite else math.nan


def report(problem: str, runs: list[dict], budget: int, n_init: int, multi: bool) -> None:
    """Print one problem's table: per optimizer, samples to the target (mean ± sd and
    median), seeds reaching it, ratio to the peer, final hypervolume or best value,
    s/suggestion."""
    if not runs:
        print(f"\n== {problem}: no campaign finished")
        return
    names = list(dict.fromkeys(r["optimizer"] for r in runs))
    best = max(max(r["trace"]) for r in runs)
    if multi:
        target = 0.95 * best
        what = f"95% of the best hypervolume found ({best:.6g})"
    else:  # 95% of the way from the median initial-design value to the best value found
        start = float(np.median([r["trace"][n_init - 1] for r in runs]))
        target = start + 0.95 * (best - start)
        what = f"95% of the improvement from the initial design ({start:.4g}) to the best value found ({best:.4g})"
    print(f"\n== {problem}: samples to reach {what}; budget {budget}, {len({r['seed'] for r in runs})} seeds")
    rows = {}
    for name in names:
        mine = [r for r in runs if r["optimizer"] == name]
        hits = [samples_to(r["trace"], target, budget) for r in mine]
        n = np.array([h[0] for h in hits])
        final = np.array([r["trace"][-1] for r in mine])
        # the median with a seed that never reached the target counted as never (inf): unlike the
        # mean, it is not pulled down by the budget cap while at least half the seeds reach it
        median = float(np.median([h[0] if h[1] else math.inf for h in hits]))
        rows[name] = (n.mean(), n.std(ddof=1) if n.size > 1 else 0.0, sum(h[1] for h in hits), len(hits),
                      final.mean(), final.std(ddof=1) if final.size > 1 else 0.0,
                      mean_finite([r["suggest_s"] for r in mine]), median)
    w = max(10, *(len(n) for n in names))
    print(f"{'optimizer':{w}s} {'samples to target':>20s} {'median':>7s} {'reached':>8s} {'ratio':>7s} "
          f"{'final ' + ('HV' if multi else 'best'):>22s} {'s/suggestion':>13s}")
    for name, (mean, sd, reached, total, fmean, fsd, sug, median) in rows.items():
        peer = PEER.get(base(name))
        ratio = f"{rows[peer][0] / mean:.2f}" if peer in rows else "-"
        med = f"{median:.0f}" if math.isfinite(median) else f">{budget}"
        print(f"{name:{w}s} {mean:12.1f} ± {sd:5.1f} {med:>7s} {reached:4d}/{total:<3d} {ratio:>7s} "
              f"{fmean:13.5g} ± {fsd:7.3g} {sug:13.3f}")
    for name in rows:
        peer = PEER.get(base(name))
        if peer in rows:
            mine_med, peer_med = rows[name][7], rows[peer][7]
            if math.isfinite(mine_med) and math.isfinite(peer_med):
                medians = f"{peer_med / mine_med:.2f}"
            elif math.isfinite(mine_med):
                medians = f"> {budget / mine_med:.2f} ({peer}'s median is past the budget)"
            else:
                medians = "- (past the budget)"
            print(f"ratio {peer} samples / {name} samples = {rows[peer][0] / rows[name][0]:.2f} "
                  f"(> 1: {name} needs fewer samples; a seed that never reaches the target counts as the "
                  f"budget); of the medians: {medians}")


def main() -> None:
    """Parse the arguments, run the campaigns (or, with ``--load``, read saved ones) and
    print each problem's report."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=positive, default=None, help="number of seeds (default 5; --quick: 3)")
    parser.add_argument("--first-seed", type=at_least(0), default=0, help="seeds first-seed .. first-seed + seeds - 1")
    parser.add_argument("--optimizers", default=None, help="comma-separated subset of each problem's optimizers")
    parser.add_argument("--save", type=output_file, default=None, help="write every campaign's trace to this JSON file")
    parser.add_argument("--load", nargs="+", default=[], help="report over these saved runs; run nothing")
    parser.add_argument("--budget", type=positive, default=None, help="evaluations per campaign (default 100; --quick: 40)")
    parser.add_argument("--q", type=positive, default=5)
    parser.add_argument("--n-init", type=positive, default=10)
    parser.add_argument("--problems", default=",".join([*MULTI, *SINGLE]))
    parser.add_argument("--processes", type=positive, default=min(2, os.cpu_count() or 1))
    parser.add_argument("--quick", action="store_true", help="3 seeds, budget 40 (unless --seeds or --budget say)")
    parser.add_argument("--options", action="append", default=[], metavar='OPTIMIZER=JSON',
                        help='optimizer options, e.g. lamoo=\'{"kernel": "rbf"}\' (repeatable); reported as '
                             'lamoo[kernel=rbf], ranked against the same peer')
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    if args.processes > 4 * cores:  # (1000 started, and a SIGTERM then took 30 s and two tracebacks: a trial)
        parser.error(f"--processes {args.processes}: at most {4 * cores} on this machine's {cores} core(s) (each "
                     "campaign is a process of its own, with one torch thread)")
    if args.load:
        missing = [p for p in args.load if not os.path.isfile(p)]
        if missing:
            parser.error(f"--load {' '.join(missing)}: no such file")
        # a file named twice (a.json a.json, ./a.json) is read once, as a list option's repeated item
        args.load = list({os.path.realpath(p): p for p in reversed(args.load)}.values())[::-1]
        one_line_errors(parser, lambda: report_saved(args.load))
        return
    # --quick's values where --seeds or --budget are not given (it overrode them unsaid: a trial)
    args.seeds = args.seeds or (3 if args.quick else 5)
    args.budget = args.budget or (40 if args.quick else 100)
    if args.budget < args.n_init:
        parser.error(f"--budget {args.budget}: below --n-init {args.n_init} (the initial design is part of the budget)")
    wanted = each_once(p.strip() for p in args.problems.split(",") if p.strip())
    unknown = [p for p in wanted if p not in {**MULTI, **SINGLE}]
    if unknown:
        parser.error(f"unknown --problems {unknown}; known: {', '.join([*MULTI, *SINGLE])}")
    if not wanted:  # (',' reached the --optimizers error below: a trial)
        parser.error(f"--problems {args.problems!r} names no problem (leave it out for every one)")
    subset = each_once(o.strip() for o in (args.optimizers or "").split(",") if o.strip())
    if args.optimizers is not None and not subset:  # '' ran every optimizer (a trial)
        parser.error(f"--optimizers {args.optimizers!r} names no optimizer (leave it out for every one)")
    known = {o for p in wanted for o in {**MULTI, **SINGLE}[p][1]}
    if unknown := [o for o in subset if o not in known]:  # (dropped unsaid: a review)
        parser.error(f"--optimizers: {', '.join(unknown)} not among these problems' optimizers "
                     f"({', '.join(sorted(known))})")
    optimizer_options = {}
    for item in args.options:
        name, sep, raw = item.partition("=")
        try:
            optimizer_options[name.strip()] = json.loads(raw)
        except json.JSONDecodeError as exc:
            parser.error(f"--options {item!r}: not OPTIMIZER=JSON ({exc})")
        if not sep or not isinstance(optimizer_options[name.strip()], dict):
            parser.error(f"--options {item!r}: expected OPTIMIZER={{...}}")
    jobs = []
    for problem in wanted:
        options, optimizers = {**MULTI, **SINGLE}[problem]
        jobs += [(problem, options, o, s, args.budget, args.q, args.n_init, optimizer_options.get(o, {}))
                 for o in optimizers if not subset or o in subset
                 for s in range(args.first_seed, args.first_seed + args.seeds)]
    if not jobs:
        parser.error(f"--optimizers {subset} names none of the problems' optimizers")
    unused = sorted(set(optimizer_options) - {job[2] for job in jobs})
    if unused:  # silently ignored before
        parser.error(f"--options for {', '.join(unused)}, which no campaign here runs")

    def check() -> None:
        """Each problem and optimizer built once, here: bad --q, --n-init or --options failed in a
        worker process with a traceback (a trial)."""
        from paperline.kernels.search.campaign import Campaign

        for problem, options, optimizer, _, budget, q, n_init, opts in {(j[0], j[2]): j for j in jobs}.values():
            Campaign(problem, optimizer, budget=budget, q=q, seed=0, n_init=n_init, problem_options=options,
                     optimizer_options=opts)

    one_line_errors(parser, check)
    print(f"{len(jobs)} campaigns ({args.seeds} seeds, budget {args.budget}, q {args.q}, n_init {args.n_init}) "
          f"on {args.processes} processes")
    t0 = time.perf_counter()
    results = []
    interrupted = False
    with ProcessPoolExecutor(args.processes, initializer=_default_sigterm) as pool:
        futures = [pool.submit(one, job) for job in jobs]
        try:
            for f in as_completed(futures):
                r = f.result()
                results.append(r)
                print(f"  [{len(results)}/{len(jobs)}] {r['problem']} {r['optimizer']} seed {r['seed']}: "
                      f"final {r['trace'][-1]:.5g}, {r['suggest_s']:.2f} s/suggestion, {r['wall_s']:.0f} s", flush=True)
        except KeyboardInterrupt:  # report what finished
            interrupted = True
            # the running campaigns (the pool waited for them: a trial), ended through multiprocessing,
            # which reaps them: the pool, broken, fails the other futures itself and shuts down.
            # (Futures cancelled here first made its management thread print "InvalidStateError:
            # CANCELLED" as it failed them (a trial); workers reaped behind its back by
            # stop_children() left it polling them for ever, Python 3.11.)
            for process in multiprocessing.active_children():
                process.terminate()
            print("interrupted: reporting the campaigns that finished")
    for problem in wanted:
        report(problem, [r for r in results if r["problem"] == problem], args.budget, args.n_init, problem in MULTI)
    print(f"\ntotal {time.perf_counter() - t0:.0f} s")
    # after the report (a save that failed lost it: a trial); an interrupted run replaced an earlier
    # save of the same path with its few campaigns, or none (another): it keeps that file
    if args.save and not results:
        print(f"nothing saved to {args.save}: no campaign finished")
    elif args.save and interrupted and args.save.exists():
        print(f"{args.save} kept as it was: this run was interrupted ({len(results)} of {len(jobs)} campaigns)")
    elif args.save:
        part = args.save.with_name(f".{args.save.name}.part")
        part.write_text(json.dumps({"budget": args.budget, "n_init": args.n_init, "q": args.q, "runs": results}))
        part.replace(args.save)
        print(f"saved {len(results)} campaigns to {args.save}")
    if interrupted:
        raise KeyboardInterrupt  # (interruptible's exit status: 130 or 143, not 0)


def _default_sigterm() -> None:
    """A pool worker's SIGTERM ends it (forked, it inherited ``interruptible``'s handler, and
    ignored the SIGTERM of :func:`stop_children`: 5 s until the SIGKILL, a review); a terminal's
    Ctrl-C is left to the parent, which stops the workers and says it once."""
    import signal

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def report_saved(paths: list[str]) -> None:
    """Report over campaigns saved by ``--save`` (same budget, n_init and q), pooled.

    Raises:
        InputError: a file that is not such a save (not JSON, or without its keys), files of
            different settings, or a campaign (problem, optimizer, seed) in two files.
    """
    from paperline.kernels.errors import Described, InputError

    saved = []
    for path in paths:
        try:
            with open(path) as f:
                save = json.load(f)
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:  # (a traceback: a trial)
            raise InputError("--load", path, f"not a file --save wrote ({type(exc).__name__}: {exc})") from None
        lacking = [k for k in ("budget", "n_init", "q", "runs") if not isinstance(save, dict) or k not in save]
        if lacking or not isinstance(save["runs"], list):
            raise InputError("--load", path, f"not a file --save wrote (no {', '.join(lacking) or 'list of runs'})")
        saved.append(save)
    settings = {(s["budget"], s["n_init"], s["q"]) for s in saved}
    if len(settings) != 1:  # (these two were SystemExit's bare line, without "nas.py: error:": a trial)
        raise InputError("--load", Described(" ".join(paths)),
                         f"the files were run with different (budget, n_init, q): {sorted(settings)}")
    budget, n_init, _ = settings.pop()
    runs = [r for s in saved for r in s["runs"]]
    seen: dict[tuple, str] = {}
    for s, path in zip(saved, paths):
        for r in s["runs"]:
            key = (r["problem"], r["optimizer"], r["seed"])
            if key in seen:
                raise InputError("--load", path, f"{key} is in {seen[key]} too; a seed counts once")
            seen[key] = path
    for problem in dict.fromkeys(r["problem"] for r in runs):
        report(problem, [r for r in runs if r["problem"] == problem], budget, n_init, problem in MULTI)


if __name__ == "__main__":
    sys.exit(interruptible(main))
