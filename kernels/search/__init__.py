"""Search campaigns: NAS and black-box optimizers with batched ask/tell (``kernels/search``).

- :mod:`.space`: box and categorical search spaces.
- :mod:`.problems`: the problem registry (NAS-Bench-201 tables, BoTorch test problems, live NAS).
- :mod:`.base`: the optimizer interface and registry; ``make_optimizer``, ``load_optimizer``.
- Optimizers: ``random``, ``lanas``, ``lamcts``, ``lamoo``, ``alphax`` and the baselines ``bo``,
  ``turbo``, ``qehvi``, ``qnehvi``, ``nsga2``.
- :mod:`.pareto`: dominance numbers, hypervolume (BoTorch), reference-point checks.
- :mod:`.campaign`: the sequential campaign loop (the flow runs the same steps as tasks).

References:
    .. [Wang2021lanas] L. Wang, S. Xie, T. Li, R. Fonseca, Y. Tian. Sample-Efficient Neural
       Architecture Search by Learning Action Space. TPAMI 2021.
    .. [Wang2020lamcts] L. Wang, R. Fonseca, Y. Tian. Learning Search Space Partition for
       Black-box Optimization using Monte Carlo Tree Search. NeurIPS 2020.
    .. [Zhao2022lamoo] Y. Zhao, L. Wang, K. Yang, T. Zhang, T. Guo, Y. Tian. Multi-objective
       Optimization by Learning Space Partitions. ICLR 2022.
    .. [Wang2019alphax] L. Wang, Y. Zhao, Y. Jinnai, Y. Tian, R. Fonseca. AlphaX: eXploring
       Neural Architectures with Deep Neural Networks and Monte Carlo Tree Search. AAAI 2020.
"""

from paperline.kernels.search.base import OPTIMIZERS, Optimizer, load_optimizer, make_optimizer, optimizer_names
from paperline.kernels.search.problems import PROBLEMS, Objective, Problem, make_problem, problem_names
from paperline.kernels.search.space import SearchSpace

__all__ = [
    "OPTIMIZERS", "PROBLEMS", "Objective", "Optimizer", "Problem", "SearchSpace", "load_optimizer",
    "make_optimizer", "make_problem", "optimizer_names", "problem_names",
]
