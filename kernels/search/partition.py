"""The learned space-partition tree shared by LaNAS, LA-MCTS and LaMOO.

Each node holds a subset of the evaluated samples. A splittable node learns a boundary on the
samples' features: it labels them good/bad (LA-MCTS: k-means on (x, f); LaMOO: dominance number;
LaNAS: a linear regressor against the node mean), fits a classifier (an SVM, or the thresholded
linear model) and splits its samples by the classifier's *prediction*, so that every child is a
region of the space, not only a set of points. Selection descends from the root by UCB; the path
of (node, side) pairs is the region a new batch is sampled in. See [Wang2020lamcts]_ Sec. 3 and
Alg. 1; [Zhao2022lamoo]_ Sec. 4; [Wang2021lanas]_ Sec. 3.

The tree is rebuilt from all told samples at every ask ("learning" in Alg. 1), so it is a pure
function of the history and needs no state of its own.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from paperline.kernels.search.space import SearchSpace

GOOD, BAD = 1, 0


class Boundary(Protocol):
    """A fitted split: ``predict(features: n x f) -> n int`` with 1 for the good side."""

    def predict(self, features: np.ndarray) -> np.ndarray:
        """The side of each of ``n`` points: ``features`` ``n x f`` float64 (the space's
        model inputs) -> ``n`` int labels, :data:`GOOD` (1) or :data:`BAD` (0). :func:`build_tree`
        splits a node's samples by it and :func:`in_region` keeps the points on a path's sides.
        Source: [Wang2020lamcts]_ Sec. 3, [Zhao2022lamoo]_ Sec. 4.1, [Wang2021lanas]_ Sec. 3."""
        ...


# labeler(features of the node's samples, values of those samples, rng) -> (labels n int {0, 1}, boundary) or None
Splitter = Callable[[np.ndarray, np.ndarray, np.random.Generator], "tuple[np.ndarray, Boundary] | None"]


@dataclass
class PartitionNode:
    """One region: ``idx`` indexes the samples inside it; ``boundary`` splits it (None at a leaf)."""

    id: int
    depth: int
    idx: np.ndarray
    value: float
    side: str = "root"
    boundary: Boundary | None = None
    good: PartitionNode | None = None
    bad: PartitionNode | None = None
    visits: int = field(default=0)

    @property
    def n(self) -> int:
        """Number of samples in the region."""
        return int(self.idx.size)

    @property
    def is_leaf(self) -> bool:
        """True when the node was not split."""
        return self.good is None

    def children(self) -> list[PartitionNode]:
        """``[good, bad]``, or ``[]`` at a leaf."""
        return [] if self.is_leaf else [self.good, self.bad]  # type: ignore[list-item]

    def to_dict(self, ucb: Callable[[PartitionNode, PartitionNode | None], float] | None = None,
                parent: PartitionNode | None = None) -> dict[str, Any]:
        """JSON-able nested dicts: id, side, depth, n (samples), value, ucb, children."""
        out: dict[str, Any] = {"id": self.id, "side": self.side, "depth": self.depth, "n": self.n,
                               "value": float(self.value)}
        if ucb is not None and parent is not None:
            out["ucb"] = float(ucb(self, parent))
        out["children"] = [c.to_dict(ucb, self) for c in self.children()]
        return out


def build_tree(features: np.ndarray, values: np.ndarray, splitter: Splitter,
               node_value: Callable[[np.ndarray], float], rng: np.random.Generator, *,
               leaf_size: int, max_depth: int = 8) -> PartitionNode:
    """Grow the partition tree over ``n`` samples.

    Args:
        features: ``n x f`` float64 model inputs of the samples.
        values: ``n x m`` float64 objective values (maximization).
        splitter: labels a node's samples and fits the boundary (None: cannot split).
        node_value: the value of a node from the indices of its samples (LA-MCTS: mean f;
            LaMOO: hypervolume).
        leaf_size: a node with fewer samples than this is a leaf (LA-MCTS's threshold theta).
        max_depth: depth limit.

    Returns:
        The root; node ids are assigned breadth-first.
    """
    root = PartitionNode(0, 0, np.arange(features.shape[0]), node_value(np.arange(features.shape[0])))
    queue, next_id = [root], 1
    while queue:
        node = queue.pop(0)
        if node.n < leaf_size or node.depth >= max_depth:
            continue
        split = splitter(features[node.idx], values[node.idx], rng)
        if split is None:
            continue
        _, boundary = split
        predicted = np.asarray(boundary.predict(features[node.idx])).astype(np.int64)
        good_idx, bad_idx = node.idx[predicted == GOOD], node.idx[predicted == BAD]
        if good_idx.size == 0 or bad_idx.size == 0:  # the boundary does not separate: a leaf
            continue
        node.boundary = boundary
        node.good = PartitionNode(next_id, node.depth + 1, good_idx, node_value(good_idx), "good")
        node.bad = PartitionNode(next_id + 1, node.depth + 1, bad_idx, node_value(bad_idx), "bad")
        next_id += 2
        queue += [node.good, node.bad]
    return root


def select_paths(root: PartitionNode, q: int,
                 ucb: Callable[[PartitionNode, PartitionNode], float]) -> list[list[tuple[PartitionNode, int]]]:
    """``q`` root-to-leaf paths chosen by UCB, with virtual visits spreading a batch.

    Each path is a list of (node, side) pairs, ``side`` being GOOD or BAD for the child taken.
    After each pick, the visit counts along the path grow by one, so the next pick sees the
    exploration bonus of the other branches rise (parallel MCTS with virtual loss).
    """
    for node in walk(root):
        node.visits = node.n
    paths = []
    for _ in range(q):
        node, path = root, []
        while not node.is_leaf:
            good, bad = node.good, node.bad
            side = GOOD if ucb(good, node) >= ucb(bad, node) else BAD  # type: ignore[arg-type]
            path.append((node, side))
            node.visits += 1
            node = good if side == GOOD else bad  # type: ignore[assignment]
        node.visits += 1
        paths.append(path)
    return paths


def leaf_of(path: list[tuple[PartitionNode, int]], root: PartitionNode) -> PartitionNode:
    """The node ``path`` (from :func:`select_paths`) ends in: the last step's chosen child
    (``root`` for an empty path)."""
    if not path:
        return root
    node, side = path[-1]
    return node.good if side == GOOD else node.bad  # type: ignore[return-value]


def in_region(path: list[tuple[PartitionNode, int]], features: np.ndarray) -> np.ndarray:
    """Mask of the rows of ``features`` (``n x f``) inside the region of ``path``."""
    mask = np.ones(features.shape[0], dtype=bool)
    for node, side in path:
        if not mask.any():
            break
        pred = np.asarray(node.boundary.predict(features[mask])).astype(np.int64)  # type: ignore[union-attr]
        sub = np.flatnonzero(mask)
        mask[sub[pred != side]] = False
    return mask


def region_candidates(space: SearchSpace, path: list[tuple[PartitionNode, int]], anchors: np.ndarray,
                      rng: np.random.Generator, n: int, *, local_scale: float = 0.1,
                      rounds: int = 10) -> np.ndarray:
    """Up to ``n`` points inside the region of ``path`` (``k x d`` float64, ``k <= n``).

    Candidates are drawn half uniformly, half as local perturbations of ``anchors`` (the samples
    of the selected leaf, ``a x d``), then filtered by the path's boundaries. If the region
    yields nothing after ``rounds`` draws, the local perturbations themselves are returned (the
    leaf's samples lie in the region, so points near them are the closest substitute).
    """
    kept: list[np.ndarray] = []
    total = 0
    for _ in range(rounds):
        pool = np.vstack([space.sample(rng, n), space.neighbours(anchors, rng, n, scale=local_scale)])
        inside = pool[in_region(path, space.features(pool))]
        kept.append(inside)
        total += inside.shape[0]
        if total >= n:
            break
    out = np.vstack(kept) if kept else np.zeros((0, space.dim))
    if out.shape[0] == 0:
        out = space.neighbours(anchors, rng, n, scale=local_scale / 2)
    return out[:n]


def uct_bonus(cp: float) -> Callable[[PartitionNode, PartitionNode], float]:
    """LA-MCTS's UCB: ``value + 2 Cp sqrt(2 ln n_parent / n_child)`` ([Wang2020lamcts]_ Eq. 1)."""

    def ucb(child: PartitionNode, parent: PartitionNode) -> float:
        if child.visits == 0:
            return math.inf
        return child.value + 2.0 * cp * math.sqrt(2.0 * math.log(max(parent.visits, 1)) / child.visits)

    return ucb


def walk(node: PartitionNode) -> Iterator[PartitionNode]:
    """Every node of the tree under ``node`` (itself first), depth first."""
    yield node
    for c in node.children():
        yield from walk(c)


def leaves(root: PartitionNode) -> list[PartitionNode]:
    """The leaves under ``root``, depth first, good side first."""
    return [n for n in walk(root) if n.is_leaf]


class SVMBoundary:
    """An SVM boundary (scikit-learn ``SVC``) fitted to good/bad labels."""

    def __init__(self, kernel: str = "rbf"):
        from sklearn.svm import SVC

        self.model = SVC(kernel=kernel, gamma="scale")

    def fit(self, features: np.ndarray, labels: np.ndarray) -> SVMBoundary:
        """Fit to ``features`` (``n x f``) and ``labels`` (``n`` int {0, 1}); returns ``self``."""
        self.model.fit(features, labels)
        return self

    def predict(self, features: np.ndarray) -> np.ndarray:
        """``n x f`` features -> ``n`` int labels, 1 for the good side."""
        return self.model.predict(features)


def svm_split(labels: np.ndarray, features: np.ndarray, kernel: str) -> tuple[np.ndarray, Boundary] | None:
    """Fit an SVM to ``labels``; None when the labels hold one class only."""
    labels = np.asarray(labels, dtype=np.int64)
    if np.unique(labels).size < 2:
        return None
    return labels, SVMBoundary(kernel).fit(features, labels)
