"""The non-finite side list found inside an encode kernel (`nonfinite_triton`) against its
torch reference (`nonfinite_ref`), under the interpreter, through the int_quant kernel."""
import pytest
import torch

pytest.importorskip("triton")

from llm_act.kernels import int_quant_triton as tri  # noqa: E402
from llm_act.kernels import nonfinite_ref as ref  # noqa: E402
from llm_act.kernels import nonfinite_triton  # noqa: E402


def _with_nonfinite(n, positions, dtype):
    x = torch.randn(n).to(dtype)
    kinds = [float("nan"), float("inf"), float("-inf")]
    for i, p in enumerate(positions):
        x[p] = kinds[i % 3]
    return x


def _encode(x, state):
    index, value, count = ref.empty_side_list(x.numel(), x.dtype, x.device)
    index.fill_(-7)  # unwritten slots must never matter
    tri.int_quant_encode(x, 4, 128, False, seed=3, state=state, nf_index=index,
                         nf_value=value, nf_count=count)
    return index, value, count


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("positions", [[], [0], [5, 4097, 9000, 12287], list(range(100, 140))],
                         ids=["none", "first", "across-programs", "past-capacity"])
def test_kernel_side_list_matches_reference(dtype, positions, grids):
    grids.watch(tri, "_encode_groups_kernel")
    n = 12288  # 3 programs of 4096
    x = _with_nonfinite(n, positions, dtype)
    state_k, state_r = ref.new_state("cpu"), ref.new_state("cpu")
    index, value, count = _encode(x, state_k)
    r_index, r_value, r_count = ref.side_list_ref(x, state_r)
    assert grids.most("_encode_groups_kernel") == 3
    assert int(count) == int(r_count) == len(positions)
    used = min(len(positions), ref.nonfinite_capacity(n))
    assert torch.equal(index[:used], r_index[:used])
    assert torch.equal(value[:used].view(torch.uint8), r_value[:used].view(torch.uint8))  # bits
    over = max(0, len(positions) - ref.nonfinite_capacity(n))
    assert int(state_k[ref.OVERFLOW]) == int(state_r[ref.OVERFLOW]) == over
    # the last program left the running fields at zero and counted the call
    assert state_k.tolist()[:3] == [1, 0, 0]


@pytest.mark.parametrize("count_value", [0, 3, 99])
def test_restore_writes_used_slots_only(count_value):
    """Slots past `count` hold garbage (out-of-range indices here) and are never read; a
    count past the capacity (99) means every slot is used."""
    out = torch.randn(5000, dtype=torch.bfloat16)
    cap = ref.nonfinite_capacity(out.numel())
    index = torch.full((cap,), 10**9, dtype=torch.int32)
    index[:3] = torch.tensor([7, 4999, 0], dtype=torch.int32)
    value = torch.full((cap,), 123.0, dtype=torch.bfloat16)
    value[:3] = torch.tensor([float("nan"), float("-inf"), float("inf")], dtype=torch.bfloat16)
    if count_value > cap:
        index[3:], value[3:] = 1, float("nan")
    count = torch.tensor([count_value], dtype=torch.int32)
    expect = out.clone()
    ref.restore_nonfinite_ref(expect, index, value, count)
    got = out.clone()
    nonfinite_triton.restore_nonfinite(got, index, value, count)
    assert torch.equal(got.view(torch.int16), expect.view(torch.int16))
    changed = (got.view(torch.int16) != out.view(torch.int16)).sum().item()
    assert changed == min(count_value, cap)
    if count_value:
        assert torch.isnan(got[7]) and got[4999] == float("-inf") and got[0] == float("inf")


def test_call_count_keys_a_new_stream():
    """The state's call count changes the kernel's random bits from one call to the next
    (a fixed key would round every step's activations alike)."""
    x = torch.full((8192,), 0.3)
    x[0::64], x[1::64] = 0.0, 1.0  # a range in every group, so rounding draws matter
    state = ref.new_state("cpu")
    a = tri.int_quant_encode(x, 4, 64, False, seed=5, state=state,
                             **dict(zip(("nf_index", "nf_value", "nf_count"),
                                        ref.empty_side_list(x.numel(), x.dtype, "cpu"))))[0]
    b = tri.int_quant_encode(x, 4, 64, False, seed=5, state=state,
                             **dict(zip(("nf_index", "nf_value", "nf_count"),
                                        ref.empty_side_list(x.numel(), x.dtype, "cpu"))))[0]
    c = tri.int_quant_encode(x, 4, 64, False, seed=5)[0]  # no state: the seed alone
    d = tri.int_quant_encode(x, 4, 64, False, seed=5)[0]
    assert not torch.equal(a, b) and torch.equal(c, d)
    assert int(state[ref.EPOCH]) == 2
