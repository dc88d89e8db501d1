"""The kernels as torch custom ops (`llm_act.kernels.custom_ops`): schemas, fake
implementations, and that the codecs reach every kernel through an op.

`opcheck` runs each op on CPU (the torch reference; the Triton launchers on a GPU, `gpu`
tests) and checks its schema (no input mutated or aliased), its autograd registration and
its fake implementation against the real outputs, also under AOT dispatch with dynamic
shapes. Only the declared arguments are written in place: the codec state and side-list
buffers of an encode (`nonfinite_ref`) and a restore's output. The coverage checks read the `*_triton.py` sources (no triton import): every
launcher is the Triton side of an op whose reference has its signature, and no codec calls
a launcher or its reference directly.
"""
import ast
import inspect
import pathlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map_only

import llm_act.codecs as codecs
import llm_act.kernels as kernels
from llm_act.codecs import CODEC_NAMES, make_codec
from llm_act.kernels import nonfinite_ref
from llm_act.kernels.custom_ops import KERNEL_OPS, NAMESPACE

KERNEL_DIR = pathlib.Path(kernels.__file__).parent
CODEC_DIR = pathlib.Path(codecs.__file__).parent
#: opcheck's tests; AOT dispatch is left out where inputs require grad (no op has a backward)
ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor",
              "test_aot_dispatch_dynamic")
GRAD_CHECKS = ALL_CHECKS[:3]


def _samples(device) -> list[tuple[str, tuple, dict]]:
    """(op name, args, kwargs) for every op; a decode takes its encode's real outputs."""
    gen = torch.Generator().manual_seed(0)
    out = []

    def randn(*shape, dtype=torch.float32):
        return (torch.randn(shape, generator=gen) * 3).to(device=device, dtype=dtype)

    def rand(*shape):
        return torch.rand(shape, generator=gen).to(device)

    def add(name, *args, **kwargs):
        out.append((name, args, kwargs))
        return KERNEL_OPS[name].op(*args, **kwargs)

    x = randn(300)
    enc = add("int_quant_encode", x, 4, 128, False, noise=rand(300))
    add("int_quant_encode", randn(300, dtype=torch.bfloat16), 8, 64, True)
    add("int_quant_encode", x, 2, 128, False, seed=7)
    add("int_quant_decode", *enc, 4, 128, False, 300, torch.bfloat16)
    enc = add("int_quant_axis_encode", randn(20, 12), 2, True, noise=rand(240))
    add("int_quant_axis_encode", randn(7, 5, dtype=torch.float16), 4, False, seed=7)
    add("int_quant_axis_decode", *enc, 2, True, 240, torch.float32)
    x_nf = randn(300, dtype=torch.bfloat16)
    x_nf[[4, 200]] = float("nan")
    side = dict(zip(("nf_index", "nf_value", "nf_count"),
                    nonfinite_ref.empty_side_list(300, torch.bfloat16, device)))
    add("int_quant_encode", x_nf, 4, 128, False, seed=7, state=nonfinite_ref.new_state(device),
        **side)
    add("restore_nonfinite", randn(300, dtype=torch.bfloat16), *side.values())

    x2 = randn(16, 40)
    x2[:, 3] *= 50
    enc = add("outlier_encode", x2, 32, 3.0, 1, noise=rand(640))
    add("outlier_encode", x2.half(), 32, 3.0, 0, seed=7)
    side = dict(zip(("nf_index", "nf_value", "nf_count"),
                    nonfinite_ref.empty_side_list(640, torch.float32, device)))
    add("outlier_encode", x2, 32, 3.0, 1, seed=7, state=nonfinite_ref.new_state(device), **side)
    add("outlier_decode", *enc, 32, 16, 40, torch.float16)

    enc = add("dual_encode", randn(20, 12), 8, 2, rand(20, 12))
    add("dual_encode", randn(9, 5, dtype=torch.bfloat16), 4, 4, seed=7)
    add("dual_decode", *enc, 8, 2, 20, 12, torch.float32)

    enc = add("fp8_encode", x, 128, "e4m3")
    add("fp8_encode", randn(0), 128, "e5m2")
    add("fp8_decode", *enc, 128, "e4m3", torch.bfloat16)

    cuts = torch.linspace(-3.0, 3.0, 7).to(device)
    enc = add("fewbit_encode", x, cuts, 3, False)
    add("fewbit_encode", randn(130, dtype=torch.float16), cuts[4:], 2, True)
    add("fewbit_decode", *enc, torch.linspace(0.0, 1.0, 8).to(device), 3, 300, torch.float16)

    packed = add("bitmask_pack", rand(37) > 0.3)
    add("bitmask_pack", (rand(5, 9) > 0.5).to(torch.bfloat16))
    add("bitmask_unpack", packed, 37, torch.bool)
    return out


def _ids(samples):
    seen: dict[str, int] = {}
    ids = []
    for name, _, _ in samples:
        seen[name] = seen.get(name, -1) + 1
        ids.append(f"{name}-{seen[name]}")
    return ids


CPU_SAMPLES = _samples("cpu")


def _requiring_grad(args, kwargs):
    """Copies of the sample whose float tensors require grad (autograd registration)."""
    def grad(t):
        return t.detach().clone().requires_grad_() if t.is_floating_point() else t

    return tree_map_only(torch.Tensor, grad, (args, kwargs))


def _check_fake_matches_real(name, args, kwargs):
    op = KERNEL_OPS[name].op
    cpu_state = torch.get_rng_state()
    cuda_state = torch.cuda.get_rng_state() if torch.cuda.is_available() else None
    real = op(*args, **kwargs)
    # stochastic ops take their noise (or seed) as inputs: the global generators stay put
    assert torch.equal(torch.get_rng_state(), cpu_state)
    if cuda_state is not None:
        assert torch.equal(torch.cuda.get_rng_state(), cuda_state)
    mode = FakeTensorMode()
    fake_args, fake_kwargs = tree_map_only(torch.Tensor, mode.from_tensor, (args, kwargs))
    with mode:
        fake = op(*fake_args, **fake_kwargs)
    if real is None:  # an op that only writes in place (restore_nonfinite)
        assert fake is None, name
        return
    real = real if isinstance(real, tuple) else (real,)
    fake = fake if isinstance(fake, tuple) else (fake,)
    assert len(fake) == len(real)
    for f, r in zip(fake, real):
        assert (f.shape, f.dtype, f.device) == (r.shape, r.dtype, r.device), name


def test_every_op_has_a_sample():
    assert {name for name, _, _ in CPU_SAMPLES} == set(KERNEL_OPS)


@pytest.mark.parametrize("name,args,kwargs", CPU_SAMPLES, ids=_ids(CPU_SAMPLES))
def test_opcheck(name, args, kwargs):
    op = KERNEL_OPS[name].op
    torch.library.opcheck(op, args, kwargs, test_utils=ALL_CHECKS)
    grad_args, grad_kwargs = _requiring_grad(args, kwargs)
    torch.library.opcheck(op, grad_args, grad_kwargs, test_utils=GRAD_CHECKS)


@pytest.mark.parametrize("name,args,kwargs", CPU_SAMPLES, ids=_ids(CPU_SAMPLES))
def test_fake_matches_real(name, args, kwargs):
    _check_fake_matches_real(name, args, kwargs)


def test_ops_are_registered_under_the_namespace():
    for name, entry in KERNEL_OPS.items():
        assert getattr(torch.ops.llm_act, name).default is entry.op._opoverload
        assert str(entry.op._opoverload._schema).startswith(f"{NAMESPACE}::{name}(")


# ---- coverage: every launcher is an op, and codecs call kernels only through ops ------------
def _launchers() -> dict[str, list[str]]:
    """'<family>_triton.<launcher>' -> its parameter names, for every public function (not
    @triton.jit) of the `*_triton.py` sources."""
    found = {}
    for path in sorted(KERNEL_DIR.glob("*_triton.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_") and not any(
                    "jit" in ast.unparse(d) for d in node.decorator_list):
                params = [a.arg for a in node.args.posonlyargs + node.args.args]
                found[f"{path.stem}.{node.name}"] = params
    return found


def test_launcher_sources_found():
    assert {k.split(".")[0] for k in _launchers()} == {
        "int_quant_triton", "outlier_triton", "dual_triton", "fp8_triton", "fewbit_triton",
        "bitmask_triton", "nonfinite_triton"}


def test_every_launcher_is_an_op_with_its_references_signature():
    launchers = _launchers()
    registered = {entry.launcher for entry in KERNEL_OPS.values()}
    missing = sorted(set(launchers) - registered)
    assert not missing, f"launchers without an op (see llm_act.kernels.custom_ops): {missing}"
    assert registered <= set(launchers)
    for name, entry in KERNEL_OPS.items():
        module, function = entry.launcher.split(".")
        ref = entry.reference
        assert ref.__module__ == f"llm_act.kernels.{module.replace('_triton', '_ref')}", name
        assert ref.__name__ == f"{function}_ref", name
        # the op calls either with the same positional arguments
        assert list(inspect.signature(ref).parameters) == launchers[entry.launcher], name


def test_codecs_call_no_launcher_or_reference_directly():
    launchers = {key.split(".")[1] for key in _launchers()}
    forbidden = launchers | {f"{name}_ref" for name in launchers}
    modules = {path.stem for path in KERNEL_DIR.glob("*_triton.py")}
    bad = []
    for path in sorted(CODEC_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute):  # custom_ops.<launcher> is the op itself
                direct = node.attr in forbidden and ast.unparse(node.value) != "custom_ops"
                names = [node.attr] if direct else []
            elif isinstance(node, ast.Name):
                names = [node.id] if node.id in forbidden else []
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [n for n in [a.name for a in node.names] + [getattr(node, "module", "")]
                         if n and (n in forbidden or n.split(".")[-1] in modules)]
            else:
                names = []
            bad += [f"{path.name}:{node.lineno} {n}" for n in names]
    assert not bad, "call the kernels through llm_act.kernels.custom_ops:\n" + "\n".join(bad)


class _OpLog(TorchDispatchMode):
    """Records the llm_act ops dispatched while active."""

    def __init__(self):
        super().__init__()
        self.seen: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == NAMESPACE:
            self.seen.add(func._opname)
        return func(*args, **(kwargs or {}))


def _codec_input(name, device):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn((64, 2, 48), generator=gen) * 2
    x[..., 5] *= 40  # an outlier channel
    return (x > 0 if name == "bitmask" else x).to(device)


def _ops_of_codecs(device) -> dict[str, tuple[set, set]]:
    used = {}
    for name in CODEC_NAMES:
        if name == "regen":  # draws its mask and stores a generator state: no kernel
            continue
        codec = make_codec(name)
        x = _codec_input(name, device)
        with _OpLog() as enc_log:
            enc = codec.encode(x)
        with _OpLog() as dec_log:
            codec.decode(enc)
        used[name] = (enc_log.seen, dec_log.seen)
    return used


def _check_codecs_use_every_op(device):
    used = _ops_of_codecs(device)
    for name, (enc, dec) in used.items():
        assert enc and dec, f"codec {name!r} runs no kernel op (encode {enc}, decode {dec})"
    assert set().union(*(e | d for e, d in used.values())) == set(KERNEL_OPS)


def test_codecs_run_their_kernels_as_ops_and_use_every_op():
    _check_codecs_use_every_op("cpu")


# ---- the same on a GPU: the Triton launchers behind the ops ------------------------------
@pytest.mark.gpu
def test_ops_on_cuda_run_the_launchers_and_match_their_fakes():
    for name, args, kwargs in _samples("cuda"):
        op = KERNEL_OPS[name].op
        torch.library.opcheck(op, args, kwargs, test_utils=ALL_CHECKS)
        _check_fake_matches_real(name, args, kwargs)
    _check_codecs_use_every_op("cuda")
