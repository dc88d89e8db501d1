"""`LiveStorageTracker` against hand-computed peaks (plain torch, float32: 4 bytes per element).

Each case states which storages are alive at the peak; the tracker must give those bytes
exactly: temporaries freed before the next is made count once (the peak is a maximum, not a
sum), views and in-place ops add nothing, factory functions and backward ops are seen,
resized storages are re-counted, and storages alive at entry are credited when freed.
"""
from __future__ import annotations

import torch

from llm_act.bench.live_storage import LiveStorageTracker, module_tensors, track_peak

F = 4  # bytes per float32


def test_matmul_relu_forward_and_backward():
    """loss = (x @ w).relu().sum() with x [4, 8], w [8, 16] given as the baseline.

    Forward: h = x @ w (256 B) and y = relu(h) (256 B, relu saves its output) are both alive
    when relu returns: 512 B; h is freed (mm saved x and w, which pre-exist); loss (4 B).
    After forward: y + loss = 260 B.
    Backward: the ones grad seed (4 B, held by autograd.backward until it returns), grad_h =
    threshold_backward (256 B); relu's saved y is released after its node runs; then
    grad_w = grad_h^T-style mm (512 B) and grad_x (128 B), both accumulated as .grad.
    Peak, at the second mm: loss 4 + seed 4 + grad_h 256 + grad_w 512 + grad_x 128 = 904 B.
    After: loss + the two .grad = 644 B.
    """
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    with LiveStorageTracker([x, w], record_peak=True) as t:
        loss = (x @ w).relu().sum()
        t.mark("forward")
        loss.backward()
    assert t.baseline_bytes == (4 * 8 + 8 * 16) * F
    name, live, peak = t.marks[0]
    assert (live, peak) == ((4 * 16 + 1) * F, 2 * 4 * 16 * F)
    assert t.peak_bytes == (1 + 1 + 4 * 16 + 8 * 16 + 4 * 8) * F == 904
    assert t.peak_phase == "backward"
    assert t.peak_total_bytes == 904 + 640
    assert t.live_bytes == (1 + 8 * 16 + 4 * 8) * F
    assert sorted(r.nbytes for r in t.peak_records) == [4, 4, 128, 256, 512]
    assert sum(r.nbytes for r in t.peak_records) == t.peak_bytes


def test_saved_output_held_by_python_adds_to_the_peak():
    """Same, but y is also held by a Python name: it stays alive through backward (+256 B)."""
    x = torch.randn(4, 8, requires_grad=True)
    w = torch.randn(8, 16, requires_grad=True)
    with LiveStorageTracker([x, w]) as t:
        y = (x @ w).relu()
        loss = y.sum()
        loss.backward()
    assert t.peak_bytes == 904 + 4 * 16 * F
    del y


def test_a_temporary_freed_before_the_next_counts_once():
    """a = (x * 2).sum(): the 4000 B product is freed when sum returns; the second product
    is made after. Peak = one product + a + b = 4008 B, not 8008."""
    x = torch.randn(1000)
    with track_peak([x]) as t:
        a = (x * 2).sum()
        b = (x * 3).sum()
    assert t.peak_bytes == 1000 * F + 2 * F
    assert t.live_bytes == 2 * F
    del a, b


def test_sequential_allocations_peak_is_the_largest():
    with track_peak() as t:
        a = torch.empty(1000)
        del a
        b = torch.empty(2000)
        del b
        c = torch.zeros(500)
        del c
    assert t.peak_bytes == 2000 * F
    assert t.live_bytes == 0


def test_views_and_in_place_ops_are_not_counted_again():
    with track_peak() as t:
        base = torch.zeros(1000)
        views = [base[10:], base.view(10, 100), base.view(10, 100).t(), base[None].expand(3, 1000),
                 base.as_strided((10,), (2,)), base.unsqueeze(0).squeeze(0)]
        base.add_(1)
        base.mul_(2)
        views[1].clamp_(max=3)
        torch.add(base, 1, out=base)
    assert t.peak_bytes == t.live_bytes == 1000 * F
    del views
    # a copy is counted: reshape of a non-contiguous view copies
    with track_peak([base]) as t2:
        copy = base.view(10, 100).t().reshape(-1)
    assert t2.peak_bytes == 1000 * F
    del copy


def test_factory_functions_are_seen():
    with track_peak() as t:
        tensors = [torch.empty(10), torch.zeros(20), torch.ones(30), torch.full((40,), 2.0),
                   torch.randn(50), torch.arange(60, dtype=torch.float32)]
        tensors += [torch.empty_like(tensors[4]), torch.tensor([1.0, 2.0])]  # 50, 2 elements
    assert t.live_bytes == t.peak_bytes == (10 + 20 + 30 + 40 + 50 + 60 + 50 + 2) * F
    del tensors


def test_ignored_ops_count_nothing_and_are_not_adopted():
    """A reference's rounding noise (what a GPU kernel draws in registers) counts 0 bytes,
    while it lives and when an op reads it or it is freed; everything else still counts."""
    x = torch.ones(100)
    with track_peak(ignore_ops=("aten.rand.default",)) as t:
        noise = torch.rand(100)
        y = x + noise  # reads the ignored storage: not adopted, not credited when freed
        del noise
        z = y * 2
    assert t.peak_bytes == t.live_bytes == 200 * F
    with track_peak() as t:
        noise = torch.rand(100)
    assert t.peak_bytes == 100 * F
    del y, z


def test_resized_storages_are_recounted():
    with track_peak() as t:
        z = torch.zeros(3)
        z.resize_(100)  # Tensor.resize_: through the dispatcher
        assert t.live_bytes == 100 * F
        s = torch.empty(4)
        s.untyped_storage().resize_(64)  # UntypedStorage.resize_: patched while tracking
        assert t.live_bytes == 100 * F + 64
        z.untyped_storage().resize_(0)  # how megatron / FSDP free a buffer in place
        assert t.live_bytes == 64
    assert t.peak_bytes == 100 * F + 64
    assert torch.UntypedStorage.resize_.__name__ != "_patched_resize"  # the patch is removed
    del s, z


def test_frees_of_storages_alive_at_entry_are_credited():
    big = torch.empty(1000)
    with track_peak([big]) as t:
        del big  # freed: -4000
        tmp = torch.empty(1000)  # +4000: back to the entry level
    assert t.baseline_bytes == 1000 * F
    assert t.peak_bytes == 0 and t.live_bytes == 0
    del tmp

    # not in the baseline, but touched by an op: adopted as pre-existing, its free credited
    big = torch.empty(1000)
    with track_peak() as t:
        big.add_(1)
        del big
        tmp = torch.empty(1000)
    assert (t.baseline_bytes, t.peak_bytes, t.live_bytes) == (1000 * F, 0, 0)
    del tmp

    # without adoption, an unseen pre-existing storage's free is not credited
    big = torch.empty(1000)
    with track_peak(adopt_inputs=False) as t:
        big.add_(1)  # in place on an unknown storage: nothing new
        view = big[1:]  # a view of it: nothing new
        assert t.live_bytes == 0
        del big, view
        tmp = torch.empty(1000)
    assert (t.baseline_bytes, t.peak_bytes) == (0, 1000 * F)
    del tmp


def test_module_baseline_and_training_step():
    """A Linear(16, 32) without bias on x [8, 16]: weight 2048 B at entry; after a step with
    set_to_none grads, its .grad (2048 B) is the only new storage left."""
    torch.manual_seed(0)
    lin = torch.nn.Linear(16, 32, bias=False)
    x = torch.randn(8, 16)
    assert sum(p.numel() * F for p in module_tensors(lin)) == 32 * 16 * F
    with track_peak(lin) as t:
        out = lin(x)  # 1024 B; x and the weight are saved (pre-existing)
        loss = out.square().mean()  # square 1024 B (saved input: out), mean 4 B
        del out
        loss.backward()
        del loss
    # the weight (given) and x (adopted: an op read it, it was not made in the region)
    assert t.baseline_bytes == (32 * 16 + 8 * 16) * F
    assert t.live_bytes == 32 * 16 * F  # weight.grad
    # forward: out + square + loss = 2052 B; backward adds grads; the peak is a backward one
    assert t.marks == [] and t.peak_bytes >= 2052
    grad = lin.weight.grad.clone()
    lin.weight.grad = None
    torch.manual_seed(0)
    loss = lin(x).square().mean()
    loss.backward()
    assert torch.equal(grad, lin.weight.grad)  # tracking changes nothing


def test_baseline_all_finds_live_tensors():
    keep = torch.empty(12345)
    with track_peak("all") as t:
        pass
    assert t.baseline_bytes >= 12345 * F
    del keep


@torch.library.custom_op("llm_act_peak_test::doubled", mutates_args=())
def _doubled(x: torch.Tensor) -> torch.Tensor:
    wide = x.double()  # a temporary of 8 bytes per element, freed before the op returns
    return (wide * 2).to(x.dtype)


@_doubled.register_fake
def _(x):
    return torch.empty_like(x)


def test_custom_op_temporaries_are_seen_inside_its_body():
    """x: 100 float32 (400 B). The body holds wide (800 B) and wide * 2 (800 B) and then makes
    the output (400 B): 2000 B at its peak; opaque, only the output counts."""
    x = torch.randn(100)
    with track_peak([x]) as inside:
        y = torch.ops.llm_act_peak_test.doubled(x)
    with track_peak([x], inside_custom_ops=False) as opaque:
        z = torch.ops.llm_act_peak_test.doubled(x)
    assert torch.equal(y, z) and torch.equal(y, x * 2)
    assert inside.peak_bytes == 800 + 800 + 400
    assert opaque.peak_bytes == 400
    assert inside.live_bytes == opaque.live_bytes == 400
