"""Converted megatron-core layers against the stock ones, on CPU (TP=1).

Exactness: with every site kept, and with the lossless mask codecs (bitmask, regen) at the
hidden-dropout sites, outputs, gradients and the RNG state after the step are bit-identical
to the stock layer (dropout on, float32 and bfloat16).

Lossy codecs, the bound (flash-attention style): for every gradient tensor (input and
parameters) of the module that stores the site, run in bfloat16,

    err(compressed bf16 vs fp32 stock) <= 2 * err(stock bf16 vs fp32 stock) + 2 * err_pred

where err is the relative L2 error and err_pred is the codec's predicted error propagated
through the module's real backward: the error the same module gets in float32 when the
site is stored through a Gaussian channel whose per-element variance is the codec's
`expected_error` of that tensor (for few-bit codecs, the channel adds that variance to the
exact f'(x)). The factor 2 on err_pred covers one random draw and the non-Gaussian, partly
correlated errors of nearest-rounding codecs.

That bound sees the size of an error, not its kind, so three more (issue 28), each with a
broken-codec companion (`tests.patches.broken_codec`) that fails it:
- few-bit codecs are deterministic: the compressed bf16 MLP's gradients are those of the fp32
  MLP whose f' is the codec's own table, up to bf16 rounding (`FEWBIT_TABLE_FACTOR`);
- stochastic codecs are unbiased: the mean gradient of K draws approaches stock's as
  1/sqrt(K) (`UNBIASED_BOUND`), which rounding that always rounds down does not;
- on inputs with outlier channels outlier_int4 stays within the bound, which it does not when
  it quantizes them with the inliers.
"""
from __future__ import annotations

import math
import warnings

import pytest
import torch

from llm_act.codecs import make_codec
from llm_act.codecs.fewbit import derivative
from llm_act.ledger import SavedTensorLedger
from tests import testing
from tests.patches import broken_codec
from tests.patches.megatron.layer_pairs import (
    GaussianChannel,
    grads,
    input_width,
    rel_errors,
    submodule,
    twin_layers,
)

#: megatron-core on one gloo rank for the whole module (the fixture in tests/conftest.py)
pytestmark = pytest.mark.usefixtures("megatron_one_rank")

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")

S, B, H = 32, 2, 64
LINEAR_NORM_CODECS = ("int8", "int4", "int2", "outlier_int4", "fp8_e4m3", "dual2", "int4_sym")
VALUE_SITES = ("ln1.input", "attn.qkv_input", "attn.out", "mlp.fc1_input", "mlp.fc2_input")
ALL_SITES = VALUE_SITES + ("ln2.input", "mlp.act_input")
DROP_SITES = ("attn.hidden_dropout_mask", "mlp.hidden_dropout_mask")
QK_SITES = ("attn.q_norm_input", "attn.k_norm_input")


def config(dropout=0.0, **kw):
    return testing.small_config(hidden_size=H, num_attention_heads=4, num_layers=1, dropout=dropout, **kw)


def layer_step(layer, x, seed=3):
    """Output, [x.grad, *param grads] and the default RNG state after one step."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    model_parallel_cuda_manual_seed(seed)
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    out, _ = layer(x, attention_mask=None)
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(5)).to(out.dtype)
    out.backward(gy)
    return out, [x.grad] + [p.grad for p in layer.parameters()], torch.default_generator.get_state()


def assert_identical(a, b):
    assert torch.equal(a[0], b[0]), "outputs differ"
    for i, (ga, gb) in enumerate(zip(a[1], b[1])):
        assert torch.equal(ga, gb), f"gradient {i} differs"
    assert torch.equal(a[2], b[2]), "default RNG state differs (different consumption)"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_keep_is_stock_bit_for_bit(dtype):
    stock, act, sites = twin_layers(config(dropout=0.1), dtype)
    assert set(sites) == set(ALL_SITES + DROP_SITES)
    assert stock.state_dict().keys() == act.state_dict().keys()
    x = torch.randn(S, B, H, dtype=dtype)
    assert_identical(layer_step(stock, x), layer_step(act, x))


QK_CONFIGS = [{}, {"normalization": "RMSNorm", "num_query_groups": 2}]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("cfg", QK_CONFIGS)
def test_keep_is_stock_bit_for_bit_with_qk_layernorm(dtype, cfg):
    """qk-layernorm (Qwen3, OLMo 2): the q/k norms are converted (same class swap as ln1/ln2),
    and kept they are stock bit for bit, ledger included."""
    stock, act, sites = twin_layers(config(dropout=0.1, qk_layernorm=True, **cfg), dtype)
    assert set(sites) == set(ALL_SITES + DROP_SITES + QK_SITES)
    norm = "ActRMSNorm" if cfg.get("normalization") == "RMSNorm" else "ActLayerNorm"
    assert type(act.self_attention.q_layernorm).__name__ == type(act.self_attention.k_layernorm).__name__ == norm
    assert stock.state_dict().keys() == act.state_dict().keys()
    x = torch.randn(S, B, H, dtype=dtype)
    with SavedTensorLedger() as stock_ledger:
        ref = layer_step(stock, x)
    with SavedTensorLedger() as ledger:
        got = layer_step(act, x)
    assert_identical(ref, got)
    assert ledger.by_site() == stock_ledger.by_site()
    assert {(0, s) for s in QK_SITES} <= set(ledger.by_site())


@pytest.mark.parametrize("site", QK_SITES)
@pytest.mark.parametrize("cfg", QK_CONFIGS)
def test_lossy_qk_norm_sites(site, cfg):
    """The default codec (outlier_int4) at a per-head norm input, within the bound."""
    errs = site_errors(site, "outlier_int4", config(qk_layernorm=True, **cfg))
    check_bound(errs)
    assert max(errs[0]) > 0  # the codec is really used


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("name", ["bitmask", "regen"])
def test_mask_codecs_are_bit_identical(name, dtype):
    stock, act, sites = twin_layers(config(dropout=0.1), dtype)
    codec = make_codec(name)
    for s in DROP_SITES:
        sites[s].set_act_codec(s, codec)
    x = torch.randn(S, B, H, dtype=dtype)
    ref = layer_step(stock, x)
    with SavedTensorLedger() as ledger:
        got = layer_step(act, x)
    assert_identical(ref, got)
    per_site = ledger.by_site()
    for s in DROP_SITES:
        assert per_site[(0, s)] == codec.nbytes_for((S, B, H), torch.bool)


def test_nothing_encoded_without_grad_or_in_eval():
    stock, act, sites = twin_layers(config(dropout=0.1))
    codec = make_codec("int4", seed=11)
    for s in VALUE_SITES + ("ln2.input",):
        sites[s].set_act_codec(s, codec)
    state = codec.generator(torch.device("cpu")).get_state()
    x = torch.randn(S, B, H)
    with torch.no_grad(), SavedTensorLedger() as ledger:
        act(x, attention_mask=None)
    assert ledger.total_bytes == 0
    act.eval()
    stock.eval()
    with SavedTensorLedger() as ledger:
        act(x.clone().requires_grad_(True), attention_mask=None)
    with SavedTensorLedger() as stock_ledger:
        stock(x.clone().requires_grad_(True), attention_mask=None)
    assert ledger.by_site() == stock_ledger.by_site()  # raw tensors, as stock saves them
    assert torch.equal(codec.generator(torch.device("cpu")).get_state(), state)


# ---- lossy codecs: error bound -------------------------------------------------------------


def _site_input(module_fp32, site, cfg, x32):
    """The tensor stored at `site` when the module runs on x32."""
    if site == "mlp.act_input":
        inter, bias = module_fp32.linear_fc1(x32)
        return inter + bias if bias is not None else inter
    return x32


def site_errors(site, codec_name, cfg, activation="gelu", scale=1.0, broken=False, x=None):
    """(err_compressed, err_bf16, err_pred) per gradient tensor of the site's module;
    `broken`: the compressed run's codec is broken (True: decodes zeros, or a
    `broken_codec.KINDS` name; the prediction keeps the real codec's error model); `x`: the
    module's input (default: `scale` * standard normal)."""
    torch.manual_seed(1)
    s32, a32, sites32 = twin_layers(cfg, torch.float32)
    state = s32.state_dict()
    sb, ab, sitesb = twin_layers(cfg, torch.bfloat16, state=state)
    s32.load_state_dict({k: v.float() if torch.is_tensor(v) else v for k, v in sb.state_dict().items()})
    a32.load_state_dict(s32.state_dict())
    if x is None:
        x = scale * torch.randn(S, B, input_width(cfg, site))
    x = x.bfloat16()
    x32 = x.float()
    codec = make_codec(codec_name, seed=5, activation=activation)
    if broken:
        codec = broken_codec.break_codec(codec, broken_codec.ZEROS if broken is True else broken)
    submodule(ab, site).set_act_codec(site, codec)

    ref = grads(submodule(s32, site), x32)
    stock_b = grads(submodule(sb, site), x)
    comp_b = grads(submodule(ab, site), x)

    stored = _site_input(submodule(s32, site), site, cfg, x32).detach()
    if codec_name.startswith("fewbit"):
        channel = GaussianChannel(codec.expected_error(stored), fn=derivative(codec.activation),
                                  table=codec.table, activation=codec.activation)
    else:
        channel = GaussianChannel(codec.expected_error(stored))
    submodule(a32, site).set_act_codec(site, channel)
    pred = grads(submodule(a32, site), x32)
    return rel_errors(comp_b, ref), rel_errors(stock_b, ref), rel_errors(pred, ref)


def check_bound(errs):
    err_c, err_b, err_p = errs
    for i, (c, b, p) in enumerate(zip(err_c, err_b, err_p)):
        assert math.isfinite(c)
        assert c <= 2 * b + 2 * p + 1e-6, f"gradient {i}: {c:.3g} > 2*{b:.3g} + 2*{p:.3g}"


@pytest.mark.parametrize("codec_name", LINEAR_NORM_CODECS)
@pytest.mark.parametrize("site", VALUE_SITES)
def test_lossy_linear_and_norm_sites(site, codec_name):
    errs = site_errors(site, codec_name, config())
    check_bound(errs)
    assert max(errs[0]) > 0  # the codec is really used


@pytest.mark.parametrize("site,codec_name,cfg", [
    *((s, "outlier_int4", {}) for s in ALL_SITES if s != "mlp.act_input"),
    ("ln2.input", "outlier_int4", {"normalization": "RMSNorm"}),
    ("mlp.act_input", "fewbit3", {}),
    ("mlp.act_input", "outlier_int4", {"gated_linear_unit": True}),
])
def test_bound_fails_with_a_broken_codec(site, codec_name, cfg):
    """The bound is not loose: a codec decoding zeros fails it at every site. Measured (largest
    error / bound over the module's gradients): the real codec 0.50-0.51 at every site here,
    broken 3.3-3.6 (the module's weight gradient off by 1.0, its bound 0.29-0.30). Not
    separable, so not here: int2 at ln2.input of an RMSNorm layer (the real codec's weight
    gradient is off by 0.71 with a bound of 1.34; zeros give 1.0 -- int2's predicted noise
    is as large as the gradient)."""
    import torch.nn.functional as F

    if cfg.get("gated_linear_unit"):
        cfg = {**cfg, "activation_func": F.silu}
    with pytest.raises(AssertionError, match="gradient"):
        check_bound(site_errors(site, codec_name, config(**cfg), broken=True))


@pytest.mark.parametrize("codec_name", ["int4", "outlier_int4", "int2"])
def test_lossy_rmsnorm(codec_name):
    check_bound(site_errors("ln2.input", codec_name, config(normalization="RMSNorm")))


#: few-bit codecs are deterministic: the compressed bf16 MLP must give the gradients of the
#: fp32 MLP whose f' is the codec's own table q, up to bf16 rounding. Measured (err against
#: the table / err of stock bf16, worst gradient): healthy 1.00-2.03 over gelu and silu at
#: 1-4 bits; decoding zeros 308-315; a constant derivative 53-220. Bound: 3x the healthy
#: worst. The predicted bound (`check_bound`) alone cannot separate them: fewbit1's own
#: error (0.75-0.86) is larger than a constant's (0.16-0.25) on this data, and zeros (1.0)
#: stay under its 2x factor (1.59 / 1.75).
FEWBIT_TABLE_FACTOR = 6.0


def fewbit_table_errors(act, bits, broken=False):
    """(err of the compressed bf16 MLP against the fp32 MLP with f' := the codec's table,
    err of stock bf16 against stock fp32) per gradient; `broken` as in `site_errors`."""
    import torch.nn.functional as F

    cfg = config(activation_func=getattr(F, act))
    torch.manual_seed(1)
    s32, a32, _ = twin_layers(cfg, torch.float32)
    sb, ab, _ = twin_layers(cfg, torch.bfloat16, state=s32.state_dict())
    s32.load_state_dict({k: v.float() if torch.is_tensor(v) else v for k, v in sb.state_dict().items()})
    a32.load_state_dict(s32.state_dict())
    x = torch.randn(S, B, H).bfloat16()
    codec = make_codec(f"fewbit{bits}", seed=5, activation=act)
    if broken:
        codec = broken_codec.break_codec(codec, broken_codec.ZEROS if broken is True else broken)
    ab.mlp.set_act_codec("mlp.act_input", codec)
    table = make_codec(f"fewbit{bits}", seed=5, activation=act).table
    a32.mlp.set_act_codec("mlp.act_input", GaussianChannel(0.0, fn=table.lookup, table=table,
                                                           activation=act))
    comp, by_table = grads(ab.mlp, x), grads(a32.mlp, x.float())
    stock_b, ref = grads(sb.mlp, x), grads(s32.mlp, x.float())
    return rel_errors(comp, by_table), rel_errors(stock_b, ref)


def check_table_bound(errs):
    err_t, err_b = errs
    for i, (t, b) in enumerate(zip(err_t, err_b)):
        assert t <= FEWBIT_TABLE_FACTOR * b + 1e-6, (
            f"gradient {i}: {t:.3g} from the table's gradient > {FEWBIT_TABLE_FACTOR}*{b:.3g}")


@pytest.mark.parametrize("bits", [1, 2, 3, 4])
@pytest.mark.parametrize("act", ["gelu", "silu"])
def test_fewbit_activation(act, bits):
    import torch.nn.functional as F

    cfg = config(activation_func=getattr(F, act))
    errs = site_errors("mlp.act_input", f"fewbit{bits}", cfg, activation=act)
    check_bound(errs)
    assert max(errs[0]) > 0
    check_table_bound(fewbit_table_errors(act, bits))


@pytest.mark.parametrize("act,bits,kind", [
    ("gelu", 1, "zeros"), ("silu", 1, "zeros"),  # passed the predicted bound (issue 28)
    ("gelu", 3, "constant_derivative"),  # passed it too: 0.248 against 0.294
    ("silu", 3, "constant_derivative"), ("gelu", 1, "constant_derivative"),
    ("silu", 4, "constant_derivative"),
])
def test_fewbit_bound_fails_with_a_broken_codec(act, bits, kind):
    with pytest.raises(AssertionError, match="table"):
        check_table_bound(fewbit_table_errors(act, bits, broken=kind))


# ---- stochastic rounding is unbiased through the layer ---------------------------------------

#: draws averaged: an unbiased codec's gradient error falls as 1/sqrt(K), a biased one's not
UNBIASED_DRAWS = 32
#: bound on sqrt(K) * err(mean of K gradients) / mean of the K single errors, per gradient
#: (fp32, so bf16 rounding adds no bias of its own). Measured over the value sites and ln2.input
#: with int8, int4, int2, outlier_int4 and dual2: healthy 0.95-1.30; stochastic rounding
#: that always rounds down sqrt(32) = 5.66 everywhere (one draw's error is only sqrt(2)
#: times healthy rounding's, inside the one-draw bound above: it passed every test here).
#: Bound: 3x the healthy worst.
UNBIASED_BOUND = 3.9


def unbiased_ratios(site, codec_name, kind=None):
    """sqrt(K) * err(mean gradient over K draws) / mean single-draw err, per gradient of the
    site's module in fp32 (0 where the gradient does not read the stored tensor)."""
    cfg = config()
    torch.manual_seed(1)
    stock, act, _ = twin_layers(cfg, torch.float32)
    x = torch.randn(S, B, input_width(cfg, site))
    codec = make_codec(codec_name, seed=5)
    if kind:
        broken_codec.break_codec(codec, kind)
    submodule(act, site).set_act_codec(site, codec)
    ref = grads(submodule(stock, site), x)
    draws = [grads(submodule(act, site), x) for _ in range(UNBIASED_DRAWS)]
    mean = [sum(d[i].double() for d in draws) / UNBIASED_DRAWS for i in range(len(ref))]
    single = [sum(e) / UNBIASED_DRAWS for e in zip(*(rel_errors(d, ref) for d in draws))]
    return [a * math.sqrt(UNBIASED_DRAWS) / s if s > 1e-9 else 0.0
            for a, s in zip(rel_errors(mean, ref), single)]


def check_unbiased(ratios):
    assert max(ratios) > 0  # the codec is really used
    for i, r in enumerate(ratios):
        assert r <= UNBIASED_BOUND, (
            f"gradient {i}: the mean of {UNBIASED_DRAWS} draws is biased: sqrt(K)*err(mean)/err "
            f"{r:.2f} > {UNBIASED_BOUND}")


#: the default codec at a norm input and at two linear inputs, and each other stochastic family
UNBIASED_CASES = [("ln1.input", "outlier_int4"), ("attn.qkv_input", "outlier_int4"),
                  ("mlp.fc2_input", "outlier_int4"), ("attn.out", "int4"), ("mlp.fc1_input", "int4"),
                  ("ln1.input", "int8"), ("mlp.fc2_input", "int2"), ("ln2.input", "dual2")]


@pytest.mark.parametrize("site,codec_name", UNBIASED_CASES)
def test_stochastic_codecs_are_unbiased_through_the_layer(site, codec_name):
    check_unbiased(unbiased_ratios(site, codec_name))


@pytest.mark.parametrize("site,codec_name", [("ln1.input", "outlier_int4"), ("mlp.fc1_input", "int4"),
                                             ("ln2.input", "dual2"), ("attn.out", "int8")])
def test_unbiasedness_fails_with_biased_rounding(site, codec_name):
    with pytest.raises(AssertionError, match="biased"):
        check_unbiased(unbiased_ratios(site, codec_name, broken_codec.ROUND_DOWN))


# ---- outlier channels ------------------------------------------------------------------------


def outlier_input(site, scale=30.0):
    """A standard normal input whose channels at outlier_int4's slot count (1/64 of the width,
    spread out) are `scale` times larger: the outliers of LLM activations."""
    width = input_width(config(), site)
    x = torch.randn(S, B, width, generator=torch.Generator().manual_seed(2))
    n = make_codec("outlier_int4").max_outliers(width)
    for j in range(n):
        x[..., 7 + j * (width // n)] *= scale
    return x


OUTLIER_SITES = VALUE_SITES + ("ln2.input",)


@pytest.mark.parametrize("site", OUTLIER_SITES)
def test_outlier_channels_within_the_bound(site):
    """Measured (largest error / bound): 0.45-0.50 at every site."""
    errs = site_errors(site, "outlier_int4", config(), x=outlier_input(site))
    check_bound(errs)
    assert max(errs[0]) > 0


@pytest.mark.parametrize("site", OUTLIER_SITES)
def test_bound_fails_when_outliers_are_dropped(site):
    """outlier_int4 quantizing its outlier channels with the inliers (the prediction keeps the
    real codec's): 1.39 (norm inputs) to 4.42 (mlp.fc2_input) of the bound."""
    with pytest.raises(AssertionError, match="gradient"):
        check_bound(site_errors(site, "outlier_int4", config(), x=outlier_input(site),
                                broken=broken_codec.DROP_OUTLIERS))


@pytest.mark.parametrize("codec_name", ["outlier_int4", "int8", "fp8_e4m3"])
def test_swiglu_value_codec(codec_name):
    import torch.nn.functional as F

    cfg = config(activation_func=F.silu, gated_linear_unit=True)
    check_bound(site_errors("mlp.act_input", codec_name, cfg))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_relu_mask_is_exact_and_one_bit(dtype):
    import torch.nn.functional as F

    stock, act, sites = twin_layers(config(activation_func=F.relu), dtype)
    # the one rule (`registry.refusal`): a ReLU MLP keeps its mask, a few-bit table is refused
    with pytest.raises(ValueError, match="ReLU MLP"):
        sites["mlp.act_input"].set_act_codec("mlp.act_input", make_codec("fewbit1", activation="relu"))
    sites["mlp.act_input"].set_act_codec("mlp.act_input", make_codec("outlier_int4"))
    x = torch.randn(S, B, H, dtype=dtype)
    ref = grads(stock.mlp, x)
    with SavedTensorLedger() as ledger:
        got = grads(act.mlp, x)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
    assert ledger.by_site()[(0, "mlp.act_input")] == math.ceil(S * B * 4 * H / 8)


def test_fewbit_codec_must_match_the_activation():
    import torch.nn.functional as F

    _, _, sites = twin_layers(config(activation_func=F.silu))
    with pytest.raises(ValueError, match="activation='silu'"):
        sites["mlp.act_input"].set_act_codec("mlp.act_input", make_codec("fewbit3", activation="gelu"))
    _, _, sites = twin_layers(config(activation_func=F.silu, gated_linear_unit=True))
    with pytest.raises(ValueError, match="value codec"):
        sites["mlp.act_input"].set_act_codec("mlp.act_input", make_codec("fewbit3", activation="silu"))
    with pytest.raises(ValueError, match="stores sites"):
        sites["attn.out"].set_act_codec("mlp.fc1_input", None)


# ---- NaN and the ledger ----------------------------------------------------------------------


@pytest.mark.parametrize("site,codec_name", [
    ("attn.qkv_input", "int4"), ("mlp.fc2_input", "outlier_int4"), ("ln1.input", "dual2"),
    ("ln2.input", "fp8_e4m3"), ("mlp.act_input", "fewbit3"),
])
def test_nan_input_gives_nan_grads_like_stock(site, codec_name):
    cfg = config()
    stock, act, sites = twin_layers(cfg)
    sites[site].set_act_codec(site, make_codec(codec_name))
    x = torch.randn(S, B, input_width(cfg, site))
    x[3, 1, 5] = float("nan")
    ref, got = grads(submodule(stock, site), x), grads(submodule(act, site), x)
    assert any(torch.isnan(g).any() for g in ref)
    for a, b in zip(ref, got):
        assert torch.equal(torch.isnan(a), torch.isnan(b))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("site", ALL_SITES)
def test_ledger_counts_the_codec_bytes(site, dtype):
    cfg = config()
    _, act, sites = twin_layers(cfg, dtype)
    name = "fewbit2" if site == "mlp.act_input" else "outlier_int4"
    codec = make_codec(name)
    sites[site].set_act_codec(site, codec)
    module = submodule(act, site)
    x = torch.randn(S, B, input_width(cfg, site), dtype=dtype)
    stored = _site_input(module, site, cfg, x).detach()
    expected = make_codec(name).encode(stored).nbytes
    if site.startswith("ln"):
        stat_dtype = torch.float32 if dtype == torch.float32 else torch.bfloat16
        expected += 2 * S * B * torch.finfo(stat_dtype).bits // 8  # exact mean and rstd
    with SavedTensorLedger() as ledger:
        grads(module, x)
    assert ledger.by_site()[(0, site)] == expected


def test_sequence_parallel_linear_compresses_the_local_shard():
    """SP linears take `sp.EncodedSPLinear` (tested at TP=2 in test_sp.py); at TP=1 the
    gather is the identity, so a lossless codec gives the plain path's gradients."""
    from llm_act.patches.megatron.linear import ActColumnParallelLinear

    _, act, sites = twin_layers(config())
    lin = sites["attn.qkv_input"]
    assert isinstance(lin, ActColumnParallelLinear)
    x = torch.randn(S, B, H)
    ref = grads(lin, x)
    lin.sequence_parallel = True
    from llm_act.patches.megatron.recompute_codec import VisibleKeep

    lin.set_act_codec("attn.qkv_input", VisibleKeep())
    got = grads(lin, x)
    assert all(torch.equal(a, b) for a, b in zip(ref, got))
