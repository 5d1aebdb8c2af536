"""Training kernels for the compressed distributed training pipeline (pure torch, no backends).

* :mod:`.isgd` -- Inconsistent Stochastic Gradient Descent: a Shewhart control chart on the batch
  loss flags under-trained batches, which get a few extra, conservative gradient steps.
  L. Wang, Y. Yang, M. R. Min, S. Chakradhar, "Accelerating Deep Neural Network Training with
  Inconsistent Stochastic Gradient Descent", Neural Networks 2017, arXiv:1603.05544.
* :mod:`.recompute` -- SuperNeurons-style cost-aware recomputation: the activations of cheap layers
  (activations, normalization, pooling) are dropped in forward and recomputed in backward, expensive
  layers (convolution, linear) are never re-run; plus a saved-activation memory meter and a
  "deepest model within a memory budget" search. L. Wang, J. Ye, Y. Zhao, W. Wu, A. Li, S. L. Song,
  Z. Xu, T. Kraska, "SuperNeurons: Dynamic GPU Memory Management for Training Deep Neural
  Networks", PPoPP 2018.
"""


def format_ratio(x: float) -> str:
    """A ratio (compression ratio, "fewer bytes") as the flow's table and the benchmark print it:
    one decimal, or two where one would read 1.0 for another value (fft at θ=1 and 32 bits sent
    3% more than none, and the table said 1.0: a trial)."""
    text = f"{x:.1f}"
    return f"{x:.2f}" if text == "1.0" and x != 1.0 else text
