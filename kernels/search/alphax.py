"""AlphaX: Monte Carlo tree search over architecture-building actions, guided by a meta-DNN.

See [Wang2019alphax]_ (L. Wang, Y. Zhao, Y. Jinnai, Y. Tian, R. Fonseca. AlphaX: eXploring Neural
Architectures with Deep Neural Networks and Monte Carlo Tree Search. AAAI 2020).

The search space is a product of ``d`` categorical variables (for NAS-Bench-201: 6 edges x 5
operations). An architecture is built by ``d`` actions: the root of the tree is the empty
architecture, a node at depth ``i`` has fixed variables ``0 .. i-1`` and its children choose the
option of variable ``i``; a leaf at depth ``d`` is a full architecture. Each node keeps its visit
count and value sum. One batch of ``q`` proposals runs ``q`` MCTS iterations:

1. **Selection**: from the root, descend with UCT (``Q + c_ucb * sqrt(ln N_parent / N_child)``)
   while every action of the node has been tried.
2. **Expansion**: add one untried action (chosen uniformly at random) as a new child.
3. **Simulation**: complete the partial architecture ``n_rollout_candidates`` times at random and
   keep the completion the meta-DNN predicts best (the paper's meta-DNN-guided rollout); it is the
   architecture proposed for evaluation.
4. **Backpropagation**: the evaluated value is added to every node of its path. Within a batch
   (proposals not evaluated yet) each proposal adds a *virtual loss* along its path, so the next
   selection of the same batch is pushed elsewhere.

Tree state follows the optimizer contract (:mod:`.base`): :class:`ActionTree` is rebuilt from the
told batches in ``_update``; ``ask`` draws its randomness from ``Optimizer.rng`` and trains the
meta-DNN from ``Optimizer.torch_seed``, so it is a pure function of (seed, options, told batches).

Design decisions (this implementation, not the paper):

- **Values**: the backed-up value of an evaluation is its empirical quantile among the successful
  evaluations so far, ``(rank - 1/2) / k`` in ``(0, 1)`` (``value_normalization="rank"``; ties get
  their average rank), or ``(y - min) / (max - min)`` (``"minmax"``). Values are recomputed when
  the tree is rebuilt, so they are always relative to the whole history. Rank values make
  ``c_ucb`` independent of the objective's units and insensitive to outliers (the NAS-Bench-201
  cells whose accuracy collapses to 10 % would otherwise squeeze all good subtrees into a narrow
  band of ``Q``).
- **Failed evaluations** (NaN rows) count as a visit with the pessimistic value 0 (below every
  success): a subtree whose architectures fail (out of memory, divergence) is visited less. They
  are never fitted by the meta-DNN and never proposed again.
- **Virtual loss**: each proposal of the batch adds ``virtual_loss`` visits of value 0 to every node
  on its path, which also marks the expanded action as tried; proposals of one batch are distinct
  because a leaf, once proposed, counts as taken in the exhaustion bookkeeping.
- In the paper the meta-DNN's *predicted* accuracies of rollouts also enter the backed-up values;
  here the tree holds only evaluated values, so it is a function of the told batches alone, and
  the meta-DNN acts in the simulation step (choosing which completion is evaluated).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from scipy.stats import rankdata

from paperline.kernels.errors import InputError
from paperline.kernels.search.base import OPTIMIZERS, Optimizer, check_int
from paperline.kernels.search.space import SearchSpace, point_key

Prefix = tuple[int, ...]


# -- tree state ---------------------------------------------------------------------------------
@dataclass
class Node:
    """Statistics of one node (a partial architecture).

    Attributes:
        visits: evaluations through this node (failed ones included).
        value_sum: sum of their normalized values (failed ones add 0).
        y_sum: sum of their raw objective values (maximization convention; successful ones only).
        n_ok: successful evaluations through this node.
        n_leaves: distinct evaluated architectures below this node.
    """

    visits: int = 0
    value_sum: float = 0.0
    y_sum: float = 0.0
    n_ok: int = 0
    n_leaves: int = 0


@dataclass
class ActionTree:
    """The AlphaX search tree: nodes keyed by their action prefix (``()`` is the root).

    Attributes:
        n_options: ``d`` ints, the number of actions at each depth.
        nodes: prefix -> :class:`Node`; holds exactly the prefixes of evaluated architectures.
    """

    n_options: tuple[int, ...]
    nodes: dict[Prefix, Node] = field(default_factory=dict)

    @property
    def depth(self) -> int:
        """Number of decisions of a full architecture (the tree's depth)."""
        return len(self.n_options)

    def subtree_size(self, depth: int) -> int:
        """Number of full architectures below a node at ``depth``."""
        return int(np.prod(self.n_options[depth:], dtype=np.int64))

    def node(self, prefix: Prefix) -> Node | None:
        """The node of ``prefix`` (a tuple of option indices), or None when no evaluated architecture starts with it."""
        return self.nodes.get(prefix)


def normalize_values(y: np.ndarray, method: str = "rank") -> np.ndarray:
    """Per-evaluation values in ``[0, 1]`` for backpropagation.

    Args:
        y: ``n`` float64 objective values (maximization convention; NaN = failed).
        method: ``"rank"`` (empirical quantile ``(rank - 1/2) / k`` among the ``k`` successes,
            ties averaged) or ``"minmax"`` (``(y - min) / (max - min)``, 1/2 when all are equal).

    Returns:
        ``n`` float64 values; failed evaluations get 0.
    """
    y = np.asarray(y, dtype=np.float64).ravel()
    out = np.zeros_like(y)
    ok = np.isfinite(y)
    k = int(ok.sum())
    if k == 0:
        return out
    if method == "rank":
        out[ok] = (rankdata(y[ok]) - 0.5) / k
    else:
        lo, hi = float(y[ok].min()), float(y[ok].max())
        out[ok] = (y[ok] - lo) / (hi - lo) if hi > lo else 0.5
    return out


def build_tree(space: SearchSpace, x: np.ndarray, y: np.ndarray, method: str = "rank") -> ActionTree:
    """The tree of the told evaluations (**backpropagation** of every evaluated architecture).

    Args:
        space: a categorical search space with ``d`` variables.
        x: ``n x d`` float64 option indices of the evaluated architectures.
        y: ``n`` float64 objective values (maximization; NaN = failed).
        method: value normalization (see :func:`normalize_values`).

    Returns:
        The tree: each architecture's path from the root to its leaf, with visits and values.
    """
    tree = ActionTree(tuple(len(c) for c in space.choices))
    values = normalize_values(y, method)
    seen: set[Prefix] = set()
    for row, yi, vi in zip(np.asarray(x, dtype=np.int64), np.asarray(y, dtype=np.float64).ravel(), values):
        path = tuple(int(a) for a in row)
        new_leaf = path not in seen
        seen.add(path)
        ok = bool(np.isfinite(yi))
        for i in range(tree.depth + 1):
            node = tree.nodes.setdefault(path[:i], Node())
            node.visits += 1
            node.value_sum += float(vi)
            if ok:
                node.y_sum += float(yi)
                node.n_ok += 1
            node.n_leaves += int(new_leaf)
    return tree


@dataclass
class _BatchOverlay:
    """Virtual visits and taken leaves of the proposals made so far in one batch."""

    virtual: dict[Prefix, float] = field(default_factory=dict)
    taken: dict[Prefix, int] = field(default_factory=dict)

    def add(self, path: Prefix, virtual_loss: float) -> None:
        for i in range(len(path) + 1):
            self.virtual[path[:i]] = self.virtual.get(path[:i], 0.0) + virtual_loss
            self.taken[path[:i]] = self.taken.get(path[:i], 0) + 1


def _visits(tree: ActionTree, overlay: _BatchOverlay, prefix: Prefix) -> tuple[float, float]:
    """``(N, W)`` of a node: real plus virtual visits, and value sum (virtual losses add 0)."""
    node = tree.node(prefix)
    n = (node.visits if node else 0) + overlay.virtual.get(prefix, 0.0)
    return n, (node.value_sum if node else 0.0)


def _exhausted(tree: ActionTree, overlay: _BatchOverlay, prefix: Prefix) -> bool:
    node = tree.node(prefix)
    used = (node.n_leaves if node else 0) + overlay.taken.get(prefix, 0)
    return used >= tree.subtree_size(len(prefix))


def select_and_expand(tree: ActionTree, overlay: _BatchOverlay, rng: np.random.Generator,
                      c_ucb: float) -> Prefix | None:
    """**Selection** with UCT, then **expansion** of one untried action ([Wang2019alphax]_).

    From the root, while every non-exhausted action of the node has been tried (real or virtual
    visits), move to the child maximizing ``Q + c_ucb * sqrt(ln N_parent / N_child)`` with
    ``Q = W_child / N_child`` (ties broken at random). At the first node with an untried action,
    pick one of them uniformly at random.

    Returns:
        The prefix of the expanded node (its last action is the untried one), or None when every
        architecture has been evaluated or taken.
    """
    prefix: Prefix = ()
    if _exhausted(tree, overlay, prefix):
        return None
    while len(prefix) < tree.depth:
        children = [prefix + (a,) for a in range(tree.n_options[len(prefix)])]
        open_children = [c for c in children if not _exhausted(tree, overlay, c)]
        untried = [c for c in open_children if _visits(tree, overlay, c)[0] == 0]
        if untried:  # expansion
            return untried[int(rng.integers(len(untried)))]
        stats = np.array([_visits(tree, overlay, c) for c in open_children])  # k x 2: N, W
        n_parent = _visits(tree, overlay, prefix)[0]  # all children's visits, exhausted ones included
        ucb = stats[:, 1] / stats[:, 0] + c_ucb * np.sqrt(math.log(n_parent) / stats[:, 0])
        best = np.flatnonzero(ucb >= ucb.max() - 1e-12)
        prefix = open_children[int(best[rng.integers(len(best))])]
    return prefix  # only reached when a full architecture is untried (cannot happen: see above)


# -- meta-DNN -------------------------------------------------------------------------------------
@contextlib.contextmanager
def _torch_single_thread() -> Iterator[None]:
    """One intra-op thread while fitting (the same float results whatever the machine's core count)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class MetaDNN:
    """The meta-DNN accuracy predictor: an MLP ``features -> value`` ([Wang2019alphax]_).

    Fitted by full-batch Adam on standardized targets, in float64, with its weights initialized
    from ``seed`` inside a forked torch RNG (the global torch RNG is left untouched).

    Args:
        features: ``n x f`` float64 model inputs (``SearchSpace.features``; one-hot options).
        y: ``n`` float64 finite targets (maximization convention).
        hidden: width of the two hidden layers.
        epochs: full-batch Adam steps.
        lr: Adam learning rate.
        weight_decay: L2 penalty of Adam.
        seed: torch seed of the initial weights.
    """

    def __init__(self, features: np.ndarray, y: np.ndarray, *, hidden: int, epochs: int, lr: float,
                 weight_decay: float, seed: int):
        import torch

        x_t = torch.as_tensor(np.asarray(features, dtype=np.float64))
        y = np.asarray(y, dtype=np.float64).ravel()
        scale = float(y.std()) if y.size > 1 and y.std() > 0 else 1.0
        y_t = torch.as_tensor((y - y.mean()) / scale).unsqueeze(1)
        with _torch_single_thread(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(x_t.shape[1], hidden), torch.nn.ReLU(),
                torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
                torch.nn.Linear(hidden, 1),
            ).double()
            opt = torch.optim.Adam(self.net.parameters(), lr=lr, weight_decay=weight_decay)
            for _ in range(epochs):
                opt.zero_grad()
                loss = torch.nn.functional.mse_loss(self.net(x_t), y_t)
                loss.backward()
                opt.step()

    def predict(self, features: np.ndarray) -> np.ndarray:
        """Standardized predicted values, ``n`` float64, of ``n x f`` float64 features."""
        import torch

        with _torch_single_thread(), torch.no_grad():
            out = self.net(torch.as_tensor(np.asarray(features, dtype=np.float64)))
        return out.numpy().ravel().astype(np.float64)


def simulate(space: SearchSpace, prefix: Prefix, model: MetaDNN, rng: np.random.Generator,
             n_candidates: int, excluded: set[tuple[float, ...]]) -> np.ndarray | None:
    """**Simulation**: the best of ``n_candidates`` random completions of ``prefix`` by the meta-DNN.

    Args:
        space: the categorical space (``d`` variables).
        prefix: the options of variables ``0 .. len(prefix)-1``.
        model: the fitted meta-DNN.
        rng: the batch's generator.
        n_candidates: random completions drawn (duplicates removed; all of them when the
            subtree is no larger).
        excluded: point keys never to return (evaluated or already proposed).

    Returns:
        One ``d`` float64 architecture, or None when every sampled completion is excluded.
    """
    i, d = len(prefix), space.dim
    sizes = np.array([len(c) for c in space.choices[i:]], dtype=np.int64)
    if i == d:
        tail = np.zeros((1, 0), dtype=np.int64)
    elif int(np.prod(sizes)) <= n_candidates:  # small subtree: enumerate it
        tail = np.array(np.unravel_index(np.arange(int(np.prod(sizes))), tuple(sizes))).T
    else:
        tail = rng.integers(0, sizes, size=(n_candidates, d - i))
    cand = np.hstack([np.broadcast_to(np.array(prefix, dtype=np.int64), (tail.shape[0], i)), tail])
    cand = np.unique(cand, axis=0).astype(np.float64)
    cand = cand[[point_key(r) not in excluded for r in cand]]
    if cand.shape[0] == 0:
        return None
    pred = model.predict(space.features(cand))
    return cand[int(np.argmax(pred))]


# -- the optimizer ----------------------------------------------------------------------------
@OPTIMIZERS.register("alphax")
class AlphaX(Optimizer):
    """AlphaX ([Wang2019alphax]_): MCTS over the choices of a categorical space, meta-DNN rollouts.

    Single objective, categorical spaces only. Options (``defaults``):

    - ``c_ucb`` (float >= 0): UCT exploration constant (values are in ``[0, 1]``).
    - ``n_rollout_candidates`` (int >= 1): random completions scored by the meta-DNN per proposal.
    - ``virtual_loss`` (float > 0): virtual visits (value 0) per in-batch proposal on its path.
    - ``hidden`` (int >= 1), ``train_epochs`` (int >= 1), ``lr`` (float > 0),
      ``weight_decay`` (float >= 0): the meta-DNN and its full-batch Adam fit.
    - ``value_normalization`` (``"rank"`` or ``"minmax"``): see :func:`normalize_values`.

    Raises:
        InputError: an option out of its range (naming the option and the value), or the base
        class's errors (a box space, several objectives, ``n_init < 1``).
    """

    name = "alphax"
    multi_objective: ClassVar[bool | None] = False
    spaces: ClassVar[tuple[str, ...]] = ("categorical",)
    defaults: ClassVar[dict[str, Any]] = {
        "c_ucb": 0.5,
        "n_rollout_candidates": 256,
        "virtual_loss": 1.0,
        "hidden": 64,
        "train_epochs": 200,
        "lr": 0.01,
        "weight_decay": 1e-4,
        "value_normalization": "rank",
    }
    positive: ClassVar[frozenset[str]] = frozenset({"n_rollout_candidates", "virtual_loss", "hidden", "train_epochs",
                                                    "lr"})
    option_help: ClassVar[dict[str, str]] = {
        "c_ucb": "UCT exploration constant (values are in [0, 1])",
        "n_rollout_candidates": "random completions the meta-DNN scores per proposal",
        "virtual_loss": "virtual visits (value 0) each in-batch proposal adds on its path",
        "hidden": "width of the meta-DNN's two hidden layers",
        "train_epochs": "full-batch Adam epochs fitting the meta-DNN per batch",
        "lr": "the meta-DNN's Adam learning rate",
        "weight_decay": "the meta-DNN's L2 penalty",
        "value_normalization": "rank (empirical quantile) or minmax: the value a tree node backs up",
    }

    def __init__(self, space: SearchSpace, n_objectives: int = 1, **kwargs: Any):
        super().__init__(space, n_objectives, **kwargs)
        if self.options["value_normalization"] not in ("rank", "minmax"):
            raise InputError("value_normalization", self.options["value_normalization"], "must be 'rank' or 'minmax'")
        self._tree = build_tree(space, self._x, self._y[:, 0], self.options["value_normalization"])

    def _update(self, x: np.ndarray, y: np.ndarray) -> None:
        # Rebuilt from the whole history: values are quantiles relative to every told batch.
        self._tree = build_tree(self.space, self._x, self._y[:, 0], self.options["value_normalization"])

    def _suggest(self, q: int) -> np.ndarray:
        """``q x d`` float64 new architectures (fewer when the space runs out): fit the meta-DNN on
        the successful evaluations, then ``q`` rounds of selection, expansion, simulation and a
        virtual-loss backup."""
        o = self.options
        rng = self.rng()
        x_ok, y_ok = self.data()
        model = MetaDNN(self.space.features(x_ok), y_ok[:, 0], hidden=o["hidden"], epochs=o["train_epochs"],
                        lr=o["lr"], weight_decay=o["weight_decay"], seed=self.torch_seed())
        overlay = _BatchOverlay()
        excluded = set(self._seen)
        out: list[np.ndarray] = []
        while len(out) < q:
            prefix = select_and_expand(self._tree, overlay, rng, o["c_ucb"])  # selection + expansion
            if prefix is None:
                break
            arch = simulate(self.space, prefix, model, rng, o["n_rollout_candidates"], excluded)  # simulation
            if arch is None:  # cannot happen below a fresh node; mark the node taken and go on
                overlay.add(prefix, o["virtual_loss"])
                continue
            excluded.add(point_key(arch))
            overlay.add(tuple(int(a) for a in arch), o["virtual_loss"])  # virtual loss (backpropagation)
            out.append(arch)
        return np.array(out, dtype=np.float64).reshape(-1, self.space.dim)

    def tree(self, *, max_children: int = 3, max_depth: int = 3) -> dict[str, Any]:
        """The search tree as JSON-able nested dicts, capped for rendering.

        Each node: ``action`` (``"root"`` or ``"variable=option"``), ``visits``, ``mean_value``
        (the ``Q`` of UCT, in ``[0, 1]``), ``mean_y`` (mean objective of its successful
        evaluations, maximization convention, or None), ``n_children`` (tried actions) and
        ``children`` (the ``max_children`` most visited, down to depth ``max_depth``). The root
        also has ``n_nodes``.

        Raises:
            InputError: ``max_children`` or ``max_depth`` not an integer >= 0.
        """
        max_children = check_int(max_children, "max_children", low=0)
        max_depth = check_int(max_depth, "max_depth", low=0)
        t = self._tree

        def render(prefix: Prefix) -> dict[str, Any]:
            node = t.node(prefix) or Node()
            depth = len(prefix)
            kids: list[Prefix] = []
            if depth < t.depth:
                kids = [prefix + (a,) for a in range(t.n_options[depth]) if prefix + (a,) in t.nodes]
            action = "root" if not prefix else f"{self.space.names[depth - 1]}={self.space.choices[depth - 1][prefix[-1]]}"
            out: dict[str, Any] = {
                "action": action,
                "visits": int(node.visits),
                "mean_value": float(node.value_sum / node.visits) if node.visits else None,
                "mean_y": float(node.y_sum / node.n_ok) if node.n_ok else None,
                "n_children": len(kids),
                "children": [],
            }
            if depth < max_depth:
                kids.sort(key=lambda c: (-t.nodes[c].visits, c))
                out["children"] = [render(c) for c in kids[:max_children]]
            return out

        root = render(())
        root["n_nodes"] = len(t.nodes)
        return root
