"""Never more than stock (issue 14): a codec is used at a site only where it stores no
more bytes than the raw tensor, on both paths, and otherwise the tensor is kept.

- megatron path (a small megatron-core GPT, CPU): every registry codec at every site it
  is allowed at (`check_choice`), fp32 and bf16 with dropout on: the ledger's bytes at
  each (layer, site) are at most stock's there;
- generic path (a Hugging Face Llama decoder through `generic.apply`): every codec the
  generic blocks take, at every generic site, fp32 and bf16: at most the raw bytes of the
  tensors the site saves (measured by the same hooks with every codec declined, which
  keeps each saved tensor raw at its site: stock's bytes, as the total check shows);
- where a codec cannot win (a dropout mask smaller than the CPU generator state `regen`
  stores, a 1-D tensor under a per-channel codec, DIVISION pooling over a batch of 2) the
  tensor is kept and the ledger books its raw bytes at the site;
- the fixed compress plan on an HF Llama decoder stores at most 0.30 of stock per block.
"""
from __future__ import annotations

import warnings

import pytest
import torch

from llm_act import ActConfig
from llm_act.codecs import base as codec_base
from llm_act.codecs.base import side_list_nbytes
from llm_act.codecs.registry import CODEC_NAMES, FEWBIT_CODECS, MASK_CODECS, check_choice
from llm_act.ledger import SavedTensorLedger
from llm_act.sites import SITES
from tests import testing as T

warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", category=FutureWarning)

DTYPES = [torch.float32, torch.bfloat16]


def allowed_sites(codec: str, sites=SITES) -> list[str]:
    out = []
    for site in sites:
        try:
            check_choice(site, codec)
        except ValueError:
            continue
        out.append(site)
    return out


def _over(got: dict, ref: dict, sites, layers) -> list:
    return [(layer, site, got.get((layer, site), 0), ref.get((layer, site), 0))
            for layer in layers for site in sites
            if got.get((layer, site), 0) > ref.get((layer, site), 0)]


# ---- the megatron path ---------------------------------------------------------------------


def _megatron_bytes(dtype, codecs: dict, seq: int = 32, batch: int = 2, **overrides):
    from llm_act.patches.megatron import apply
    from tests import gpt_runs as R

    model = R.build(dtype, dropout=0.1, num_layers=2, **overrides)
    apply(model, ActConfig(plan="keep", codecs=codecs))
    R.seed_all(5)
    ids, pos, labels = T.gpt_batch(batch, seq, R.VOCAB, generator=torch.Generator().manual_seed(1))
    with SavedTensorLedger() as led:
        out = model(ids, pos, None, labels=labels)
    table = led.by_site()
    out.float().mean().backward()
    return table, model


@pytest.mark.usefixtures("megatron_one_rank")
@pytest.mark.parametrize("dtype", DTYPES)
def test_megatron_every_codec_at_every_allowed_site(dtype):
    stock, _ = _megatron_bytes(dtype, {})
    bad = []
    for codec in CODEC_NAMES:
        sites = allowed_sites(codec)
        got, _ = _megatron_bytes(dtype, {s: codec for s in sites})
        bad += [(codec, *row) for row in _over(got, stock, sites, (0, 1))]
    assert not bad, bad


@pytest.mark.usefixtures("megatron_one_rank")
def test_megatron_keeps_a_mask_the_codec_cannot_shrink():
    """regen stores the generator state (5056 bytes for the CPU mt19937): a hidden-dropout
    mask of 4 x 1 x 64 elements is kept as stock keeps it (fp32 noise, 1024 bytes)."""
    if torch.cuda.is_available():
        pytest.skip("the CUDA generator state (16 bytes) always wins")
    sites = ("attn.hidden_dropout_mask", "mlp.hidden_dropout_mask")
    stock, _ = _megatron_bytes(torch.float32, {}, seq=4, batch=1)
    got, model = _megatron_bytes(torch.float32, {s: "regen" for s in sites}, seq=4, batch=1)
    for layer in (0, 1):
        for site in sites:
            assert got[(layer, site)] == stock[(layer, site)] == 4 * 64 * 4
    layer = model.decoder.layers[0]
    assert layer.self_attn_bda.act_kept == {"attn.hidden_dropout_mask": 1}
    assert layer.mlp_bda.act_kept == {"mlp.hidden_dropout_mask": 1}
    # at the usual size the same codec wins (32 x 2 x 64 fp32 noise is 16 KiB)
    got, model = _megatron_bytes(torch.float32, {s: "regen" for s in sites})
    assert got[(0, "mlp.hidden_dropout_mask")] < 5100
    assert not getattr(model.decoder.layers[0].mlp_bda, "act_kept", {})


# ---- the generic (Hugging Face) path ---------------------------------------------------------


GENERIC_CODECS = [c for c in CODEC_NAMES if c not in FEWBIT_CODECS and c not in MASK_CODECS]


def _hf_bytes(dtype, plan: str, codecs: dict | None = None, num_layers: int = 2):
    from llm_act.patches.deepspeed import generic, hf_decoder

    model = hf_decoder.build("llama", num_layers=num_layers).to(dtype)
    handle = None
    if plan != "stock":
        handle = generic.apply(model, ActConfig(plan=plan, codecs=codecs or {}))
    tokens = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with SavedTensorLedger() as led:
        logits = model(input_ids=tokens, use_cache=False).logits
    table = led.by_site()
    logits.float().mean().backward()
    return table, handle


@pytest.fixture(scope="module")
def hf_raw():
    """Per (layer, site) raw bytes of the HF Llama: every codec declined, so the hooks keep
    each saved tensor at its site; and stock's total."""
    from llm_act.patches.deepspeed import generic

    out = {}
    mp = pytest.MonkeyPatch()
    try:
        mp.setattr(codec_base.Codec, "within_raw", lambda self, shape, dtype: False)
        for dtype in DTYPES:
            sites = generic.generic_sites()
            table, _ = _hf_bytes(dtype, "keep", {s: "int8" for s in sites})
            out[dtype] = table
    finally:
        mp.undo()
    return out


@pytest.mark.parametrize("dtype", DTYPES)
def test_generic_raw_reference_is_stock(dtype, hf_raw):
    stock, _ = _hf_bytes(dtype, "stock")
    assert sum(hf_raw[dtype].values()) == sum(stock.values())


@pytest.mark.parametrize("dtype", DTYPES)
def test_generic_every_codec_at_every_allowed_site(dtype, hf_raw):
    from llm_act.patches.deepspeed import generic

    ref = hf_raw[dtype]
    bad, declined = [], {}
    for codec in GENERIC_CODECS:
        sites = allowed_sites(codec, generic.generic_sites())
        got, handle = _hf_bytes(dtype, "keep", {s: codec for s in sites})
        bad += [(codec, *row) for row in _over(got, ref, sites, (0, 1))]
        assert sum(got.values()) <= sum(ref.values()), codec
        declined[codec] = sum(handle.declined().values())
    assert not bad, bad
    # DIVISION pools 8 tokens along dim 0, the batch (2) here: it cannot win in bf16
    if dtype == torch.bfloat16:
        assert declined["dual2"] > 0
    assert declined["int4"] == declined["outlier_int4"] == 0


def test_generic_keeps_what_a_per_channel_codec_cannot_shrink():
    """A 1-D saved tensor under int4_channel would take one fp32 scale per element."""
    from llm_act.generic.hooks import compress_saved_tensors

    x = torch.randn(4096, requires_grad=True)
    with SavedTensorLedger() as led:
        with compress_saved_tensors(None, "int4_channel", site="attn.q", layer=0) as hooks:
            y = (x * x).sum()
        table = led.by_site()
    assert hooks.stats.declined == 1 and hooks.stats.encoded == 0  # x saved twice, kept once
    assert table[(0, "attn.q")] == 4096 * 4
    y.backward()
    torch.testing.assert_close(x.grad, 2 * x.detach())


def test_generic_encodes_logical_shapes():
    """A transposed [b, h, s, d] K is encoded in its dims (int4_channel: d scales), not as a
    flat buffer (one scale per element, 2.25x the raw bytes in bf16)."""
    from llm_act.generic.hooks import compress_saved_tensors

    k = torch.randn(2, 64, 4, 16, dtype=torch.bfloat16).transpose(1, 2).requires_grad_(True)
    with compress_saved_tensors(None, "int4_channel") as hooks:
        kc = k.clone()  # keeps the transposed strides
        assert not kc.is_contiguous()
        y = (kc * kc).float().sum()
    assert hooks.stats.encoded == 1 and hooks.stats.reused == 1
    # codes + one scale per d per 256 rows (512 rows of d: 2 chunks) + the side list
    assert hooks.stats.encoded_bytes == (k.numel() // 2 + 4 * 16 * 2
                                         + side_list_nbytes(k.numel(), k.dtype))
    y.backward()
    torch.testing.assert_close(k.grad.float(), 2 * k.detach().float(), atol=0.5, rtol=0.3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_hf_llama_compress_plan_at_most_030_of_stock(dtype):
    """Per block: (2 layers - 1 layer), so embedding, final norm and logits cancel out."""
    stock = {n: sum(_hf_bytes(dtype, "stock", num_layers=n)[0].values()) for n in (1, 2)}
    comp = {n: sum(_hf_bytes(dtype, "compress", num_layers=n)[0].values()) for n in (1, 2)}
    ratio = (comp[2] - comp[1]) / (stock[2] - stock[1])
    print(f"\nHF Llama block, compress / stock ({dtype}): {ratio:.3f}")
    assert ratio <= 0.30
