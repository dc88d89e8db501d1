"""SavedTensorLedger: per-site bytes of a stock megatron-core layer, cross-checked against the
memory the process holds after forward, and the counting rules on small graphs."""
import pytest
import torch

from llm_act import ledger as ledger_mod
from llm_act.ledger import SavedTensorLedger, current_ledger, register_parameter_storage, report
from llm_act.sites import SITES


def _nbytes(t):
    return t.untyped_storage().nbytes()


# ---- counting rules on plain torch ------------------------------------------------------


def test_parameters_views_of_parameters_and_gathered_copies_are_not_counted():
    lin = torch.nn.Linear(32, 16, bias=False)
    x0 = torch.randn(8, 32, requires_grad=True)
    flat = torch.randn(16, 32, requires_grad=True)  # e.g. a flat buffer holding weights
    register_parameter_storage(flat)
    with SavedTensorLedger() as led:
        x = x0 * 1
        y = lin(x)  # saves x and the weight
        z = x @ lin.weight.t()  # a view of the parameter
        u = x @ flat.t()  # a registered parameter storage
    assert led.total_bytes == _nbytes(x)
    del y, z, u

    # ZeRO-3: the module's parameter points at a freshly gathered buffer during forward
    class Gathered(torch.nn.Linear):
        def forward(self, x):  # saves a plain tensor on the gathered storage
            return (x @ self.weight.detach().t()).exp()

    gathered = Gathered(32, 16, bias=False)
    handle = gathered.register_forward_pre_hook(
        lambda module, args: setattr(module.weight, "data", torch.randn(16, 32)))
    with SavedTensorLedger() as led:
        y = gathered(x0 * 1)
    handle.remove()
    assert led.total_bytes == _nbytes(y) and not led.errors  # the exp output only

    # a dtype copy of a parameter made inside autograd is the parameter in another dtype
    with SavedTensorLedger() as led:
        x = x0.to(torch.bfloat16)
        y = x @ lin.weight.to(torch.bfloat16).t()
    assert led.total_bytes == _nbytes(x)


def test_a_view_and_its_base_and_a_tensor_saved_twice_count_once():
    x0 = torch.randn(64, 16, requires_grad=True)
    with SavedTensorLedger() as led:
        base = x0 * 2
        a = base.view(16, 64).sin()  # saves the view
        b = base[:10].cos()  # saves another view of the same storage
        c = base * base  # saves the base twice
        q, k, v = (x0 * 3).chunk(3, dim=1)  # Q, K, V views of one buffer
        s = (q * k).sum() + v.exp().sum()
    assert led.total_bytes == _nbytes(base) + _nbytes(q) + _nbytes(v.exp())
    assert led.total_bytes == sum(led.by_site().values())


def test_freed_tensors_and_no_grad_are_not_counted():
    x0 = torch.randn(128, requires_grad=True)
    with SavedTensorLedger() as led:
        kept = (x0 * 1).exp()  # exp saves its result: kept
        dropped = (x0 * 1).sin()  # sin saves its input, freed with the graph below
        del dropped
        with torch.no_grad():
            y = (x0 * 1).exp()
    assert led.total_bytes == _nbytes(kept)
    assert led.by_site() == {(None, "other"): _nbytes(kept)}
    del kept
    with SavedTensorLedger() as led:
        with torch.no_grad():
            y = torch.nn.functional.gelu(x0 * 1).exp()
    assert led.total_bytes == 0 and led.by_site() == {}


class _SavesInBackward(torch.autograd.Function):
    """Backward runs a small forward with grad on (like recomputation) and saves tensors."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        with torch.enable_grad():
            xr = x.detach().requires_grad_()
            y = (xr * 1).exp().sin()  # saves two tensors while backward runs
            (gx,) = torch.autograd.grad(y.sum(), xr)
        return g * 2 + 0 * gx


def test_tensors_saved_in_backward_are_not_counted():
    x0 = torch.randn(256, requires_grad=True)
    with SavedTensorLedger() as led:
        x = x0 * 1
        out = _SavesInBackward.apply(x).exp()
        at_end_of_forward = led.live_bytes()
        out.sum().backward()
    assert at_end_of_forward == _nbytes(x) + _nbytes(out)
    assert led.total_bytes == at_end_of_forward

    # torch.utils.checkpoint recomputes in backward with grad on
    def block(t):
        return torch.nn.functional.gelu(t).exp()

    with SavedTensorLedger() as led:
        x = x0 * 1
        y = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=True)
        forward_total = led.live_bytes()
        y.sum().backward()
    assert forward_total == _nbytes(x)
    assert led.total_bytes == forward_total


class _Int8Saved(torch.autograd.Function):
    """A toy compressed op: stores an int8 payload + one scale and reports it."""

    @staticmethod
    def forward(ctx, x, layer):
        scale = x.abs().amax() / 127
        payload = (x / scale).round().to(torch.int8)
        ctx.save_for_backward(payload, scale.reshape(1))  # the ledger sees these too
        report(layer, "mlp.act_input", [payload, scale], payload.numel() + 4)
        return torch.relu(x)

    @staticmethod
    def backward(ctx, g):
        payload, scale = ctx.saved_tensors
        return g * ((payload.float() * scale) > 0), None


def test_reported_records_count_their_encoded_bytes_once():
    x0 = torch.randn(1000, requires_grad=True)
    with SavedTensorLedger() as led:
        assert current_ledger() is led
        out = _Int8Saved.apply(x0 * 1, 3)
        assert led.by_site() == {(3, "mlp.act_input"): 1000 + 4}
        out.sum().backward()
        assert led.live_bytes() == 0  # freed with the graph
    assert current_ledger() is None
    assert led.total_bytes == 1004

    # a record kept under a compressed layer's own (innermost) hooks: only report() sees it
    def pack(x):
        payload = x.to(torch.float16)
        report(0, "attn.q", payload, _nbytes(payload))
        return payload

    with SavedTensorLedger() as led:
        x = x0 * 1
        with ledger_mod.scope(0, "attn.k"):
            y = x.exp()  # saved by the ledger's hook, under an explicit scope
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda p: p.float()):
            z = x.sin()
    assert led.by_site() == {(0, "attn.k"): _nbytes(y), (0, "attn.q"): 2000}
    with pytest.raises(ValueError, match="site"):
        report(0, "attn.nothing", x0, 1)
    with pytest.raises(ValueError, match="layer"):
        report(-1, "attn.q", x0, 1)


# ---- a stock megatron-core layer ---------------------------------------------------------

megatron = pytest.importorskip("megatron.core")
from llm_act.bench.memory import ledger_and_held  # noqa: E402
from tests import testing as T  # noqa: E402


def expected_per_sbh(dtype, dropout, s, b, h, a):
    """Bytes per site in units of s*b*h for stock megatron-core 0.16 on CPU (local spec,
    RoPE, bias on, unfused bias-dropout-add, softmax in fp32, ffn = 4h); e = element size.

    - layer norms save their input (e) and per-token fp32 mean and rstd (8/h);
    - the QKV, proj, fc1, fc2 linears save their input (e, e, e, 4e);
    - Q and K after RoPE are fresh tensors (e each); V is a view of the fused QKV output and
      keeps that whole buffer alive (3e);
    - attention probabilities (a*s*s*b elements = a*s/h per s*b*h): the fp32 softmax saves
      its output (4); probs @ V saves the probabilities in the model dtype: a bf16 cast
      (2, dropout or not) or, in fp32, the dropped-out probs (4, only with dropout);
    - dropout on CPU saves its scaled keep-mask in the input dtype (e per element), for the
      attention probs and both hidden dropouts;
    - the GELU saves its 4h input (4e);
    - RoPE's cos and sin for Q and for K (4 x s x h/a x e bytes), saved by SelfAttention
      itself, are booked at attn.q; the s x s bool causal mask the torch softmax saves at
      attn.softmax. Nothing is "other".
    """
    e = torch.finfo(dtype).bits // 8
    r = a * s / h
    d = 1.0 if dropout > 0 else 0.0
    probs_copy = e * r if (dtype != torch.float32 or dropout > 0) else 0.0
    return {
        "ln1.input": e + 8 / h,
        "attn.qkv_input": e,
        "attn.q": e + 4 * e / (a * b),
        "attn.k": e,
        "attn.v": 3 * e,
        "attn.softmax": 4 * r + probs_copy + s / (b * h),
        "attn.dropout_mask": d * e * r,
        "attn.out": e,
        "attn.hidden_dropout_mask": d * e,
        "ln2.input": e + 8 / h,
        "mlp.fc1_input": e,
        "mlp.act_input": 4 * e,
        "mlp.fc2_input": 4 * e,
        "mlp.hidden_dropout_mask": d * e,
    }


def run_layer(dtype, dropout, s, b, h, a):
    """Ledger of one stock layer's forward and the bytes the process holds after it."""
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    cfg = T.small_config(hidden_size=h, num_attention_heads=a, dtype=dtype, dropout=dropout,
                         num_layers=1, add_bias_linear=True)
    layer = T.transformer_layer(cfg, layer_number=1)
    rope = RotaryEmbedding(kv_channels=h // a, rotary_percent=1.0, use_cpu_initialization=True)
    emb = rope(s)
    x0 = torch.randn(s, b, h, dtype=dtype, requires_grad=True)

    def forward():
        return layer(x0 * 1, attention_mask=None, rotary_pos_emb=emb)[0]  # input made inside

    forward().float().sum().backward()  # warm-up: megatron's global buffers exist now
    # independent: bytes a forward allocates and keeps (profiler), minus its output; the
    # same draws as the ledger's forward, whatever ran before
    return ledger_and_held(forward, runs=1)


CASES = [
    (torch.bfloat16, 0.0, 64, 2, 256, 8),
    (torch.bfloat16, 0.1, 128, 2, 512, 8),
    (torch.float32, 0.0, 128, 2, 256, 8),
    (torch.float32, 0.1, 64, 2, 512, 8),
]


@pytest.mark.parametrize("dtype,dropout,s,b,h,a", CASES)
def test_stock_layer_sites_match_analysis_and_process_memory(megatron_one_rank, dtype, dropout, s, b, h, a):
    led, held = run_layer(dtype, dropout, s, b, h, a)
    sbh = s * b * h
    want = expected_per_sbh(dtype, dropout, s, b, h, a)
    got = {site: n / sbh for (layer, site), n in led.by_site().items()}
    assert {k for k in led.by_site()} <= {(0, site) for site in SITES}
    for site, per_sbh in want.items():
        assert got.get(site, 0.0) == pytest.approx(per_sbh, rel=1e-9, abs=1e-12), site
    assert led.total_bytes == sum(led.by_site().values())
    assert led.total_bytes / sbh == pytest.approx(sum(want.values()), rel=1e-9)
    # the process holds what the ledger counts (plus a few bytes of scalars): within 1%
    assert held == pytest.approx(led.total_bytes, rel=0.01)


def test_gpt_model_sites_outside_the_blocks(megatron_one_rank):
    cfg = T.small_config(hidden_size=64, num_attention_heads=4, dtype=torch.bfloat16,
                         dropout=0.1, num_layers=2)
    model = T.gpt_model(cfg, vocab_size=128, max_sequence_length=32)
    ids, pos, labels = T.gpt_batch(2, 32, 128)
    with SavedTensorLedger() as led:
        loss = model(ids, pos, None, labels=labels)
        loss.float().sum().backward()  # backward inside: the total is still end-of-forward
    sites = led.by_site()
    sbh = 32 * 2 * 64
    assert {layer for layer, _ in sites} == {None, 0, 1}
    assert sites[(None, "embedding.dropout_mask")] == 2 * sbh
    # the final norm's input + stats: a planned site, of the last layer
    assert sites[(1, "final_norm.input")] == (2 + 8 / 64) * sbh
    # the head: output-layer input, fp32 logits of the loss
    assert sites[(None, "loss.logits")] == 2 * sbh + 4 * 32 * 2 * 128
    assert sites[(0, "mlp.act_input")] == sites[(1, "mlp.act_input")] == 8 * sbh
    assert led.total_bytes == sum(sites.values()) and led.live_bytes() < led.total_bytes
