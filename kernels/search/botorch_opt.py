"""BoTorch building blocks and the BO baselines: ``bo`` (qLogEI), ``turbo`` (TuRBO-1),
``qehvi`` (qLogEHVI) and ``qnehvi`` (qLogNEHVI).

Models are BoTorch ``SingleTaskGP`` s on :meth:`SearchSpace.features` (the unit box, or one-hot
for categorical spaces) with standardized outcomes. On a box the acquisition is maximized with
``optimize_acqf``; on a categorical space (and inside the learned regions of LA-MCTS/LaMOO) it is
maximized over a finite candidate pool with ``optimize_acqf_discrete``. Every call runs inside
``torch.random.fork_rng`` seeded by the optimizer's batch seed, so suggestions are reproducible.

References: Eriksson et al., "Scalable Global Optimization via Local Bayesian Optimization"
(TuRBO, NeurIPS 2019); Daulton et al., "Differentiable Expected Hypervolume Improvement" (qEHVI,
NeurIPS 2020) and "Parallel Bayesian Optimization of Multiple Noisy Objectives with Expected
Hypervolume Improvement" (qNEHVI, NeurIPS 2021); Ament et al., "Unexpected Improvements to
Expected Improvement" (the Log variants, NeurIPS 2023).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shutil
import sys
import sysconfig
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from paperline.kernels.errors import InputError
from paperline.kernels.search.base import OPTIMIZERS, Optimizer
from paperline.kernels.search.space import SearchSpace

MC_SAMPLES = 64
GP_FIT_MAXITER = 100  # L-BFGS-B iterations of the GP hyperparameter fit (BoTorch's default is unbounded)


def fused_kernel_dir() -> Path:
    """Where torch builds BoTorch's fused qLogEHVI kernel for this interpreter (virtual env):
    ``$XDG_CACHE_HOME/torch_extensions/paperline-py3X-<sha256 of sys.prefix, 12 hex digits>``
    (``~/.cache`` when ``XDG_CACHE_HOME`` is unset), the prefix with its symbolic links resolved
    (a clone whose ``.venv`` linked to another's rebuilt the kernel in a NAS campaign, a silent
    minute and a half: a trial)."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    tag = hashlib.sha256(os.path.realpath(sys.prefix).encode()).hexdigest()[:12]
    return cache / "torch_extensions" / f"paperline-py{sys.version_info[0]}{sys.version_info[1]}-{tag}"


def load_fused_kernel() -> Any | None:
    """BoTorch's fused C++ kernel of qLogEHVI's inner loop (1.5-3x faster on CPU), built by
    torch's JIT on first use, or None where it cannot be built (no C++ compiler: BoTorch warns
    once and uses its PyTorch path).

    The build takes about 40 s of one core (measured on this 2-core machine), so ``make install``
    runs it once; afterwards it loads in well under a second. torch names its build directory by
    the extension's name alone, and the compiler command holds the virtual env's paths, so every
    env sharing ``~/.cache/torch_extensions`` rebuilt it in turn (seven rebuilds of 40-100 s on
    one machine in a day, each one stalling a NAS campaign). Unless ``TORCH_EXTENSIONS_DIR`` is
    set, each env builds into its own :func:`fused_kernel_dir` (set here, before BoTorch loads
    the kernel; child processes inherit it).

    torch's builder (even of a kernel already built) holds a lock file, ``logei_fused_ext/lock``,
    that records no owner and that it waits on, without a time limit, for as long as it exists: a
    process killed while building or loading (SIGTERM or SIGKILL: a killed ``make install`` or NAS
    worker; Ctrl-C lets torch remove it) left it behind, and every later load then hung at 0% CPU. Paperline's loaders take turns
    under ``paperline-build.lock`` (an ``fcntl`` lock, released by the kernel when its holder
    dies), so the holder knows that a torch lock in the env's own directory is a dead builder's,
    and deletes it. In a ``TORCH_EXTENSIONS_DIR`` of the user's, shared with other programs, the
    lock may be a live build of theirs: it is left alone and named in a warning.
    """
    directory = Path(os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(fused_kernel_dir())))
    from botorch.acquisition.multi_objective import logei  # noqa: PLC0415

    loader = getattr(logei, "_try_load_fused_kernel", None)  # BoTorch's own lazy loader (0.18; private)
    if loader is None:  # another BoTorch: its acquisitions load what they load, in the directory set above
        return None
    if getattr(logei, "_load_attempted", False):  # loaded (or found unbuildable) in this process
        return getattr(logei, "_C", None)
    import fcntl  # noqa: PLC0415 - POSIX

    torch_lock = directory / "logei_fused_ext" / "lock"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        turn = open(directory / "paperline-build.lock", "a")  # noqa: SIM115 - closing it (or dying) unlocks
    except OSError:  # a directory torch cannot build in either: BoTorch warns and uses its PyTorch path
        loader()
        return getattr(logei, "_C", None)
    with turn:
        fcntl.flock(turn, fcntl.LOCK_EX)  # waits while another paperline process loads or builds
        if torch_lock.exists():
            if directory == fused_kernel_dir():
                torch_lock.unlink(missing_ok=True)  # no paperline loader runs: a dead builder's
            else:
                warnings.warn(f"torch's build lock {torch_lock} exists, so loading BoTorch's fused kernel waits "
                              "until it is gone; if no build of it is running, delete that file", stacklevel=2)
        compiler = shutil.which(os.environ.get("CXX", "c++"))  # (none: BoTorch says it cannot build, at once)
        with_ninja = _path_with_env_ninja(os.environ.get("PATH"))
        if with_ninja is not None and with_ninja != os.environ.get("PATH"):
            # for good, as an activated env has it: restored after the load, it would undo another
            # thread's change made meanwhile (a review)
            os.environ["PATH"] = with_ninja
        if compiler and _needs_build(directory / "logei_fused_ext"):  # (a silent 40-100 s: trials)
            print(f"building BoTorch's fused qLogEHVI kernel in {directory} (about 40 s, once per environment)",
                  file=sys.stderr, flush=True)
        loader()
    return getattr(logei, "_C", None)


def _path_with_env_ninja(path: str | None) -> str | None:
    """``path`` (a ``PATH`` value) with this environment's scripts directory first when the ``ninja``
    package installed its ninja there, so that torch's builder runs the same ninja whatever the
    caller's ``PATH``.

    ninja rebuilds a target whose command's hash in its log differs, and ninja 1.11 (Debian's
    /usr/bin/ninja) and 1.13 (the ``ninja`` package's) hash the same command differently: the
    kernel ``make install`` built (its ``PATH`` without the env's bin directory) was rebuilt, a
    silent 35-40 s, by the first NAS run in an activated env, and again in turn by each process
    started the other way (a trial). An unset ``path`` is the system's default (``os.defpath``,
    as a shell and ``subprocess`` take it: the compiler is found there); one that starts with the
    scripts directory is returned as it is. None (``PATH`` left as it is) without an env ninja.
    """
    scripts = sysconfig.get_path("scripts")
    ninja = shutil.which("ninja", path=scripts)
    if ninja is None:
        return None
    rest = os.defpath if path is None else path
    if rest.split(os.pathsep)[0] == scripts:
        return rest
    return os.pathsep.join([scripts, rest]) if rest else scripts


def _needs_build(build: Path) -> bool:
    """Whether torch's builder will compile the kernel in ``build`` (its ``logei_fused_ext`` directory):
    no library built there yet, or ninja (the one ``PATH`` finds) has work to do (a newer BoTorch
    source, another compiler command). A build that torch's builder decides on by a new
    ``build.ninja`` (another torch's flags) is built without this being known beforehand."""
    if not any(build.glob("*.so")):
        return True
    ninja = shutil.which("ninja")
    if ninja is None or not (build / "build.ninja").is_file():
        return False  # (torch's builder refuses without ninja; BoTorch warns and uses its PyTorch path)
    import subprocess  # noqa: PLC0415

    try:
        dry = subprocess.run([ninja, "-n", "-C", str(build)], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return dry.returncode == 0 and "no work to do" not in dry.stdout


@contextlib.contextmanager
def seeded_torch(seed: int) -> Iterator[None]:
    """Run torch code with a fixed global seed, restoring the caller's RNG state afterwards."""
    import torch

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # BoTorch's numerical/input warnings on tiny data sets
            yield


def fit_gp(features: np.ndarray, y: np.ndarray) -> Any:
    """A fitted ``SingleTaskGP`` (``n x f`` inputs in [0, 1], ``n x m`` outputs, standardized).

    Raises:
        InputError: fewer than 2 points or non-finite values.
    """
    import torch
    from botorch.fit import fit_gpytorch_mll
    from botorch.models import SingleTaskGP
    from botorch.models.transforms.outcome import Standardize
    from gpytorch.mlls import ExactMarginalLogLikelihood

    if features.shape[0] < 2 or not np.isfinite(y).all():
        raise InputError("training data", features.shape, "a GP needs >= 2 finite observations")
    x_t = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float64))
    y_t = torch.from_numpy(np.ascontiguousarray(y, dtype=np.float64))
    model = SingleTaskGP(x_t, y_t, outcome_transform=Standardize(m=y_t.shape[-1]))
    try:
        fit_gpytorch_mll(ExactMarginalLogLikelihood(model.likelihood, model),
                         optimizer_kwargs={"options": {"maxiter": GP_FIT_MAXITER}})
    except Exception:  # noqa: BLE001 - a failed hyperparameter fit keeps the prior's values, as BoTorch's tutorials do
        pass
    return model


def acquisition(kind: str, model: Any, features: np.ndarray, y: np.ndarray, *, seed: int,
                ref_point: np.ndarray | None = None) -> Any:
    """A BoTorch acquisition function: ``ei`` (qLogEI), ``ehvi`` (qLogEHVI) or ``nehvi`` (qLogNEHVI).

    ``features``/``y`` are the training data (``n x f``, ``n x m``); ``ref_point`` (``m``) is for
    the hypervolume kinds, in the maximization convention. MC samplers are quasi-random with ``seed``.

    Raises:
        InputError: an unknown ``kind``, or a hypervolume kind without ``ref_point`` of ``m`` values.
    """
    import torch
    from botorch.acquisition.logei import qLogExpectedImprovement
    from botorch.acquisition.multi_objective.logei import (
        qLogExpectedHypervolumeImprovement,
        qLogNoisyExpectedHypervolumeImprovement,
    )
    from botorch.sampling import SobolQMCNormalSampler
    from botorch.utils.multi_objective.box_decompositions.non_dominated import FastNondominatedPartitioning

    sampler = SobolQMCNormalSampler(torch.Size([MC_SAMPLES]), seed=seed)
    y_t = torch.from_numpy(np.ascontiguousarray(y, dtype=np.float64))
    if kind in ("ehvi", "nehvi"):
        load_fused_kernel()  # into this env's own build directory, before the constructor loads it
    if kind == "ei":
        return qLogExpectedImprovement(model, best_f=y_t.max(), sampler=sampler)
    if kind not in ("ehvi", "nehvi"):
        raise InputError("acquisition", kind, "known: ei, ehvi, nehvi")
    if ref_point is None or np.asarray(ref_point).shape != (y_t.shape[-1],):  # None gave a NaN point, silently
        raise InputError("ref_point", ref_point, f"{kind} needs one reference value per objective ({y_t.shape[-1]})")
    ref = torch.from_numpy(np.asarray(ref_point, dtype=np.float64))
    if kind == "ehvi":
        partitioning = FastNondominatedPartitioning(ref_point=ref, Y=y_t)
        return qLogExpectedHypervolumeImprovement(model, ref_point=ref, partitioning=partitioning, sampler=sampler)
    x_t = torch.from_numpy(np.ascontiguousarray(features, dtype=np.float64))  # nehvi
    return qLogNoisyExpectedHypervolumeImprovement(model, ref_point=ref, X_baseline=x_t, sampler=sampler,
                                                   prune_baseline=True)


def select_discrete(acqf: Any, space: SearchSpace, pool: np.ndarray, q: int, *, shortlist: int = 0) -> np.ndarray:
    """The ``q`` rows of ``pool`` (``k x d`` points) chosen greedily by ``acqf`` (``optimize_acqf_discrete``).

    ``shortlist`` > 0 (and ``q`` > 1): the greedy rounds after the first choose among the
    ``max(shortlist, q)`` candidates with the highest single-point value only. The first round scores every
    candidate alone, which is cheap; round ``j`` scores each jointly with the ``j`` points already
    chosen, and a q-batch hypervolume improvement costs ``2^(j+1) - 1`` box sums per sample, so
    without a shortlist the later rounds are ~56/57 of the work at q = 5.
    """
    import torch
    from botorch.optim import optimize_acqf_discrete

    pool = np.unique(pool, axis=0)
    if pool.shape[0] <= q:
        return pool
    feats = space.features(pool)
    shortlist = max(shortlist, q) if shortlist > 0 else 0  # a batch of q needs q candidates
    if shortlist and q > 1 and pool.shape[0] > shortlist:
        with torch.no_grad():
            alone = torch.cat([acqf(chunk.unsqueeze(-2)) for chunk in torch.from_numpy(feats).split(512)])
        keep = np.sort(np.argsort(-alone.numpy(), kind="stable")[:shortlist])
        pool, feats = pool[keep], feats[keep]
    chosen, _ = optimize_acqf_discrete(acqf, q=q, choices=torch.from_numpy(feats), unique=True, max_batch_size=512)
    chosen = chosen.detach().numpy()
    # map the chosen feature rows back to points
    lookup = {tuple(np.round(f, 12)): i for i, f in enumerate(feats)}
    return pool[[lookup[tuple(np.round(c, 12))] for c in chosen]]


def optimize_box(acqf: Any, dim: int, q: int) -> np.ndarray:
    """``q x dim`` points of the unit box maximizing ``acqf`` (``optimize_acqf``: multi-start L-BFGS-B,
    sequential greedy over the batch)."""
    import torch
    from botorch.optim import optimize_acqf

    bounds = torch.stack([torch.zeros(dim, dtype=torch.float64), torch.ones(dim, dtype=torch.float64)])
    # Sequential greedy, few restarts: on 2 CPU cores as good as the joint q-batch optimization
    # on BraninCurrin and 5x faster (measured in the nas benchmark's "time per suggestion").
    x, _ = optimize_acqf(acqf, bounds=bounds, q=q, num_restarts=2, raw_samples=128, sequential=True,
                         options={"batch_limit": 2, "maxiter": 50})
    return x.detach().numpy()


def refine_box(acqf: Any, start: np.ndarray, *, maxiter: int = 50) -> np.ndarray:
    """The batch ``start`` (``q x d`` points of the unit box) moved jointly uphill on ``acqf`` by
    L-BFGS-B inside the unit box (``optimize_acqf`` from ``start`` as its one initial condition).

    Returns ``q x d``; the start itself when the optimizer found nothing better.
    """
    import torch
    from botorch.optim import optimize_acqf

    dim = start.shape[1]
    x0 = torch.from_numpy(np.ascontiguousarray(start, dtype=np.float64)).unsqueeze(0)
    bounds = torch.stack([torch.zeros(dim, dtype=torch.float64), torch.ones(dim, dtype=torch.float64)])
    x, value = optimize_acqf(acqf, bounds=bounds, q=start.shape[0], num_restarts=1, batch_initial_conditions=x0,
                             options={"maxiter": maxiter})
    with torch.no_grad():
        before = acqf(x0)
    return x.detach().numpy() if float(value) > float(before) else np.asarray(start, dtype=np.float64)


def thompson_select(model: Any, space: SearchSpace, pool: np.ndarray, q: int) -> np.ndarray:
    """``q`` rows of ``pool`` by Thompson sampling from ``model``'s posterior (without replacement)."""
    import torch
    from botorch.generation import MaxPosteriorSampling

    pool = np.unique(pool, axis=0)
    if pool.shape[0] <= q:
        return pool
    feats = torch.from_numpy(space.features(pool))
    with torch.no_grad():
        chosen = MaxPosteriorSampling(model=model, replacement=False)(feats, num_samples=q).numpy()
    lookup = {tuple(np.round(f, 12)): i for i, f in enumerate(feats.numpy())}
    return pool[[lookup[tuple(np.round(c, 12))] for c in chosen]]


def candidate_pool(opt: Optimizer, rng: np.random.Generator, n: int, anchors: np.ndarray) -> np.ndarray:
    """Candidates for discrete acquisition: uniform points plus neighbours of ``anchors``, new ones only."""
    pool = np.vstack([opt.space.sample(rng, n), opt.space.neighbours(anchors, rng, n, scale=0.05)])
    return pool[opt.is_new(pool)] if opt.space.is_categorical else pool


class _BoTorchOptimizer(Optimizer):
    """Common suggest step: fit a GP on all successful data, maximize the acquisition ``kind``."""

    kind = "ei"
    defaults = {"pool_size": 1000}
    positive = frozenset({"pool_size"})
    option_help = {"pool_size": "categorical spaces: random points (plus as many neighbours of the 10 best) the "
                                "acquisition scores; box spaces use L-BFGS-B instead"}

    def _suggest(self, q: int) -> np.ndarray:
        x, y = self.data()
        rng = self.rng()
        with seeded_torch(self.torch_seed()):
            feats = self.space.features(x)
            model = fit_gp(feats, y)
            acqf = acquisition(self.kind, model, feats, y, seed=self.torch_seed(1), ref_point=self.ref_point)
            if self.space.is_categorical:
                anchors = x[np.argsort(-y.sum(axis=1))[:10]]
                return select_discrete(acqf, self.space, candidate_pool(self, rng, int(self.options["pool_size"]),
                                                                        anchors), q)
            return self.space.from_unit(optimize_box(acqf, self.space.dim, q))


@OPTIMIZERS.register("bo")
class BO(_BoTorchOptimizer):
    """Single-objective Bayesian optimization: GP + batch qLogEI (BoTorch)."""

    name = "bo"
    multi_objective = False
    kind = "ei"


@OPTIMIZERS.register("qehvi")
class QEHVI(_BoTorchOptimizer):
    """Multi-objective BO with batch q(Log)EHVI (Daulton et al. 2020), BoTorch's implementation."""

    name = "qehvi"
    multi_objective = True
    kind = "ehvi"


@OPTIMIZERS.register("qnehvi")
class QNEHVI(_BoTorchOptimizer):
    """Multi-objective BO with batch q(Log)NEHVI (Daulton et al. 2021), BoTorch's implementation."""

    name = "qnehvi"
    multi_objective = True
    kind = "nehvi"


@OPTIMIZERS.register("turbo")
class TuRBO(Optimizer):
    """TuRBO-1: a trust region around the best point, resized by successes and failures, with
    Thompson sampling inside it (Eriksson et al. 2019, Alg. 1; BoTorch's TuRBO recipe).

    The trust-region state (side length, success/failure counters) is updated in :meth:`tell`
    from each batch's values, so it is rebuilt exactly when a saved campaign is replayed. When
    the side length falls below ``length_min`` it restarts at ``length_init`` (around the best
    point seen, keeping the data: a simplification of the paper's fresh restart).

    Raises:
        InputError: as :class:`~.base.Optimizer`, or unless ``0 < length_min < length_init <=
            length_max`` (named ``length_init``).
    """

    name = "turbo"
    multi_objective = False
    spaces = ("box",)
    defaults = {"length_init": 0.8, "length_min": 0.5**7, "length_max": 1.6, "success_tolerance": 3,
                "n_candidates": 2000}
    positive = frozenset({"length_init", "length_min", "length_max", "success_tolerance", "n_candidates"})
    option_help = {"length_init": "trust region's side at the start and after a restart (unit box)",
                   "length_min": "a side below this restarts the region at length_init",
                   "length_max": "largest side (the region doubles after success_tolerance successes)",
                   "success_tolerance": "consecutive improving batches that double the side",
                   "n_candidates": "Thompson-sampling candidates drawn in the region per batch"}

    def __init__(self, space: SearchSpace, n_objectives: int = 1, **kwargs: Any):
        super().__init__(space, n_objectives, **kwargs)
        o = self.options
        if not 0 < o["length_min"] < o["length_init"] <= o["length_max"]:
            raise InputError("length_init", o["length_init"], "need 0 < length_min < length_init <= length_max")
        self.length = float(o["length_init"])
        self.successes = 0
        self.failures = 0
        self.best = -math.inf
        self.restarts = 0

    def _update(self, x: np.ndarray, y: np.ndarray) -> None:
        values = y[np.isfinite(y[:, 0]), 0]
        if self._x.shape[0] - x.shape[0] < self.n_init or values.size == 0:  # the initial design sets the incumbent
            if values.size:
                self.best = max(self.best, float(values.max()))
            return
        q = x.shape[0]
        failure_tolerance = math.ceil(max(4.0 / q, self.space.dim / q))
        if values.max() > self.best + 1e-3 * abs(self.best):
            self.successes += 1
            self.failures = 0
        else:
            self.successes = 0
            self.failures += 1
        if self.successes == self.options["success_tolerance"]:
            self.length = min(2.0 * self.length, self.options["length_max"])
            self.successes = 0
        elif self.failures == failure_tolerance:
            self.length /= 2.0
            self.failures = 0
        self.best = max(self.best, float(values.max()))
        if self.length < self.options["length_min"]:
            self.length = float(self.options["length_init"])
            self.restarts += 1

    def _suggest(self, q: int) -> np.ndarray:
        import torch

        x, y = self.data()
        rng = self.rng()
        with seeded_torch(self.torch_seed()):
            feats = self.space.features(x)
            model = fit_gp(feats, y)
            center = feats[int(np.argmax(y[:, 0]))]
            pool = trust_region_candidates(center, model, self.length, int(self.options["n_candidates"]), rng)
            pool_x = self.space.from_unit(pool)
            with torch.no_grad():
                return thompson_select(model, self.space, pool_x, q)



def trust_region_candidates(center: np.ndarray, model: Any, length: float, n: int,
                            rng: np.random.Generator) -> np.ndarray:
    """``n x d`` candidates in the unit box: TuRBO's trust region (side ``length``, stretched by the
    GP's ARD lengthscales) around ``center``, perturbing ``min(1, 20/d)`` of the coordinates."""
    d = center.shape[0]
    try:
        ls = model.covar_module.lengthscale.detach().numpy().ravel()
        if ls.shape[0] != d:
            raise ValueError
    except (AttributeError, ValueError):
        ls = np.ones(d)
    weights = ls / ls.mean()
    weights = weights / np.prod(weights ** (1.0 / d))
    lower = np.clip(center - weights * length / 2.0, 0.0, 1.0)
    upper = np.clip(center + weights * length / 2.0, 0.0, 1.0)
    from scipy.stats import qmc

    sobol = qmc.Sobol(d, scramble=True, seed=rng).random(n)
    pert = lower + (upper - lower) * sobol
    prob = min(20.0 / d, 1.0)
    mask = rng.random((n, d)) <= prob
    empty = ~mask.any(axis=1)
    mask[np.flatnonzero(empty), rng.integers(0, d, int(empty.sum()))] = True
    cand = np.tile(center, (n, 1))
    cand[mask] = pert[mask]
    return cand
