"""The Hugging Face families on the generic door (issue 45, item 1), on CPU.

Tiny random models of each family (hidden 64, 2 layers, 4 heads, 2 KV heads, vocab 256,
sequence 32; GPT-2 and Qwen2 with dropout, Mistral with a 16-token sliding window, so the
attention gets a mask and `repeat_kv`'s copies), through `generic.apply` without DeepSpeed:
under plans "keep" and "recompute" the loss and every gradient are stock's bit for bit; under
plan "compress" the loss is stock's and each block books its saved tensors at the sites its
family's table and the attention's rules give (q, k and v apart, under SDPA and eager); an
unsupported attn_implementation, a flag that bypasses the attention interface and a
transformers without the interface are refused in one line; MoE and unknown families keep the
generic path with one info line naming the model class. One gloo rank (`dist`) checks the
booking under DeepSpeed ZeRO-3 through `initialize`.
"""
from __future__ import annotations

import logging
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")

from llm_act import sites  # noqa: E402
from llm_act.codecs import make_codec  # noqa: E402
from llm_act.config import ActConfig  # noqa: E402
from llm_act.ledger import SavedTensorLedger  # noqa: E402
from llm_act.patches.deepspeed import generic, hf_attention, hf_decoder, hf_families  # noqa: E402
from llm_act.planner import hf_config  # noqa: E402

SEQ, BATCH = 32, 2
_COMMON = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
               max_position_embeddings=64, bos_token_id=None, eos_token_id=None, pad_token_id=None,
               tie_word_embeddings=False)
_LLAMA_STYLE = dict(intermediate_size=176, num_key_value_heads=2, head_dim=16)
#: model_type -> its config's own keys (beside `_COMMON`)
CONFIGS = {
    "llama": _LLAMA_STYLE,
    "qwen2": {**_LLAMA_STYLE, "attention_dropout": 0.1},
    "qwen3": _LLAMA_STYLE,
    "mistral": {**_LLAMA_STYLE, "sliding_window": 16},
    "gpt2": dict(n_inner=176, resid_pdrop=0.1, attn_pdrop=0.1, embd_pdrop=0.0),
    "mixtral": {**_LLAMA_STYLE, "num_local_experts": 4, "num_experts_per_tok": 2},
    "qwen2_moe": {**_LLAMA_STYLE, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 32},
    "olmo2": _LLAMA_STYLE,  # a dense family without a table
}
FAMILIES = sorted(hf_families.FAMILIES)
IMPLEMENTATIONS = ("sdpa", "eager")


def tiny(kind: str, attn_implementation: str = "sdpa", seed: int = 0, **changes):
    """A randomly initialised `kind` decoder (no download), float32, train mode."""
    cfg = transformers.AutoConfig.for_model(kind, **{**_COMMON, **CONFIGS[kind], **changes},
                                            attn_implementation=attn_implementation)
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(cfg).train()


def _tokens():
    ids = torch.randint(0, 256, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(3))
    return ids[:, :-1], ids[:, 1:]


def _loss_and_grads(model):
    tokens, labels = _tokens()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(11)  # the same dropout masks in both runs
    loss = hf_decoder.lm_loss(model, tokens, labels)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _booked(model, backward=torch.Tensor.backward) -> tuple[torch.Tensor, dict[int, set[str]]]:
    """(loss, {block: the sites holding bytes}) of one forward, then `backward(loss)`."""
    tokens, labels = _tokens()
    torch.manual_seed(11)  # the dropout masks of `_loss_and_grads`
    with SavedTensorLedger() as ledger:
        loss = hf_decoder.lm_loss(model, tokens, labels)
    backward(loss)
    out: dict[int, set[str]] = {}
    for (layer, site), nbytes in ledger.by_site().items():
        if layer is not None and nbytes > 0:
            out.setdefault(layer, set()).add(site)
    return loss.detach(), out


def _family_sites(kind: str, implementation: str) -> set[str]:
    """The sites one block of `kind` books under plan "compress" (the family table and the
    attention's rules, `hf_attention`)."""
    cfg = CONFIGS[kind]
    want = {sites.LN1_INPUT, sites.ATTN_QKV_INPUT, sites.ATTN_Q, sites.ATTN_K, sites.ATTN_V,
            sites.ATTN_OUT, sites.LN2_INPUT, sites.MLP_FC1_INPUT, sites.MLP_ACT_INPUT,
            sites.MLP_FC2_INPUT}
    dropout = cfg.get("attention_dropout", cfg.get("attn_pdrop", 0.0)) > 0
    if implementation == "eager" or dropout:  # on CPU SDPA with dropout runs its math kernel
        want.add(sites.ATTN_SOFTMAX)
    if dropout:
        want.add(sites.ATTN_DROPOUT_MASK)
    if cfg.get("resid_pdrop", 0.0) > 0:
        want |= {sites.ATTN_HIDDEN_DROPOUT_MASK, sites.MLP_HIDDEN_DROPOUT_MASK}
    if kind == "qwen3":
        want |= {sites.ATTN_Q_NORM_INPUT, sites.ATTN_K_NORM_INPUT}
    return want


def _interface(model):
    return vars(sys.modules[type(generic.repeated_blocks(model)[0]).__module__])["ALL_ATTENTION_FUNCTIONS"]


# ---- the tables -----------------------------------------------------------------------------


def test_the_families_are_those_the_planner_reads():
    assert set(hf_families.FAMILIES) == set(hf_config.FAMILIES)


@pytest.mark.parametrize("kind", FAMILIES)
def test_each_table_declares_every_submodule_of_its_block(kind):
    model = tiny(kind)
    block = generic.repeated_blocks(model)[0]
    family = hf_families.FAMILIES[kind]
    assert hf_families.family_of(hf_families.hf_model(model), block) is family
    assert {path for path, _ in block.named_modules() if path} == set(family.sites)
    assert family.attention in family.sites


# ---- plan "keep": stock, bit for bit -------------------------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", FAMILIES)
def test_keep_is_stock_bit_for_bit(kind, implementation):
    stock, patched = tiny(kind, implementation), tiny(kind, implementation)
    handle = generic.apply(patched, ActConfig(plan="keep"))
    assert not any(s.compressing for s in handle.sites)
    want_loss, want = _loss_and_grads(stock)
    got_loss, got = _loss_and_grads(patched)
    assert torch.equal(got_loss, want_loss)
    assert want.keys() == got.keys()
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name


@pytest.mark.parametrize("kind", FAMILIES)
def test_recompute_is_stock_and_swaps_nothing(kind):
    """Plan "recompute": whole blocks re-run in backward with their site hooks off, so the
    attention is never booked (its interface untouched) and the gradients are stock's."""
    stock, patched = tiny(kind), tiny(kind)
    generic.apply(patched, ActConfig(plan="recompute"))
    interface = _interface(patched)
    calls = []
    get_interface = interface.get_interface

    def counting(*args):
        calls.append(args[0])
        return get_interface(*args)

    want_loss, want = _loss_and_grads(stock)
    interface.get_interface = counting  # what a booking swap would replace
    try:
        got_loss, got = _loss_and_grads(patched)
    finally:
        del interface.get_interface
    assert calls == ["sdpa"] * 4  # two blocks, forward and recompute: stock's function each time
    assert torch.equal(got_loss, want_loss)
    for name, grad in want.items():
        assert torch.equal(got[name], grad), name


# ---- plan "compress": every saved tensor at its site ---------------------------------------


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", FAMILIES)
def test_compress_books_each_block_at_its_family_sites(kind, implementation):
    model = tiny(kind, implementation)
    generic.apply(model, ActConfig(plan="compress"))
    loss, booked = _booked(model)
    assert booked == {0: _family_sites(kind, implementation), 1: _family_sites(kind, implementation)}
    # the booked attention is the stock function called with stock's arguments
    assert torch.equal(loss, _loss_and_grads(tiny(kind, implementation))[0])
    assert "get_interface" not in vars(_interface(model))  # the swap ends with the forward


@pytest.mark.parametrize("implementation, kv_shape", [("sdpa", (BATCH, 2, SEQ, 16)),
                                                      ("eager", (BATCH, 4, SEQ, 16))])
def test_k_and_v_are_booked_as_the_kernel_saves_them(implementation, kv_shape):
    """SDPA (no mask, GQA in the kernel) saves the un-expanded K and V, eager `repeat_kv`'s
    copies: attn.k and attn.v each hold one int4_channel record of that shape."""
    model = tiny("llama", implementation)
    generic.apply(model, ActConfig(plan="compress"))
    tokens, labels = _tokens()
    with SavedTensorLedger() as ledger:
        loss = hf_decoder.lm_loss(model, tokens, labels)  # held: the ledger counts what lives
    want = make_codec("int4_channel").nbytes_for(kv_shape, torch.float32)
    table = ledger.by_site()
    assert table[(0, sites.ATTN_K)] == table[(0, sites.ATTN_V)] == want
    loss.backward()


# ---- refusals and the generic path ---------------------------------------------------------


def test_an_unsupported_attn_implementation_is_refused_in_one_line():
    model = tiny("llama", "eager")
    model.config._attn_implementation = "paged|eager"
    with pytest.raises(ValueError) as caught:
        generic.apply(model, ActConfig(plan="compress"))
    msg = str(caught.value)
    assert "\n" not in msg and "LlamaForCausalLM" in msg and "'paged|eager'" in msg
    assert ("supported: eager, sdpa, flash_attention_2, flash_attention_3, flash_attention_4, "
            "flex_attention;") in msg


def test_an_implementation_switched_after_apply_is_refused_at_the_call():
    model = tiny("qwen3")
    generic.apply(model, ActConfig(plan="compress"))
    model.config._attn_implementation = "paged|eager"
    tokens, labels = _tokens()
    with pytest.raises(ValueError, match="'paged\\|eager'"):
        hf_decoder.lm_loss(model, tokens, labels)
    assert "get_interface" not in vars(_interface(model))  # put back, error or not


def test_gpt2_reordered_eager_attention_is_refused():
    with pytest.raises(ValueError, match="reorder_and_upcast_attn=True") as caught:
        generic.apply(tiny("gpt2", "eager", reorder_and_upcast_attn=True), ActConfig(plan="compress"))
    assert "\n" not in str(caught.value) and "GPT2LMHeadModel" in str(caught.value)
    generic.apply(tiny("gpt2", "sdpa", reorder_and_upcast_attn=True), ActConfig(plan="compress"))


def test_a_transformers_without_the_interface_is_refused(monkeypatch):
    model = tiny("llama")
    module = sys.modules[type(generic.repeated_blocks(model)[0].self_attn).__module__]
    monkeypatch.delattr(module, "ALL_ATTENTION_FUNCTIONS")
    with pytest.raises(ValueError, match="llm-act\\[hf\\]") as caught:
        generic.apply(model, ActConfig(plan="compress"))
    assert "\n" not in str(caught.value) and transformers.__version__ in str(caught.value)


@pytest.mark.parametrize("kind, model_class, why", [
    ("mixtral", "MixtralForCausalLM", "mixture of experts"),
    ("qwen2_moe", "Qwen2MoeForCausalLM", "mixture of experts"),
    ("olmo2", "Olmo2ForCausalLM", "no site table"),
])
def test_moe_and_unknown_families_keep_the_generic_path(kind, model_class, why, caplog):
    model = tiny(kind)
    with caplog.at_level(logging.INFO, logger=hf_families.__name__):
        handle = generic.apply(model, ActConfig(plan="compress"))
    lines = [r.getMessage() for r in caplog.records if r.name == hf_families.__name__]
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert model_class in lines[0] and why in lines[0] and "generic path" in lines[0]
    _, booked = _booked(model)  # the generic path: the attention's tensors at attn.q, as before
    assert sites.ATTN_Q in booked[0] and not booked[0] & {sites.ATTN_K, sites.ATTN_V}
    assert handle.controller.enabled


def test_a_plain_torch_model_says_nothing(caplog):
    from tests.patches.deepspeed.test_config import Net

    with caplog.at_level(logging.INFO, logger=hf_families.__name__):
        generic.apply(Net(), ActConfig(plan="compress"))
    assert not [r for r in caplog.records if r.name == hf_families.__name__]
    assert hf_attention.SUPPORTED[:2] == ("eager", "sdpa")


# ---- under DeepSpeed ZeRO-3 ----------------------------------------------------------------


def _zero3_worker(rank, world, port, kind):
    """Stock and plan "compress" through `initialize` under ZeRO-3: the same first loss
    (compression changes only what backward reads), each block booked at its family's sites
    while ZeRO-3 gathers and releases the parameters around every submodule."""
    import os

    import deepspeed

    from llm_act.patches.deepspeed import initialize

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo")
    losses = []
    for section in (None, {"plan": "compress", "adapt": False}):
        model = tiny(kind)
        config = {"train_micro_batch_size_per_gpu": BATCH, "zero_optimization": {"stage": 3},
                  "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                  **({"activation_compression": section} if section else {})}
        engine, *_ = initialize(model=model, model_parameters=model.parameters(), config=config)
        loss, booked = _booked(engine, engine.backward)
        losses.append(loss)
    assert torch.equal(losses[0], losses[1]), losses
    assert booked == {0: _family_sites(kind, "sdpa"), 1: _family_sites(kind, "sdpa")}


@pytest.mark.dist
def test_zero3_books_the_family_sites():
    pytest.importorskip("deepspeed")
    from tests.testing import spawn

    spawn(_zero3_worker, 1, "qwen3", timeout=300)


def test_hugging_face_gradient_checkpointing_is_refused():
    model = tiny("llama")
    model.gradient_checkpointing_enable()
    with pytest.raises(ValueError, match="gradient checkpointing is on"):
        generic.apply(model, ActConfig(plan="compress"))
