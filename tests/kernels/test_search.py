"""kernels/search: spaces, Pareto utilities, partitions, the optimizer contract, campaigns.

References: analytic hypervolumes and BoTorch's own ``Hypervolume``; dominance numbers and
partitions of hand-built point sets; random search with the same seeds and budget.
"""

import itertools
import json
import os

import numpy as np
import pytest
import torch

from paperline.kernels.errors import InputError
from paperline.kernels.search import partition as pt
from paperline.kernels.search.base import load_optimizer, make_optimizer, optimizer_names
from paperline.kernels.search.campaign import Campaign, evaluate_point, run_campaign, samples_to_reach
from paperline.kernels.search.lamcts import kmeans_split
from paperline.kernels.search.lamoo import dominance_split
from paperline.kernels.search.lanas import linear_split
from paperline.kernels.search.pareto import dominance_numbers, hypervolume, hypervolume_trace, pareto_mask
from paperline.kernels.search.problems import PROBLEMS, Objective, Problem, make_problem, problem_names
from paperline.kernels.search.space import SearchSpace

pytestmark = pytest.mark.filterwarnings("ignore")


# -- Pareto utilities -----------------------------------------------------------------------------
def botorch_hv(y, ref):
    from botorch.utils.multi_objective.hypervolume import Hypervolume
    from botorch.utils.multi_objective.pareto import is_non_dominated

    y = torch.as_tensor(y, dtype=torch.float64)
    return Hypervolume(torch.as_tensor(ref, dtype=torch.float64)).compute(y[is_non_dominated(y)])


def test_hypervolume_of_known_fronts():
    # a 2-D staircase: 1*3 + 1*2 + 1*1
    assert hypervolume(np.array([[1.0, 3.0], [2.0, 2.0], [3.0, 1.0]]), np.zeros(2)) == pytest.approx(6.0)
    # 3-D: two boxes 2x1x1 and 1x2x1 overlapping in a unit cube
    assert hypervolume(np.array([[2.0, 1.0, 1.0], [1.0, 2.0, 1.0]]), np.zeros(3)) == pytest.approx(3.0)
    # dominated points and points not dominating the reference add nothing; NaN rows are ignored
    y = np.array([[1.0, 3.0], [2.0, 2.0], [3.0, 1.0], [1.0, 1.0], [-1.0, 5.0], [np.nan, 9.0]])
    assert hypervolume(y, np.zeros(2)) == pytest.approx(6.0)
    assert hypervolume(np.zeros((0, 2)), np.zeros(2)) == 0.0


@pytest.mark.parametrize("m", [2, 3, 4])
def test_hypervolume_equals_botorch_on_random_fronts(m):
    rng = np.random.default_rng(m)
    y = rng.random((40, m))
    ref = np.full(m, 0.1)
    assert hypervolume(y, ref) == pytest.approx(botorch_hv(y, ref), rel=1e-10)


def test_hypervolume_of_a_dtlz2_front_approaches_the_known_maximum():
    # DTLZ2 (2 objectives, minimized): the front is the quarter circle; BoTorch's max_hv for ref 1.1
    from botorch.test_functions.multi_objective import DTLZ2

    theta = np.linspace(0, np.pi / 2, 2000)
    front = -np.column_stack([np.cos(theta), np.sin(theta)])
    assert hypervolume(front, np.array([-1.1, -1.1])) == pytest.approx(DTLZ2(dim=6, num_objectives=2).max_hv, rel=1e-3)


def test_hypervolume_trace_is_monotone_and_ends_at_the_total():
    rng = np.random.default_rng(0)
    y = rng.random((30, 2))
    y[5] = np.nan
    trace = hypervolume_trace(y, np.zeros(2))
    assert np.all(np.diff(trace) >= -1e-12)
    assert trace[-1] == pytest.approx(hypervolume(y, np.zeros(2)))


def test_dominance_numbers_of_a_hand_built_set():
    y = np.array([[3, 3], [2, 2], [1, 1], [3, 1], [1, 3], [3, 3]], dtype=float)
    # (3,3) twice: neither dominates the other; (1,1) is dominated by every other point
    assert dominance_numbers(y).tolist() == [0, 2, 5, 2, 2, 0]
    assert pareto_mask(y).tolist() == [True, False, False, False, False, False]  # duplicates kept once


# -- partitions -------------------------------------------------------------------------------------
def line_space():
    return SearchSpace.box([0.0], [1.0])


def test_lamoo_split_labels_the_lower_dominance_half_good():
    x = np.linspace(0, 1, 20)[:, None]
    y = np.column_stack([-x[:, 0], -(x[:, 0] ** 2)])  # both objectives prefer small x
    labels, boundary = dominance_split("rbf")(x, y, np.random.default_rng(0))
    assert labels.tolist() == [1] * 10 + [0] * 10
    assert boundary.predict(np.array([[0.05], [0.95]])).tolist() == [1, 0]


def test_lamcts_split_separates_the_good_cluster():
    x = np.concatenate([np.linspace(0.0, 0.3, 10), np.linspace(0.7, 1.0, 10)])[:, None]
    f = np.where(x[:, 0] < 0.5, 1.0, -1.0)[:, None] + 0.01 * x
    labels, boundary = kmeans_split("rbf", seed=0)(x, f, np.random.default_rng(0))
    assert labels.tolist() == [1] * 10 + [0] * 10
    assert boundary.predict(np.array([[0.1], [0.9]])).tolist() == [1, 0]


def test_lanas_linear_split_is_the_half_space_above_the_mean():
    rng = np.random.default_rng(0)
    x = rng.random((30, 3))
    f = (2 * x[:, 0] - x[:, 1])[:, None]
    labels, boundary = linear_split(x, f, rng)
    np.testing.assert_array_equal(labels, (f[:, 0] >= f.mean()).astype(int))
    assert boundary.predict(np.array([[1.0, 0.0, 0.5], [0.0, 1.0, 0.5]])).tolist() == [1, 0]


def test_tree_regions_partition_the_samples_and_sampling_stays_inside():
    space = SearchSpace.box([0.0, 0.0], [1.0, 1.0])
    rng = np.random.default_rng(1)
    x = rng.random((64, 2))
    y = -((x - 0.25) ** 2).sum(axis=1, keepdims=True)
    root = pt.build_tree(x, y, kmeans_split("rbf", 0), lambda idx: float(y[idx].mean()), rng, leaf_size=16)
    leaves = pt.leaves(root)
    assert len(leaves) >= 2
    assert sorted(np.concatenate([leaf.idx for leaf in leaves]).tolist()) == list(range(64))  # a partition
    paths = pt.select_paths(root, 1, pt.uct_bonus(0.0))  # cp = 0: pure exploitation
    leaf = pt.leaf_of(paths[0], root)
    assert leaf.value == max(lf.value for lf in leaves if pt.leaf_of(_path_to(root, lf), root) is lf)
    assert np.all(pt.in_region(paths[0], x[leaf.idx]))  # a leaf's samples lie in its region
    cand = pt.region_candidates(space, paths[0], x[leaf.idx], rng, 200)
    assert cand.shape[0] > 0 and np.all(pt.in_region(paths[0], cand))


def _path_to(root, target):
    def walk(node, path):
        if node is target:
            return path
        for side, child in ((pt.GOOD, node.good), (pt.BAD, node.bad)):
            if child is not None:
                found = walk(child, path + [(node, side)])
                if found is not None:
                    return found
        return None

    return walk(root, [])


def test_virtual_visits_spread_a_batch_over_leaves():
    rng = np.random.default_rng(2)
    x = rng.random((40, 1))
    y = x.copy()
    root = pt.build_tree(x, y, kmeans_split("rbf", 0), lambda idx: float(y[idx].mean()), rng, leaf_size=10)
    paths = pt.select_paths(root, 6, pt.uct_bonus(10.0))  # strong exploration
    assert len({pt.leaf_of(p, root).id for p in paths}) >= 2


# -- the optimizer contract ---------------------------------------------------------------------------
MULTI = {"lamoo", "qehvi", "qnehvi"}
BOX_ONLY = {"turbo"}


def problem_for(name):
    if name in MULTI:
        return make_problem("branin-currin")
    if name in BOX_ONLY:
        return make_problem("levy", dim=20)
    return make_problem("nasbench201-cifar10", objectives=["val_accuracy_pct"])


def run_batches(opt, problem, n_batches, q=4, fail_first=False):
    for b in range(n_batches):
        x = opt.ask(q)
        y = np.array([problem.to_max(problem.evaluate(r)) for r in x])
        if fail_first and b == 2:
            y[0] = np.nan
        opt.tell(x, y)
    return opt


@pytest.mark.parametrize("name", [n for n in ["random", "lanas", "lamcts", "lamoo", "bo", "turbo", "qehvi",
                                                "qnehvi", "nsga2"]])
def test_optimizer_contract(name):
    problem = problem_for(name)
    ref = problem.reference_point() if problem.n_objectives > 1 else None
    opt = make_optimizer(name, problem.space, problem.n_objectives, seed=1, n_init=6, ref_point=ref)
    run_batches(opt, problem, 4, fail_first=True)  # 2 design batches, 2 model batches, one failed row
    first, again = opt.ask(4), opt.ask(4)
    np.testing.assert_array_equal(first, again)  # ask is pure
    assert first.shape == (4, problem.space.dim)
    problem.space.validate(first)
    assert np.unique(first, axis=0).shape[0] == 4
    if problem.space.is_categorical:
        assert opt.is_new(first).all()  # never re-proposes an evaluated (or failed) cell
    state = json.loads(json.dumps(opt.state_dict()))
    np.testing.assert_array_equal(load_optimizer(state).ask(4), first)  # replay asks the same
    assert np.isnan(opt.y).any(axis=1).sum() == 1


def test_the_registry_lists_every_optimizer_and_problem():
    assert set(optimizer_names()) == {"random", "lanas", "lamcts", "lamoo", "alphax", "bo", "turbo", "qehvi",
                                      "qnehvi", "nsga2"}
    assert {"nasbench201-cifar10", "nasbench201-cifar100", "nasbench201-imagenet16", "branin-currin",
            "vehicle-safety", "dtlz2", "ackley", "levy", "rosenbrock", "live-mnist"} <= set(problem_names())
    with pytest.raises(ValueError, match="already registered"):
        PROBLEMS.register("ackley")(lambda: None)


def test_every_optimizer_option_says_what_it_does():
    """`paperline params nas` prints ``option_help`` next to each option's default: a new option
    without a description (or a description of an option that is gone) fails here."""
    from paperline.kernels.search.base import OPTIMIZERS

    for name in optimizer_names():
        cls = OPTIMIZERS[name]
        assert set(cls.option_help) == set(cls.defaults), name
        assert all(len(text) > 10 for text in cls.option_help.values()), name


# Every optimizer beats random search on average (3 seeds, same budget, same initial design) on a
# problem with a known optimum: final best value (single objective) or hypervolume (multi). The
# GP-based optimizers (BoTorch's, LaMOO's classifier-guided qEHVI) get two batches after the initial
# design (budget 20), where they are already far ahead (hypervolume 43-48 vs random's 6.9; Levy -95
# vs -138).
BEATS = [("lanas", "nasbench201-cifar100", {"objectives": ["val_accuracy_pct"]}, 30),
         ("lamcts", "levy", {"dim": 20}, 30), ("bo", "levy", {"dim": 20}, 20), ("turbo", "levy", {"dim": 20}, 30),
         ("nsga2", "nasbench201-cifar10", {"objectives": ["val_accuracy_pct"]}, 30),
         ("lamoo", "branin-currin", {}, 20), ("qehvi", "branin-currin", {}, 20), ("qnehvi", "branin-currin", {}, 20)]


@pytest.mark.parametrize(("name", "problem", "options", "budget"), BEATS, ids=[b[0] for b in BEATS])
def test_beats_random_search(name, problem, options, budget):
    def score(opt):
        runs = [run_campaign(Campaign(problem, opt, budget=budget, q=5, seed=s, n_init=10, problem_options=options))
                for s in range(3)]
        return np.mean([r.score_trace()[-1] for r in runs])

    ours, rand = score(name), score("random")
    assert ours > rand, (name, ours, rand)


def test_known_optimum_is_recorded_for_single_objective_problems():
    p = make_problem("ackley", dim=20)
    assert p.optimum == 0.0
    np.testing.assert_allclose(p.evaluate(np.zeros(20)), [0.0], atol=1e-12)


# -- campaigns: resume, failures, bad input --------------------------------------------------------------
class Killed(Exception):
    pass


@pytest.mark.parametrize(("name", "problem", "options"), [
    ("lamoo", "branin-currin", {}), ("lamcts", "levy", {"dim": 20}),
    ("nsga2", "vehicle-safety", {}), ("lanas", "nasbench201-cifar10", {"objectives": ["val_accuracy_pct"]})])
def test_interrupted_and_resumed_campaign_equals_the_uninterrupted_one(name, problem, options):
    kw = dict(budget=22, q=4, seed=3, n_init=8, problem_options=options)
    full = run_campaign(Campaign(problem, name, **kw))
    saved = {}

    def checkpoint_then_die(c, new):
        saved["state"] = json.dumps(c.state_dict())
        if c.optimizer.n_batches == 3:
            raise Killed

    with pytest.raises(Killed):
        run_campaign(Campaign(problem, name, **kw), on_batch=checkpoint_then_die)
    resumed = run_campaign(Campaign.from_state(json.loads(saved["state"])))
    assert [e.x for e in resumed.evaluations] == [e.x for e in full.evaluations]
    assert [e.values for e in resumed.evaluations] == [e.values for e in full.evaluations]
    np.testing.assert_array_equal(resumed.score_trace(), full.score_trace())


def flaky_problem():
    space = SearchSpace.box([0.0, 0.0], [1.0, 1.0])

    def evaluate(x, seed):
        if x[0] > 0.8:
            raise RuntimeError("simulator crashed")
        if x[1] > 0.8:
            return np.array([np.nan])
        return np.array([-((x - 0.3) ** 2).sum()])

    return Problem("flaky", space, (Objective("value", True),), evaluate)


def test_failed_evaluations_are_recorded_and_the_campaign_goes_on():
    c = run_campaign(Campaign(flaky_problem(), "bo", budget=24, q=4, seed=0, n_init=8))
    failed = [e for e in c.evaluations if not e.ok]
    assert c.n_done == 24 and failed
    assert any("RuntimeError: simulator crashed" in e.error for e in failed)
    assert any("non-finite" in e.error for e in failed)
    assert all(e.values is None for e in failed)
    assert c.best_trace()[-1] > -0.1  # the successful ones still drive the search


def test_evaluate_point_refuses_a_point_outside_the_space():
    with pytest.raises(InputError, match="outside the search space"):
        evaluate_point(make_problem("branin-currin"), [2.0, 0.5], 0)


def test_an_evaluation_past_its_time_limit_stops_itself_and_is_recorded_as_timed_out(monkeypatch):
    """Prefect's task limit, an exception sent into the worker's thread, was lost in a Dask
    callback: a timed-out training ran on and the next batch timed out queued behind it (a
    trial). The evaluation checks its own limit between training batches: on a clock that
    advances 1 s per reading, a 5-s limit stops it after 5 training batches."""
    import itertools

    from paperline.kernels.search import deadline
    from paperline.kernels.search.deadline import EvaluationTimeout

    problem = make_problem("live-mnist", epochs=3)
    x = problem.space.sobol(1, seed=0)[0]
    ticks = itertools.count()
    readings = []

    class Clock:
        @staticmethod
        def monotonic():
            readings.append(next(ticks))
            return float(readings[-1])

    monkeypatch.setattr(deadline, "time", Clock)
    got = evaluate_point(problem, x, 0, timeout_s=5)
    assert got["values"] is None and got["error"] == "timed out: not done 5 s after it started on its worker", got
    assert len(readings) == 7, readings  # the limit set at 0, then batches at 1..5 run, the check at 6 stops it
    with pytest.raises(EvaluationTimeout, match="not done 5 s after"):  # (the task's way: a timeout is not cached)
        evaluate_point(problem, x, 0, timeout_s=5, raise_timeout=True)
    monkeypatch.undo()
    # what a process loads once (MNIST, torch) is loaded before the limit starts: the first
    # evaluation on each cold worker timed out loading while the ones queued behind it finished (a trial)
    import dataclasses

    from paperline.kernels.search.deadline import _DEADLINE

    prepared = []
    cheap_box = dataclasses.replace(make_problem("branin-currin"), prepare_fn=lambda: prepared.append(_DEADLINE.get()))
    assert evaluate_point(cheap_box, [0.5, 0.5], 0, timeout_s=5)["error"] is None and prepared == [None]
    # without a limit the same point trains to the end (and the limit does not leak into it)
    cheap = make_problem("live-mnist", epochs=1, n_train=100)
    assert evaluate_point(cheap, x, 0)["error"] is None
    assert evaluate_point(cheap, x, 0, timeout_s=600)["error"] is None


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(problem="branin-currin", optimizer="simulated-annealing"), "unknown optimizer"),
    (dict(problem="knapsack", optimizer="random"), "unknown problem"),
    (dict(problem="branin-currin", optimizer="random", budget=5, n_init=10), "smaller than the initial design"),
    (dict(problem="branin-currin", optimizer="random", q=0), "batch size"),
    (dict(problem="branin-currin", optimizer="lamoo", ref_point=[0.0, 0.0]), "no point dominates"),
    (dict(problem="nasbench201-cifar10", optimizer="lamoo", ref_point=[95.0, 2.0, 0.03]), "no point dominates"),
    (dict(problem="branin-currin", optimizer="lamoo", ref_point=[18.0]), "expected 2 values"),
    (dict(problem="levy", optimizer="lamoo"), "multi-objective"),
    (dict(problem="branin-currin", optimizer="lamcts"), "single-objective"),
    (dict(problem="nasbench201-cifar10", optimizer="turbo", problem_options={"objectives": ["val_accuracy_pct"]}),
     "supports box"),
    (dict(problem="levy", optimizer="lamcts", problem_options={"dim": 5}), r"problem_options\.dim=5: must be in \[20, 100\]"),
    # a problem option of the wrong type is named, not Python's int() or '<' message
    (dict(problem="levy", optimizer="lamcts", problem_options={"dim": "x"}), r"problem_options\.dim='x': must be an integer"),
    (dict(problem="ackley", optimizer="lamcts", problem_options={"dim": 20.5}), r"problem_options\.dim=20\.5"),
    (dict(problem="dtlz2", optimizer="lamoo", problem_options={"dim": "6"}), r"problem_options\.dim='6'"),
    (dict(problem="dtlz2", optimizer="lamoo", problem_options={"n_objectives": 6}),
     r"problem_options\.n_objectives=6: must be in \[2, 5\]"),
    (dict(problem="levy", optimizer="lamcts", optimizer_options={"leaf": 3}), "unknown for lamcts"),
    (dict(problem="levy", optimizer="lamcts", optimizer_options={"sampler": "cmaes"}), "known samplers"),
    # option values are checked against their defaults' types and ranges, naming the option
    (dict(problem="branin-currin", optimizer="lamoo", optimizer_options={"n_candidates": -3}),
     r"^optimizer_options\.n_candidates=-3"),
    (dict(problem="branin-currin", optimizer="lamoo", optimizer_options={"cp": "abc"}),
     r"^optimizer_options\.cp='abc'.*finite number"),
    (dict(problem="branin-currin", optimizer="qehvi", optimizer_options={"pool_size": 0}), "pool_size=0.*>= 1"),
    (dict(problem="levy", optimizer="turbo", optimizer_options={"success_tolerance": 2.5}), "success_tolerance.*integer"),
    (dict(problem="levy", optimizer="lamcts", optimizer_options={"turbo_length": float("nan")}), "turbo_length"),
    (dict(problem="levy", optimizer="lamcts", optimizer_options={"leaf_size": True}), "leaf_size=True"),
    # "must be an integer >= 0" for -1 but "at least 4 samples" for 2 (a trial): one message
    (dict(problem="levy", optimizer="lamcts", optimizer_options={"leaf_size": 2}), r"leaf_size=2: must be an integer >= 4"),
    (dict(problem="levy", optimizer="lamcts", optimizer_options={"leaf_size": -1}), r"leaf_size=-1: must be an integer >= 4"),
    # ran to the end with batches cut to the budget, unsaid (a trial)
    (dict(problem="levy", optimizer="random", q=100), r"^q=100: larger than the budget \(20 evaluations\)"),
    (dict(problem="branin-currin", optimizer="lamoo", optimizer_options={"kernel": 3}), "kernel=3.*string"),
    (dict(problem="nasbench201-cifar10", optimizer="alphax", problem_options={"objectives": ["val_accuracy_pct"]},
          optimizer_options={"lr": 0}), "lr=0.*> 0"),
    (dict(problem="nasbench201-cifar10", optimizer="random", problem_options={"objectives": ["flops"]}),
     "unknown NAS-Bench-201 objective"),
])
def test_bad_input_is_refused_with_a_clear_error(kwargs, match):
    kwargs = {"budget": 20, **kwargs}
    problem, optimizer = kwargs.pop("problem"), kwargs.pop("optimizer")
    with pytest.raises(InputError, match=match):
        Campaign(problem, optimizer, **kwargs)


def test_nasbench201_reads_the_tables_seeds():
    p = make_problem("nasbench201-cifar10")
    x = np.array([3, 3, 3, 3, 3, 3], dtype=float)  # all 3x3 convolutions
    values = [p.evaluate(x, seed)[0] for seed in range(3)]
    assert len(set(values)) > 1  # different training seeds
    assert p.evaluate(x, 0)[0] == p.evaluate(x, 3)[0] or p.evaluate(x, 0)[0] == p.evaluate(x, 2)[0]
    assert 85.0 < values[0] < 95.0
    assert [o.name for o in p.objectives] == ["val_accuracy_pct", "latency_s", "model_size_mb"]


def test_samples_to_reach():
    assert samples_to_reach(np.array([1.0, 2.0, 2.0, 5.0]), 2.0) == 2.0
    assert samples_to_reach(np.array([1.0]), 2.0) == float("inf")


def test_all_points_lists_a_categorical_space_once_and_refuses_a_box():
    space = SearchSpace.categorical({"a": ["x", "y", "z"], "b": ["p", "q"], "c": ["0", "1", "2", "3"]})
    every = space.all_points()
    assert every.shape == (24, 3) and len({tuple(r) for r in every}) == 24
    np.testing.assert_array_equal(every.min(axis=0), space.lower)
    np.testing.assert_array_equal(every.max(axis=0), space.upper)
    with pytest.raises(InputError, match="only a categorical space"):
        SearchSpace.box([0.0], [1.0]).all_points()


@pytest.mark.parametrize("make, match", [
    # names of another length set dim to theirs: optimizers refused the points they proposed (a trial)
    (lambda: SearchSpace.box([0, 0, 0], [1, 1, 1], names=["a"]), r"^names=\['a'\]: need one name per bound \(3\)"),
    (lambda: SearchSpace.box([0], [1], names=["a", "b", "c"]), r"need one name per bound \(1\)"),
    (lambda: SearchSpace.box([0, 0], [1, 1], names=["a", "a"]), "need distinct non-empty strings"),
    (lambda: SearchSpace.box(["a"], ["b"]), r"^bounds=.*need numbers"),  # was a bare ValueError
    (lambda: SearchSpace.categorical({"x": ["a", "a"]}), r"^choices\['x'\]=\['a', 'a'\]: options must differ"),
    (lambda: SearchSpace.categorical({"x": [1, "1"]}), "options must differ"),  # the same once str()
    (lambda: SearchSpace.categorical({"x": "ab"}), "need a list of options"),  # was options 'a' and 'b'
    (lambda: SearchSpace.categorical([["a", "b"]]), r"need a dict \{name"),  # was AttributeError
    (lambda: SearchSpace.categorical({"x": ["a"]}), "need at least 2 options")])
def test_a_space_with_inconsistent_names_or_options_is_refused(make, match):
    with pytest.raises(InputError, match=match):
        make()


def test_a_batch_of_values_of_the_wrong_shape_is_named_with_the_shape_given():
    opt = make_optimizer("random", SearchSpace.box([0.0, 0.0], [1.0, 1.0]), 1, seed=0, n_init=2)
    x = opt.ask(2)
    with pytest.raises(InputError, match=r"^y=\(3,\): expected 2 x 1 values"):  # was y=(1, 3)
        opt.tell(x, np.zeros(3))
    opt.tell(x, np.array([1.0, 2.0]))  # one objective: one value per point, taken as the column (was refused)
    np.testing.assert_array_equal(opt.state_dict()["batches"][-1]["y"], [[1.0], [2.0]])


def test_lamoo_scores_the_unseen_points_of_its_region():
    """On a small categorical space LaMOO's candidates are the unseen points inside the selected
    region (the paper maximizes qEHVI over the region), and the whole unseen rest if it has none."""
    space = SearchSpace.categorical({f"v{i}": ["a", "b", "c", "d"] for i in range(3)})
    opt = make_optimizer("lamoo", space, 2, seed=0, n_init=8, ref_point=[0.0, 0.0])
    rng = np.random.default_rng(0)
    x = np.unique(space.sample(rng, 30), axis=0)
    y = np.stack([x[:, 0] + x[:, 1], 3.0 - x[:, 0] + x[:, 2]], axis=1)  # two competing objectives
    opt.tell(x, y)
    root = pt.build_tree(space.features(x), y, dominance_split("poly"), lambda idx: float(len(idx)),
                         rng, leaf_size=8)
    path = pt.select_paths(root, 1, pt.uct_bonus(0.0))[0]
    pool = opt.unseen_in_region(path)
    seen = {tuple(r) for r in x}
    inside = space.all_points()[pt.in_region(path, space.features(space.all_points()))]
    assert {tuple(r) for r in pool} == {tuple(r) for r in inside} - seen
    assert opt.unseen_in_region([]).shape[0] == 64 - len(seen)  # the root's region: the whole space
    batch = opt.ask(4)
    assert batch.shape == (4, 3) and opt.is_new(batch).all()


@pytest.mark.parametrize("categorical", [True, False])
def test_lamoo_nsga2_sampler_gives_each_region_its_share_of_the_batch(categorical):
    """With ``sampler: nsga2`` a region asked for k points gives at most k (distinct, new on a
    categorical space): it gave every offspring inside it (up to 20), and the batch keeps its
    first q rows, so the first region selected took all of a batch split over several regions."""
    if categorical:
        space = SearchSpace.categorical({f"v{i}": ["a", "b", "c", "d"] for i in range(3)})
    else:
        space = SearchSpace.box([0.0, 0.0], [1.0, 1.0])
    opt = make_optimizer("lamoo", space, 2, seed=0, n_init=8, ref_point=[-10.0, -10.0], sampler="nsga2",
                         cp=100.0)  # (exploring: the picks spread over the leaves)
    rng = np.random.default_rng(0)
    x = np.unique(space.sample(rng, 30), axis=0)
    y = np.stack([x[:, 0] + x[:, 1], 3.0 - x[:, 0] + x[:, -1]], axis=1)
    opt.tell(x, y)
    root = opt.learn()
    paths = pt.select_paths(root, 4, opt.ucb())
    leaves = {pt.leaf_of(path, root).id: path for path in paths}
    assert len(leaves) >= 2  # the batch is split over regions
    for path in leaves.values():
        leaf = pt.leaf_of(path, root)
        got = opt.sample_region(path, x[leaf.idx], y[leaf.idx], 2, np.random.default_rng(1))
        assert 1 <= got.shape[0] <= 2 and np.unique(got, axis=0).shape[0] == got.shape[0]
        if categorical:
            assert opt.is_new(got).all()
    batch = opt.ask(4)
    assert batch.shape == (4, space.dim) and np.unique(batch, axis=0).shape[0] == 4


def test_lamoo_kernel_auto_is_rbf_on_categorical_spaces_and_recorded():
    """``kernel="auto"`` (the default) resolves at construction, RBF on a categorical space and
    polynomial on a continuous one, so a checkpoint records the kernel a campaign used; an explicit
    kernel is kept and an unknown one refused."""
    cat = SearchSpace.categorical({f"v{i}": ["a", "b", "c"] for i in range(3)})
    box = SearchSpace.box([0.0, 0.0], [1.0, 1.0])
    assert make_optimizer("lamoo", cat, 2, ref_point=[0.0, 0.0]).options["kernel"] == "rbf"
    assert make_optimizer("lamoo", box, 2, ref_point=[0.0, 0.0]).options["kernel"] == "poly"
    assert make_optimizer("lamoo", cat, 2, ref_point=[0.0, 0.0], kernel="poly").options["kernel"] == "poly"
    assert make_optimizer("lamoo", cat, 2, ref_point=[0.0, 0.0]).state_dict()["options"]["kernel"] == "rbf"
    with pytest.raises(InputError, match="kernel"):
        make_optimizer("lamoo", box, 2, ref_point=[0.0, 0.0], kernel="sigmoid")


def test_the_fused_qlogehvi_kernel_is_built_in_this_envs_own_directory(monkeypatch, tmp_path):
    """BoTorch's fused C++ kernel (``make install`` builds it) loads, from a build directory of
    this virtual env's own: with torch's default, shared by every env of the user, each env's
    build replaced the other's and the next NAS campaign waited 40-100 s for a rebuild."""
    import subprocess
    import sys

    from paperline.kernels.search.botorch_opt import fused_kernel_dir

    import sysconfig

    from paperline.kernels.search.botorch_opt import _path_with_env_ninja

    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    code = ("import json, os; from paperline.kernels.search.botorch_opt import load_fused_kernel as k; "
            "m = k(); print(json.dumps([m and m.__file__, os.environ['TORCH_EXTENSIONS_DIR'], os.environ['PATH']]))")
    # the same kernel whichever ninja the caller's PATH finds first: the env's (an activated env) or
    # Debian's (`make install`, a script run by the venv's python): ninja 1.11 and 1.13 hash the
    # compiler command differently, and each rebuilt the other's build, a silent 35-40 s (a trial)
    scripts = sysconfig.get_path("scripts")
    outside = os.pathsep.join(p for p in env.get("PATH", "").split(os.pathsep)
                              if p and os.path.realpath(p) != os.path.realpath(scripts))
    built = fused_kernel_dir() / "logei_fused_ext" / "logei_fused_ext.so"
    stamps = []
    outside = outside or "/usr/bin:/bin"
    for path in (os.pathsep.join([scripts, outside]), outside):
        proc = subprocess.run([sys.executable, "-c", code], env=env | {"PATH": path}, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        module, directory, inside = json.loads(proc.stdout.splitlines()[-1])
        assert directory == str(fused_kernel_dir()) and module is not None, proc.stderr[-2000:]
        assert module.startswith(directory + os.sep)
        assert inside.split(os.pathsep) == [scripts, *outside.split(os.pathsep)]  # (the env's bin first, as activated)
        # built by make install: said only when built
        assert "building BoTorch's fused qLogEHVI kernel" not in proc.stderr, (path, proc.stderr[-2000:])
        stamps.append(built.stat().st_mtime_ns)
    assert stamps[0] == stamps[1]
    assert _path_with_env_ninja("/usr/bin").split(os.pathsep) == [scripts, "/usr/bin"]
    # unset: the system's default after it, where the compiler is (a review: c++ was not found)
    assert _path_with_env_ninja(None) == os.pathsep.join([scripts, os.defpath])
    assert _path_with_env_ninja(f"{scripts}{os.pathsep}/usr/bin") == f"{scripts}{os.pathsep}/usr/bin"  # (not again)
    monkeypatch.setattr(sysconfig, "get_path", lambda name: str(tmp_path))  # an env without a ninja of its own
    assert _path_with_env_ninja("/usr/bin") is None  # (PATH left as it is; unset stays unset)
    monkeypatch.undo()
    here = fused_kernel_dir()
    prefix = sys.prefix
    monkeypatch.setattr(sys, "prefix", prefix + "-another-env")
    assert fused_kernel_dir() != here and fused_kernel_dir().parent == here.parent
    # the same env through a symbolic link (a clone whose .venv links to another's) is the same env
    # (it rebuilt the kernel in a trial's NAS campaign, a silent minute and a half)
    link = tmp_path / "linked-venv"
    link.symlink_to(prefix, target_is_directory=True)
    monkeypatch.setattr(sys, "prefix", str(link))
    assert fused_kernel_dir() == here


def test_a_build_ninja_has_work_for_is_said_before_it_starts(monkeypatch, tmp_path):
    """torch rebuilt a stale kernel (another command, a newer source) for 35-40 s with nothing
    said: "building" was printed only where no library existed yet (a trial)."""
    import subprocess

    from paperline.kernels.search.botorch_opt import _needs_build, _path_with_env_ninja

    monkeypatch.setenv("PATH", _path_with_env_ninja(os.environ.get("PATH")) or os.environ.get("PATH", os.defpath))
    build = tmp_path / "logei_fused_ext"
    build.mkdir()
    assert _needs_build(build)  # nothing built
    (build / "logei_fused_ext.so").write_bytes(b"built")
    (build / "source.cpp").write_text("int x;\n")
    (build / "build.ninja").write_text("rule copy\n  command = cp $in $out\nbuild out.o: copy source.cpp\n"
                                       "default out.o\n")
    assert _needs_build(build)  # a source newer than what was built from it
    subprocess.run(["ninja", "-C", str(build)], check=True, capture_output=True)
    assert not _needs_build(build)  # built with this ninja: nothing to do


def test_a_dead_builders_torch_lock_does_not_hang_the_fused_kernels_load(tmp_path):
    """torch's JIT builder waits, without a time limit, while its lock file exists, and a process
    killed while building or loading the kernel (a killed ``make install``) left it behind:
    the next ``make install`` sat 18 minutes at 0% CPU. In the env's own build directory the
    lock is a dead builder's (paperline's loaders take turns) and is deleted; in a directory of
    the user's it is named in a warning and left alone."""
    import shutil
    import signal
    import subprocess
    import sys
    import threading

    from paperline.kernels.search.botorch_opt import fused_kernel_dir

    built = fused_kernel_dir() / "logei_fused_ext"
    if not (built / "logei_fused_ext.so").exists():
        pytest.skip("make install did not build BoTorch's fused kernel here (no C++ compiler)")
    env = {k: v for k, v in os.environ.items() if k != "TORCH_EXTENSIONS_DIR"}
    env["XDG_CACHE_HOME"] = str(tmp_path / "cache")
    own = tmp_path / "cache" / fused_kernel_dir().relative_to(fused_kernel_dir().parents[1])
    shutil.copytree(built, own / "logei_fused_ext")  # the built kernel (mtimes kept: ninja has nothing to do)
    (own / "logei_fused_ext" / "lock").touch()  # what a killed build leaves
    code = ("import json; from paperline.kernels.search.botorch_opt import load_fused_kernel as k; "
            "m = k(); print(json.dumps(m and m.__file__))")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.splitlines()[-1]).startswith(str(own)), proc.stderr[-2000:]
    assert not (own / "logei_fused_ext" / "lock").exists()

    theirs = tmp_path / "theirs"
    shutil.copytree(built, theirs / "logei_fused_ext")
    (theirs / "logei_fused_ext" / "lock").touch()  # perhaps another program's build, running
    with subprocess.Popen([sys.executable, "-c", code], env=env | {"TORCH_EXTENSIONS_DIR": str(theirs)},
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as waiting:
        deadline = threading.Timer(120, os.killpg, (waiting.pid, signal.SIGKILL))  # (no warning: EOF)
        deadline.start()
        try:
            line = ""
            while "build lock" not in line and waiting.poll() is None:
                line = waiting.stderr.readline()
        finally:
            deadline.cancel()
            os.killpg(waiting.pid, signal.SIGKILL)
    assert f"torch's build lock {theirs / 'logei_fused_ext' / 'lock'} exists" in line
    assert (theirs / "logei_fused_ext" / "lock").exists()

    # a directory nothing can be built in: BoTorch's PyTorch path, as without a compiler
    proc = subprocess.run([sys.executable, "-c", code], env=env | {"TORCH_EXTENSIONS_DIR": "/proc/nowhere"},
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and json.loads(proc.stdout.splitlines()[-1]) is None, proc.stderr[-2000:]
    assert "Failed to compile fused qLogEHVI C++ extension" in proc.stderr


@pytest.fixture(scope="module")
def two_objective_ehvi():
    """(space, candidate pool, a factory of qLogEHVI acquisitions) on a GP fitted to 30 points of a
    2-d box with two competing objectives."""
    from paperline.kernels.search.botorch_opt import acquisition, fit_gp

    space = SearchSpace.box([0.0, 0.0], [1.0, 1.0])
    rng = np.random.default_rng(3)
    x = space.sample(rng, 30)
    y = np.stack([-np.sum((x - 0.2) ** 2, axis=1), -np.sum((x - 0.8) ** 2, axis=1)], axis=1)
    pool = np.unique(space.sample(rng, 300), axis=0)
    torch.manual_seed(0)
    model = fit_gp(space.features(x), y)
    return space, pool, lambda: acquisition("ehvi", model, space.features(x), y, seed=1,
                                            ref_point=np.array([-2.0, -2.0]))


def test_select_discrete_shortlist_keeps_the_first_choice_and_draws_from_the_best_alone(two_objective_ehvi):
    """With a shortlist, the greedy batch starts with the same point (the best alone) and the later
    rounds pick among the ``shortlist`` best-alone candidates; a shortlist as large as the pool
    changes nothing."""
    from paperline.kernels.search.botorch_opt import select_discrete

    space, pool, acqf = two_objective_ehvi
    full = select_discrete(acqf(), space, pool, 4)
    short = select_discrete(acqf(), space, pool, 4, shortlist=10)
    with torch.no_grad():
        alone = acqf()(torch.from_numpy(space.features(pool)).unsqueeze(-2)).numpy()
    top = {tuple(r) for r in pool[np.argsort(-alone)[:10]]}
    assert np.array_equal(short[0], full[0]) and np.array_equal(full[0], pool[np.argmax(alone)])
    assert {tuple(r) for r in short} <= top and len({tuple(r) for r in short}) == 4
    assert not {tuple(r) for r in full} <= top  # here the full greedy goes past the shortlist
    assert np.array_equal(select_discrete(acqf(), space, pool, 4, shortlist=pool.shape[0]), full)
    assert select_discrete(acqf(), space, pool, 4, shortlist=1).shape == (4, 2)  # never fewer than q


def test_refine_box_moves_a_batch_uphill_inside_the_box(two_objective_ehvi):
    """LaMOO's polish on a continuous space: the greedy batch moved jointly by L-BFGS-B scores
    higher, stays in the unit box, and polishing it again never scores lower."""
    from paperline.kernels.search.botorch_opt import refine_box, select_discrete

    space, pool, acqf = two_objective_ehvi
    start = space.features(select_discrete(acqf(), space, pool[::10], 3))
    moved = refine_box(acqf(), start)
    with torch.no_grad():
        before, after = (float(acqf()(torch.from_numpy(b).unsqueeze(0))) for b in (start, moved))
    assert moved.shape == start.shape and ((moved >= 0) & (moved <= 1)).all()
    assert after > before and not np.allclose(moved, start)
    again = refine_box(acqf(), moved)
    with torch.no_grad():
        assert float(acqf()(torch.from_numpy(again).unsqueeze(0))) >= after - 1e-9


def test_lamoo_on_a_box_never_proposes_an_evaluated_point_again():
    """The polish pulls points onto the box's edges and corners; one that lands on an evaluated
    point (BraninCurrin seed 0 proposed its evaluation 10, the corner [0, 1], again as 17) keeps
    its greedy place instead."""
    c = run_campaign(Campaign("branin-currin", "lamoo", budget=25, q=5, seed=0, n_init=10))
    x = np.array([e.x for e in c.evaluations])
    assert x.shape == (25, 2) and np.unique(x, axis=0).shape[0] == 25


def _tiny_problem(space: SearchSpace) -> Problem:
    return Problem(name="tiny", space=space, objectives=(Objective("f", maximize=True),),
                   evaluate_fn=lambda x, seed: np.array([float(np.sum(x))]))


def test_a_budget_beyond_a_finite_space_is_refused_and_one_equal_to_it_takes_every_point_once():
    """A budget above the space's distinct points ran out of new points and never ended (a
    NAS-Bench-201 campaign with budget=1e12 was accepted)."""
    space = SearchSpace.categorical({"a": ["x", "y", "z"], "b": ["p", "q"], "c": ["u", "v"]})  # 12 points
    with pytest.raises(InputError, match=r"^budget=13: more than the 12 distinct points of tiny's search space$"):
        Campaign(_tiny_problem(space), "random", budget=13, q=5, n_init=2)
    camp = run_campaign(Campaign(_tiny_problem(space), "random", budget=12, q=5, n_init=2))
    assert sorted(tuple(e.x) for e in camp.evaluations) == sorted(itertools.product(range(3), range(2), range(2)))


def test_the_last_points_of_a_nearly_exhausted_space_fill_the_batch():
    """Random draws hit the 3 points left of 4096 rarely (600 draws: 0.44 expected); the batch takes
    them all. Reference: the set difference of the space and the told points."""
    space = SearchSpace.categorical({f"v{i}": [str(j) for j in range(8)] for i in range(4)})
    points = space.all_points()
    opt = make_optimizer("random", space, 1, seed=0, n_init=1)
    left = np.random.default_rng(1).choice(points.shape[0], 3, replace=False)
    told = np.delete(points, left, axis=0)
    opt.tell(told, told.sum(axis=1, keepdims=True))
    x = opt.ask(5)
    assert sorted(map(tuple, x)) == sorted(map(tuple, points[left]))


@pytest.mark.parametrize("kwargs, match", [
    ({"seed": -1}, r"^seed=-1: must be an integer >= 0"),  # was NumPy's "expected non-negative integer"
    ({"seed": None}, r"^seed=None: must be an integer >= 0"),
    ({"seed": "1"}, r"^seed='1': must be an integer >= 0"),  # was accepted
    ({"n_init": 10**12}, r"^n_init=1000000000000: must be at most 100,000 \(points of the initial design\)"),  # was a 16 TiB MemoryError
    ({"n_objectives": 0}, r"^n_objectives=0: must be an integer >= 1"),
])
def test_optimizers_refuse_bad_counts_and_seeds(kwargs, match):
    from paperline.kernels.search.base import make_optimizer
    from paperline.kernels.search.space import SearchSpace

    space = SearchSpace.box([0.0, 0.0], [1.0, 1.0])
    with pytest.raises(InputError, match=match):
        make_optimizer("random", space, **kwargs)


@pytest.mark.parametrize("q, match", [(2.5, r"^q=2.5: must be an integer"), ("2", "^q='2': must be an integer"),
                                      (10**10, r"^q=10000000000: must be at most 100,000 \(the batch size\)"), (0, "^q=0")])
def test_ask_refuses_a_batch_size_that_is_not_a_count(q, match):
    from paperline.kernels.search.base import make_optimizer
    from paperline.kernels.search.space import SearchSpace

    opt = make_optimizer("random", SearchSpace.box([0.0, 0.0], [1.0, 1.0]))
    with pytest.raises(InputError, match=match):
        opt.ask(q)
    assert opt.ask(2).shape == (2, 2)


# -- malformed input at the public boundary: refused by name, nothing lost ------------------------
def told_optimizer():
    opt = make_optimizer("random", SearchSpace.box([0.0, 0.0], [1.0, 1.0]), 2, seed=0, n_init=4, ref_point=[0.0, 0.0])
    x = opt.ask(4)
    opt.tell(x, np.column_stack([x.sum(axis=1), -x[:, 0]]))
    return opt


@pytest.mark.parametrize("bad, match", [
    (np.inf, r"^y=\[\[inf, 1\.0\]\]: infinite objective values \(row 1\); values must be finite, NaN marks a failed"),
    (-np.inf, r"^y=\[\[-inf, 1\.0\]\]: infinite objective values \(row 1\)"),  # was recorded as a failure, silently
    # was NumPy's "could not convert string to float"
    ("abc", r"^y=\[\[0\.5, 0\.5\], \[.abc., 1\.0\], \[0\.2, 0\.3\]\]: expected 3 x 2 numbers$"),
])
def test_tell_refuses_infinite_or_non_numeric_values_and_keeps_the_history(bad, match):
    opt = told_optimizer()
    before, asked = json.dumps(opt.state_dict()), opt.ask(3)
    y = np.array([[0.5, 0.5], [0.0, 1.0], [0.2, 0.3]], dtype=object)
    y[1, 0] = bad
    with pytest.raises(InputError, match=match):
        opt.tell(asked, y)
    assert json.dumps(opt.state_dict()) == before and opt.n_batches == 1 and opt.x.shape == (4, 2)
    np.testing.assert_array_equal(opt.ask(3), asked)  # the next batch is what it was
    opt.tell(asked, np.array([[0.5, 0.5], [np.nan, 1.0], [0.2, 0.3]]))  # NaN still marks a failed evaluation
    assert opt.ok.tolist() == [True] * 5 + [False, True]


@pytest.mark.parametrize("fn", [hypervolume, hypervolume_trace])
@pytest.mark.parametrize("y, ref, match", [
    ([[1.0, 2.0]], [np.nan, 0.0], r"^ref_point=\[nan, 0\.0\]: values must be finite"),  # was a silent 0.0
    ([[1.0, 2.0]], [0.0, -np.inf], r"^ref_point=\[0\.0, -inf\]: values must be finite"),
    ([1.0, 2.0, 3.0], [0.0, 0.0], r"^y=\(3,\): must be 2-D \(n_points, n_objectives\)"),  # was blamed on ref_point
    ([[1.0, 2.0, 3.0]], [0.0, 0.0], r"^ref_point=\[0\.0, 0\.0\]: expected 3 finite numbers, one per objective \(column\) of y"),
    ([["a", 2.0]], [0.0, 0.0], r"^y=.*must be a 2-D \(n_points, n_objectives\) array of numbers"),
])
def test_hypervolume_names_a_bad_front_or_reference_point(fn, y, ref, match):
    with pytest.raises(InputError, match=match):
        fn(y, ref)


def drop(key):
    return lambda s: {k: v for k, v in s.items() if k != key}


@pytest.mark.parametrize("edit, match", [
    (lambda s: "{not json", r"^state='\{not json': not valid JSON \(Expecting property name"),  # was JSONDecodeError
    (lambda s: [s], r"^state=\[.*must be a dict \(or its JSON text\) from Optimizer\.state_dict\(\), not list"),
    (drop("seed"), r"^state=\{.*: missing key 'seed' \(written by Optimizer\.state_dict\(\)\)$"),  # was KeyError
    (drop("space"), r"^state=\{.*: missing key 'space'"),
    (lambda s: {**s, "optimizer": "simulated-annealing"},
     r"^state\.optimizer='simulated-annealing': unknown optimizer; known: alphax, bo, .*random, turbo$"),
    (lambda s: {**s, "optimizer": ["random"]}, r"^state\.optimizer=\['random'\]: must be an optimizer name"),
    (lambda s: {**s, "options": ["leaf_size"]}, r"^state\.options=\['leaf_size'\]: must be a dict"),  # was TypeError
    (lambda s: {**s, "options": {"leaf_size": 3}}, r"^state\.options=\['leaf_size'\]: unknown for random"),
    (lambda s: {**s, "seed": "0"}, r"^state\.seed='0': must be an integer >= 0"),
    (lambda s: {**s, "ref_point": "abc"}, r"^state\.ref_point='abc': expected 2 finite number"),  # was ValueError
    (lambda s: {**s, "ref_point": [0.0]}, r"^state\.ref_point=\[0\.0\]: expected 2 finite number"),
    (lambda s: {**s, "space": {"kind": "sphere"}}, r"^state\.space=\{'kind': 'sphere'\}: must be SearchSpace\.to_dict"),
    (lambda s: {**s, "batches": {"x": []}}, r"^state\.batches=\{'x': \[\]\}: must be a list"),
    (lambda s: {**s, "batches": [{"x": [[0.5, 0.5]]}]}, r"^state\.batches\[0\]=\{'x'.*: must be \{x: n x 2 numbers"),
    (lambda s: {**s, "batches": [{"x": [[0.5, 0.5]], "y": [[1.0]]}]},
     r"^state\.batches\[0\]\.y=\(1, 1\): expected 1 x 2"),
    (lambda s: {**s, "batches": [{"x": [[5.0, 0.5]], "y": [[1.0, 2.0]]}]},
     r"^state\.batches\[0\]\.x=.*outside the search"),
])
def test_load_optimizer_names_what_is_wrong_with_a_malformed_state(edit, match):
    state = json.loads(json.dumps(told_optimizer().state_dict()))
    with pytest.raises(InputError, match=match):
        load_optimizer(edit(state))


@pytest.fixture(scope="module")
def campaign_state():
    campaign = run_campaign(Campaign("branin-currin", "random", budget=10, q=5, n_init=5))
    return json.loads(json.dumps(campaign.state_dict()))


@pytest.mark.parametrize("edit, match", [
    (lambda s: "{", r"^state='\{': not valid JSON"),
    (lambda s: None, r"^state=None: must be a dict \(or its JSON text\) from Campaign\.state_dict\(\), not NoneType"),
    (drop("evaluations"), r"^state=\{.*: missing key 'evaluations' \(written by Campaign\.state_dict\(\)\)$"),
    (lambda s: {**s, "optimizer": drop("batches")(s["optimizer"])}, r"^state\.optimizer=\{.*: missing key 'batches'"),
    (lambda s: {**s, "problem": "knapsack"}, r"^state\.problem='knapsack': unknown problem; known: .*branin-currin"),
    (lambda s: {**s, "problem": 3}, r"^state\.problem=3: must be a problem name"),
    (lambda s: {**s, "optimizer": {**s["optimizer"], "optimizer": "sa"}},
     r"^state\.optimizer\.optimizer='sa': unknown optimizer; known: alphax, bo, "),
    (lambda s: {**s, "optimizer": {**s["optimizer"], "optimizer": ["sa"]}}, r"^state\.optimizer\.optimizer=\['sa'\]"),
    (lambda s: {**s, "optimizer": {**s["optimizer"], "options": {"cp": 1.0}}}, r"^state\.optimizer\.options=\['cp'\]"),
    (lambda s: {**s, "problem_options": ["dim"]}, r"^state\.problem_options=\['dim'\]: must be a dict or null"),
    (lambda s: {**s, "seed": 1.5}, r"^state\.seed=1\.5: must be an integer >= 0"),
    (lambda s: {**s, "ref_point": "18,6"}, r"^state\.ref_point='18,6': must be numbers or null"),
    (lambda s: {**s, "evaluations": s["evaluations"][:-1]}, r"^state\.evaluations=9: expected 10 records"),
    (lambda s: {**s, "evaluations": [{"x": 1}] + s["evaluations"][1:]},
     r"^state\.evaluations\[0\]=\{'x': 1\}: an evaluation record has the keys index, batch, x"),
    (lambda s: {**s, "optimizer": {**s["optimizer"], "batches": [{"x": [[9.0, 0.5]], "y": [[1.0, 2.0]]}]}},
     r"^state\.optimizer\.batches\[0\]\.x=.*outside the search space"),
])
def test_campaign_from_state_names_what_is_wrong_with_a_malformed_checkpoint(campaign_state, edit, match):
    state = json.loads(json.dumps(campaign_state))
    with pytest.raises(InputError, match=match):
        Campaign.from_state(edit(state))
    assert Campaign.from_state(json.dumps(state), budget=15).n_done == 10  # the JSON text of a valid one loads
    with pytest.raises(InputError, match=r"^budget=4: smaller than the initial design"):  # the caller's own: by name
        Campaign.from_state(state, budget=4)
    with pytest.raises(InputError, match=r"^budget=0: must be an integer >= 1"):  # fell back to the saved budget
        Campaign.from_state(state, budget=0)


def test_a_hypervolume_acquisition_without_a_reference_point_is_refused():
    """qLogEHVI built with ref_point=None got a NaN reference point and went on (a review)."""
    from paperline.kernels.search.botorch_opt import acquisition, fit_gp

    space = SearchSpace.box([0.0, 0.0], [1.0, 1.0])
    x = space.sample(np.random.default_rng(3), 8)
    y = np.stack([-x[:, 0], -x[:, 1]], axis=1)
    model = fit_gp(space.features(x), y)
    for kind in ("ehvi", "nehvi"):
        with pytest.raises(InputError, match=rf"ref_point=None: {kind} needs one reference value per objective \(2\)"):
            acquisition(kind, model, space.features(x), y, seed=1)
        with pytest.raises(InputError, match="ref_point"):
            acquisition(kind, model, space.features(x), y, seed=1, ref_point=np.array([0.0]))
    with pytest.raises(InputError, match="acquisition='ucb': known: ei, ehvi, nehvi"):
        acquisition("ucb", model, space.features(x), y, seed=1)
