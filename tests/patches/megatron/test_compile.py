"""torch.compile of a compressed megatron-core layer (issue 26, item 6).

A GPT TransformerLayer converted by `apply` under a fixed plan compiles with
`torch.compile(layer, backend="aot_eager")` on CPU: forward and backward run in one graph
(`fullgraph=True`: no graph break), the codecs' custom ops (`torch.ops.llm_act.*`) are in
the forward and backward graphs AOT autograd hands to the compiler (encodes in the forward,
decodes in the backward), and the output and every gradient equal the eager layer's bit
for bit. What still cannot compile is refused with one line (`unsupported.compile_refusal`).

One small layer (hidden 64, 2 heads, sequence 16, batch 2, no dropout); the compiles
dominate the run time.
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.backends.debugging import aot_eager, boxed_nop
from torch._dynamo.utils import counters

from llm_act import ActConfig
from llm_act.patches.megatron import apply
from tests import testing as T
from tests import gpt_runs as R

pytestmark = pytest.mark.usefixtures("megatron_one_rank")

SEQ, BATCH, HIDDEN, HEADS = 16, 2, 64, 2

#: nearest-rounding codecs of every family with a custom op at every site of the block
NEAREST = {"ln1.input": "int4_sym", "attn.qkv_input": "int8_sym", "attn.q": "int4_channel",
           "attn.k": "int4_channel", "attn.v": "fp8_e4m3", "attn.out": "int4_asym",
           "ln2.input": "fp8_e5m2", "mlp.fc1_input": "int4_asym", "mlp.act_input": "fewbit3",
           "mlp.fc2_input": "int4_sym"}
#: the op families NEAREST uses (torch.ops.llm_act.<family>_encode / _decode, and the
#: per-channel int_quant_axis_*)
FAMILIES = ("int_quant", "int_quant_axis", "fp8", "fewbit")


class Recorder:
    """An `aot_eager` backend that keeps what it compiles: dynamo's graphs, and the forward
    and backward graphs AOT autograd hands to its compilers."""

    def __init__(self):
        self.dynamo, self.forward, self.backward = [], [], []

    def __call__(self, gm, example_inputs):
        self.dynamo.append(gm)

        def keep(into):
            def compiler(g, inputs):
                into.append(g)
                return boxed_nop(g, inputs)
            return compiler

        return aot_eager(gm, example_inputs, fw_compiler=keep(self.forward),
                         bw_compiler=keep(self.backward))

    @staticmethod
    def ops(graphs) -> set[str]:
        """Names of the llm_act ops called in `graphs` ("int_quant_encode", ...): called
        directly, or through `auto_functionalized` (an op that writes into its arguments:
        the codec state, the side-list buffers)."""
        out = set()
        for g in graphs:
            for node in g.graph.nodes:
                if node.op != "call_function":
                    continue
                for target in (node.target, *node.args[:1]):
                    if isinstance(target, torch._ops.OpOverload) and target.namespace == "llm_act":
                        out.add(target._opname)
        return out


def build(config: ActConfig):
    """A converted TransformerLayer; equal weights and codec seeds for equal arguments.
    (`apply` takes the layer's container, as it takes a GPTModel.)"""
    R.seed_all(0)
    cfg = T.small_config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_layers=1, dropout=0.0)
    layer = T.transformer_layer(cfg)
    apply(torch.nn.ModuleList([layer]), config)
    return layer


def steps(layer, n: int):
    """[(output, [input grad, *parameter grads])] of `n` forward/backward passes, each on the
    same input and output gradient."""
    gen = torch.Generator().manual_seed(3)
    x0 = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    gy = torch.randn(SEQ, BATCH, HIDDEN, generator=gen)
    out = []
    for _ in range(n):
        x = x0.clone().requires_grad_(True)
        y, _ = layer(x, attention_mask=None)
        y.backward(gy)
        out.append((y.detach(), [x.grad] + [p.grad for p in layer.parameters()]))
        layer.zero_grad(set_to_none=True)
    return out


def graph_breaks() -> int:
    return sum(counters["graph_break"].values())


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("attention", ["chunked", "sdpa"])
def test_compiled_layer_matches_eager_in_one_graph(attention):
    """The codec ops are in the compiled graphs, nothing breaks the graph, and three
    compiled steps equal three eager steps bit for bit. SDPA's backward on decoded Q/K/V
    calls torch.autograd.grad, which dynamo traces only with `trace_autograd_ops`
    (without it the attention's function runs eagerly: a graph break, same values)."""
    config = ActConfig(plan="compress", codecs=NEAREST, attention=attention, adapt=False)
    eager, layer = build(config), build(config)
    ref = steps(eager, 3)
    recorder = Recorder()
    compiled = torch.compile(layer, backend=recorder, fullgraph=True)
    with torch._dynamo.config.patch(trace_autograd_ops=attention == "sdpa"):
        got = steps(compiled, 2)
        # the first call makes each codec's per-device state, the second compiles again
        # with the states in place; after that the cached graph serves every step
        compiles = len(recorder.dynamo)
        got += steps(compiled, 1)
    assert compiles <= 2 and len(recorder.dynamo) == compiles
    assert graph_breaks() == 0

    for (y_ref, g_ref), (y, g) in zip(ref, got):
        assert torch.equal(y, y_ref)
        assert all(torch.equal(a, b) for a, b in zip(g, g_ref))
    forward, backward = Recorder.ops(recorder.forward), Recorder.ops(recorder.backward)
    assert {f"{f}_encode" for f in FAMILIES} <= forward, forward
    assert {f"{f}_decode" for f in FAMILIES} <= backward, backward
    assert not any(op.endswith("_decode") for op in forward - {"restore_nonfinite"})


def test_plan_auto_is_refused_under_compile():
    """Plan "auto" measures the codecs and re-plans at tracking iterations: refused, in one
    line, when the compiled layer first runs (fullgraph: dynamo refuses with the same
    reason); the eager layer still runs."""
    layer = build(ActConfig(plan="auto", codecs=NEAREST))
    x = torch.randn(SEQ, BATCH, HIDDEN, requires_grad=True)
    with pytest.raises(NotImplementedError, match="plan 'auto' measures the codecs.*fixed plan"):
        torch.compile(layer, backend="aot_eager")(x, attention_mask=None)
    torch._dynamo.reset()  # else the second compile reuses what dynamo cached for this code
    with pytest.raises(Exception, match="plan 'auto' measures the codecs"):
        torch.compile(layer, backend="aot_eager", fullgraph=True)(x, attention_mask=None)
    layer(x, attention_mask=None)[0].sum().backward()


def test_compile_refusal_names_the_settings():
    from llm_act.patches.megatron.unsupported import compile_refusal

    cfg = T.small_config(hidden_size=HIDDEN, num_attention_heads=HEADS, num_layers=1)
    assert compile_refusal(cfg, ActConfig(plan="compress")) is None
    assert compile_refusal(cfg, ActConfig(plan="keep")) is None
    assert compile_refusal(cfg, ActConfig(plan="recompute")) is None
    assert compile_refusal(cfg, ActConfig(plan="auto", enabled=False)) is None
    assert "plan 'auto'" in compile_refusal(cfg, ActConfig(plan="auto"))
    cfg.tensor_model_parallel_size = 2
    assert "tensor_model_parallel_size=2" in compile_refusal(cfg, ActConfig(plan="keep"))
    cfg.tensor_model_parallel_size, cfg.num_moe_experts = 1, 4
    assert "num_moe_experts=4" in compile_refusal(cfg, ActConfig(plan="keep"))


@pytest.mark.slow
def test_compress_plan_compiles_and_matches_eager():
    """Plan "compress": its stochastic codecs (outlier_int4) draw their rounding noise on the
    torch references with `torch.rand(..., generator=codec.generator(device))`; dynamo
    cannot put a torch.Generator in a graph, so each such site's autograd function runs
    eagerly (graph breaks), from the same generator in the same order: the values equal
    eager's bit for bit. The nearest-rounding sites (int4_channel, fewbit3) stay in the
    graph."""
    config = ActConfig(plan="compress", attention="chunked", adapt=False)
    eager, layer = build(config), build(config)
    ref = steps(eager, 2)
    recorder = Recorder()
    got = steps(torch.compile(layer, backend=recorder), 2)
    for (y_ref, g_ref), (y, g) in zip(ref, got):
        assert torch.equal(y, y_ref)
        assert all(torch.equal(a, b) for a, b in zip(g, g_ref))
    assert graph_breaks() > 0
    assert {"int_quant_axis_encode", "fewbit_encode"} <= Recorder.ops(recorder.forward)
