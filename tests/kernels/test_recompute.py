"""Cost-aware recomputation (kernels/train/recompute.py).

References: the baseline model without recomputation (policy ``none``) for outputs, gradients and
BatchNorm buffers (bit-identical, float64); saved-activation bytes written out by hand from the
tensor shapes and the module docstring's list of what each policy keeps; matmul/conv FLOPs counted
by torch's ``FlopCounterMode`` (cost-aware must not re-run an expensive layer); a brute-force scan
over depths for :func:`deepest_trainable`. Small CPU models only.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from torch.utils.flop_counter import FlopCounterMode

from paperline.kernels.errors import InputError
from paperline.kernels.train.recompute import (
    POLICIES,
    Segment,
    apply_recomputation,
    cheap_layer,
    deepest_trainable,
    peak_activation_bytes,
    recomputation_plan,
    saved_tensor_bytes,
)

F64 = 8  # bytes per float64 / int64 element


def small_cnn(seed: int = 0) -> nn.Sequential:
    """Three Conv-BN-ReLU-MaxPool blocks (16x16 -> 2x2) and a Dropout + Linear head, float64."""
    torch.manual_seed(seed)

    def block(cin: int, cout: int) -> nn.Sequential:
        return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.BatchNorm2d(cout), nn.ReLU(), nn.MaxPool2d(2))

    return nn.Sequential(block(3, 8), block(8, 16), block(16, 16),
                         nn.Flatten(), nn.Dropout(0.3), nn.Linear(16 * 2 * 2, 10)).double()


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, 3, 16, 16, dtype=torch.float64, generator=g), torch.randint(0, 10, (4,), generator=g)


def train_step(policy: str) -> dict[str, object]:
    """One forward + backward of a fresh seeded CNN under ``policy`` (train mode, Dropout active)."""
    base = small_cnn()
    model = apply_recomputation(base, policy)
    x, y = batch()
    torch.manual_seed(123)  # the Dropout mask
    flops = FlopCounterMode(display=False)
    with flops:
        out = model(x)
        nn.functional.cross_entropy(out, y).backward()
    return {
        "out": out.detach(),
        "grads": {n: p.grad.clone() for n, p in base.named_parameters()},
        "buffers": {n: b.clone() for n, b in base.named_buffers()},
        "flops": flops.get_total_flops(),
    }


@pytest.fixture(scope="module")
def steps() -> dict[str, dict[str, object]]:
    return {policy: train_step(policy) for policy in POLICIES}


# ---------------------------------------------------------------------------------------------------
# classification and plans


def test_cheap_layer_classification():
    for cheap in (nn.ReLU(), nn.LeakyReLU(), nn.GELU(), nn.BatchNorm2d(3), nn.MaxPool2d(2), nn.AvgPool1d(2),
                  nn.AdaptiveAvgPool2d(1), nn.Dropout(), nn.Identity(), nn.Flatten(),
                  nn.Sequential(nn.BatchNorm1d(4), nn.Tanh())):
        assert cheap_layer(cheap), cheap
    for expensive in (nn.Conv2d(3, 3, 3), nn.Linear(3, 3), nn.Embedding(4, 2), nn.Sequential(),
                      nn.Sequential(nn.ReLU(), nn.Linear(2, 2)), nn.MultiheadAttention(4, 1)):
        assert not cheap_layer(expensive), expensive
    with pytest.raises(InputError, match="module"):
        cheap_layer("relu")


class Sub(nn.Sequential):
    """A subclass of nn.Sequential: opaque to the flattening (it may override forward)."""


def test_cost_aware_plan_keeps_expensive_outputs():
    # hand-derived from the docstring rule: each cheap run + the conv/linear that follows it
    assert recomputation_plan(small_cnn(), "cost-aware") == [
        Segment(("0.0",), False),
        Segment(("0.1", "0.2", "0.3", "1.0"), True),
        Segment(("1.1", "1.2", "1.3", "2.0"), True),
        Segment(("2.1", "2.2", "2.3", "3", "4", "5"), True),
    ]
    assert recomputation_plan(small_cnn(), "all") == [Segment((str(i),), True) for i in range(6)]
    assert recomputation_plan(small_cnn(), "none") == [Segment((str(i),), False) for i in range(6)]
    # a cheap run followed by an opaque module is a region on its own; a trailing run too
    odd = nn.Sequential(nn.ReLU(), Sub(nn.Linear(2, 2), nn.ReLU()), nn.Tanh())
    assert recomputation_plan(odd, "cost-aware") == [
        Segment(("0",), True), Segment(("1",), False), Segment(("2",), True)]


def test_apply_returns_new_model_sharing_parameters():
    base = small_cnn()
    before = [type(m) for m in base.modules()]
    assert apply_recomputation(base, "none") is base
    for policy in ("cost-aware", "all"):
        model = apply_recomputation(base, policy)
        assert model is not base
        assert [type(m) for m in base.modules()] == before  # the input's structure is untouched
        assert {id(p) for p in model.parameters()} == {id(p) for p in base.parameters()}
        assert {id(b) for b in model.buffers()} == {id(b) for b in base.buffers()}


# ---------------------------------------------------------------------------------------------------
# exactness


@pytest.mark.parametrize("policy", ["cost-aware", "all"])
def test_outputs_gradients_and_bn_stats_identical(steps, policy):
    ref, got = steps["none"], steps[policy]
    assert torch.equal(got["out"], ref["out"])
    assert got["grads"].keys() == ref["grads"].keys()
    for name, g in ref["grads"].items():
        assert torch.equal(got["grads"][name], g), f"{policy}: gradient of {name} differs"
    # BatchNorm updated its running statistics exactly once, as without recomputation
    for name, b in ref["buffers"].items():
        assert torch.equal(got["buffers"][name], b), f"{policy}: buffer {name} differs"
    assert all(int(v) == 1 for n, v in got["buffers"].items() if n.endswith("num_batches_tracked"))


def test_plain_checkpoint_updates_batchnorm_twice():
    """The pitfall the recompute_context guards against: torch's checkpoint re-runs BatchNorm in
    training mode during backward, updating running statistics a second time. If a torch release
    stops doing this, this test fails and the guard can be reconsidered."""
    torch.manual_seed(0)
    x = torch.randn(8, 3, 4, 4, dtype=torch.float64, requires_grad=True)
    once = nn.BatchNorm2d(3).double()
    once(x).sum().backward()
    plain = nn.BatchNorm2d(3).double()
    checkpoint(plain, x, use_reentrant=False).sum().backward()
    assert int(plain.num_batches_tracked) == 2
    assert not torch.allclose(plain.running_mean, once.running_mean)
    guarded = nn.BatchNorm2d(3).double()
    apply_recomputation(nn.Sequential(guarded), "all")(x).sum().backward()
    assert int(guarded.num_batches_tracked) == 1
    assert torch.equal(guarded.running_mean, once.running_mean)
    assert torch.equal(guarded.running_var, once.running_var)


def test_eval_and_no_grad_paths_match():
    base = small_cnn().eval()
    x, _ = batch()
    with torch.no_grad():
        ref = base(x)
        for policy in ("cost-aware", "all"):
            assert torch.equal(apply_recomputation(base, policy)(x), ref)
    out = apply_recomputation(base, "cost-aware")(x)  # eval mode, grad enabled: still checkpointed
    assert torch.equal(out.detach(), ref)


def test_cost_aware_never_reruns_expensive_layers(steps):
    none, cost, every = (steps[p]["flops"] for p in POLICIES)
    assert cost == none, f"cost-aware re-ran a conv/linear: {cost} vs {none} FLOPs"
    assert every > none, f"'all' should recompute the convolutions: {every} vs {none} FLOPs"


# ---------------------------------------------------------------------------------------------------
# memory


def test_saved_activation_bytes():
    x, _ = batch()
    n = x.shape[0]
    measured = {p: peak_activation_bytes(apply_recomputation(small_cnn(), p), x) for p in POLICIES}
    # cost-aware keeps: the input (saved by the first conv) and each conv output (a region input)
    conv_outputs = n * F64 * (8 * 16 * 16 + 16 * 8 * 8 + 16 * 4 * 4)
    assert measured["cost-aware"] == x.numel() * F64 + conv_outputs
    # all keeps each top-level child's input: x, the two block outputs, the flattened features
    # (Flatten's output is a view of them) and the Dropout output
    block_outputs = n * F64 * (8 * 8 * 8 + 16 * 4 * 4)
    assert measured["all"] == x.numel() * F64 + block_outputs + 2 * n * F64 * 64
    ratio_cost = measured["cost-aware"] / measured["none"]
    ratio_all = measured["all"] / measured["none"]
    message = (f"saved bytes none={measured['none']} cost-aware={measured['cost-aware']} "
               f"({ratio_cost:.3f} of none) all={measured['all']} ({ratio_all:.3f} of none)")
    assert measured["cost-aware"] < measured["none"], message
    assert measured["all"] <= measured["cost-aware"], message
    # none keeps at least BN inputs, ReLU outputs and pooling indices on top of cost-aware's
    relu_outputs = conv_outputs
    pool_outputs = block_outputs + n * F64 * 64
    assert measured["none"] >= measured["cost-aware"] + relu_outputs + pool_outputs, message


@pytest.mark.parametrize("policy", POLICIES)
def test_saved_tensor_bytes_on_meta_bound_the_measured_bytes(policy):
    """The estimate the flow checks a run's memory with (no memory, any batch): on the ``meta``
    device it equals the same sum on CPU, and bounds the distinct storages measured, loosely."""
    from paperline.kernels.train.models import make_model

    x = torch.zeros(16, 1, 28, 28)
    real = apply_recomputation(make_model("resnet", width=32, blocks=2), policy)
    with torch.device("meta"):
        meta = apply_recomputation(make_model("resnet", width=32, blocks=2), policy)
    estimate = saved_tensor_bytes(meta, x.to("meta"))
    assert estimate == saved_tensor_bytes(real, x)
    measured = peak_activation_bytes(real, x)
    assert measured <= estimate <= 2 * measured, (measured, estimate)
    # linear in the batch, but for the weights layers save (0.3 MB here)
    big = saved_tensor_bytes(meta, torch.zeros(1600, 1, 28, 28, device="meta"))
    assert big == pytest.approx(100 * estimate, rel=0.02)


def test_measurement_has_no_side_effects():
    base = small_cnn()
    state = {k: v.clone() for k, v in base.state_dict().items()}
    x, _ = batch()
    torch.manual_seed(5)
    expected_rng = torch.rand(3)
    torch.manual_seed(5)
    peak_activation_bytes(apply_recomputation(base, "cost-aware"), x)
    assert torch.equal(torch.rand(3), expected_rng)
    assert all(torch.equal(base.state_dict()[k], v) for k, v in state.items())


def make_stack(depth: int) -> nn.Sequential:
    c = 4
    blocks = [nn.Sequential(nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c), nn.ReLU())
              for _ in range(depth)]
    return nn.Sequential(*blocks, nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c, 10))


def test_deepest_trainable_under_budget():
    x = torch.randn(2, 4, 8, 8)
    budget = 40_000  # bytes
    max_depth = 24
    depths = {}
    for policy in ("none", "cost-aware"):
        # reference: a linear scan over every depth
        sizes = [peak_activation_bytes(apply_recomputation(make_stack(d), policy), x) for d in range(1, max_depth + 1)]
        assert sizes == sorted(sizes)
        expected = max((d for d, s in enumerate(sizes, 1) if s <= budget), default=0)
        depths[policy] = deepest_trainable(make_stack, x, budget, policy, max_depth=max_depth)
        assert depths[policy] == expected, (policy, sizes)
    assert depths["cost-aware"] > depths["none"], depths
    assert deepest_trainable(make_stack, x, 10, "none") == 0
    assert deepest_trainable(make_stack, x, 10**9, "cost-aware", max_depth=5) == 5


# ---------------------------------------------------------------------------------------------------
# bad input


def test_bad_input():
    with pytest.raises(InputError, match="known: none, cost-aware, all") as err:
        apply_recomputation(small_cnn(), "selective")
    assert err.value.argument == "policy"
    with pytest.raises(InputError, match="policy"):
        recomputation_plan(small_cnn(), "sqrt")
    with pytest.raises(InputError, match="policy"):
        deepest_trainable(make_stack, torch.randn(1, 4, 4, 4), 1000, "cheap")
    with pytest.raises(InputError, match="model"):
        apply_recomputation(nn.Linear(2, 2), "cost-aware")
    with pytest.raises(InputError, match="model"):
        apply_recomputation("not a model", "none")
    with pytest.raises(InputError, match="budget_bytes"):
        deepest_trainable(make_stack, torch.randn(1, 4, 4, 4), 0, "none")
    with pytest.raises(InputError, match="max_depth"):
        deepest_trainable(make_stack, torch.randn(1, 4, 4, 4), 1000, "none", max_depth=0)
    with pytest.raises(InputError, match="make_model"):
        deepest_trainable(lambda d: None, torch.randn(1, 4, 4, 4), 1000, "none")
    with pytest.raises(InputError, match="example_input"):
        peak_activation_bytes(small_cnn(), [1, 2])


def test_numpy_integers_are_taken_and_bools_and_arrays_refused():
    x = torch.randn(2, 4, 8, 8)
    expected = deepest_trainable(make_stack, x, 40_000, "cost-aware", max_depth=6)
    got = deepest_trainable(make_stack, x, np.int64(40_000), "cost-aware", max_depth=np.int32(6))
    assert got == expected and type(got) is int
    with pytest.raises(InputError) as err:
        deepest_trainable(make_stack, x, np.bool_(True), "none")
    assert err.value.argument == "budget_bytes"
    with pytest.raises(InputError) as err:
        deepest_trainable(make_stack, x, 1000, "none", max_depth=True)
    assert err.value.argument == "max_depth"
    with pytest.raises(InputError) as err:
        deepest_trainable(make_stack, x, 40_000.0, "none")
    assert err.value.argument == "budget_bytes"
    with pytest.raises(InputError) as err:  # compared elementwise before; now a plain refusal
        recomputation_plan(small_cnn(), np.array(["none", "all"]))
    assert err.value.argument == "policy"


def test_cost_aware_reaches_inside_residual_blocks_of_the_training_resnet():
    from torch import nn

    from paperline.kernels.train.models import make_model
    from paperline.kernels.train.recompute import apply_recomputation, peak_activation_bytes

    torch.manual_seed(0)
    base = make_model("resnet", width=4, blocks=2).double()
    x = torch.randn(8, 1, 28, 28, dtype=torch.float64)
    grads, saved = {}, {}
    for policy in ("none", "cost-aware"):
        model = apply_recomputation(base, policy)
        saved[policy] = peak_activation_bytes(model, x)
        base.zero_grad()
        model(x).square().sum().backward()
        grads[policy] = [p.grad.clone() for p in base.parameters()]
    assert all(torch.equal(a, b) for a, b in zip(grads["none"], grads["cost-aware"]))
    assert saved["cost-aware"] < 0.85 * saved["none"], saved  # the blocks' ReLU outputs are recomputed
    assert all(type(m.body) is nn.Sequential for m in base if hasattr(m, "body"))  # the input model is unchanged
