"""`use_chunked_loss` on a tiny megatron-core GPTModel (CPU shim): stock's loss and gradients,
no [tokens, vocab] tensor, stock behaviour without labels.

Tolerances: up to the output layer both models run the same code, so fp32 agrees within
1e-5 (loss, absolute; gradients, relative L2; measured ~1e-7). In bf16 the chunked logits
GEMM may round differently from the full one (other blocking), and the weight gradient is
summed over chunks in fp32 rather than in one bf16 GEMM: loss within 2e-2 absolute, gradients
within 2e-2 relative L2 (a few bf16 ulps; measured: the loss equal, gradients ~3e-3).
"""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from tests import testing as T  # noqa: E402
from tests.output.test_chunked_loss import _MaxNumel  # noqa: E402
from tests.rel_error import rel_error  # noqa: E402

VOCAB, SEQ, BATCH, HIDDEN = 256, 32, 2, 32
TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _pair(dtype, tied, chunk=8):
    from llm_act.patches.megatron.output import use_chunked_loss

    cfg = T.small_config(hidden_size=HIDDEN, num_attention_heads=4, num_layers=1, dtype=dtype)
    kw = dict(vocab_size=VOCAB, max_sequence_length=SEQ, share_embeddings_and_output_weights=tied)
    stock = T.gpt_model(cfg, **kw)
    chunked = T.gpt_model(cfg, **kw)
    chunked.load_state_dict(stock.state_dict())
    return stock, use_chunked_loss(chunked, chunk_tokens=chunk)


def _step(model, batch, labels=True):
    ids, pos, y = batch
    model.zero_grad(set_to_none=True)
    out = model(ids, pos, None, labels=y if labels else None)
    grad = torch.rand(out.shape, generator=torch.Generator().manual_seed(3)).to(out.dtype)
    out.backward(grad)
    return out.detach(), {n: p.grad for n, p in model.named_parameters()}


def _batch():
    return T.gpt_batch(BATCH, SEQ, VOCAB, generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("tied", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_loss_and_grads_match_stock(dtype, tied, megatron_one_rank):
    stock, chunked = _pair(dtype, tied)
    ref_loss, ref_grads = _step(stock, _batch())
    loss, grads = _step(chunked, _batch())
    assert loss.shape == ref_loss.shape == (BATCH, SEQ) and loss.dtype == ref_loss.dtype == torch.float32
    assert float((loss - ref_loss).abs().max()) < TOL[dtype]
    assert grads.keys() == ref_grads.keys()
    assert ("output_layer.weight" in grads) is not tied  # tied: the embedding weight gets both
    for name, ref in ref_grads.items():
        assert grads[name].dtype == ref.dtype and rel_error(grads[name], ref) < TOL[dtype], name


def test_no_labels_is_stock(megatron_one_rank):
    stock, chunked = _pair(torch.float32, tied=False)
    ref_logits, ref_grads = _step(stock, _batch(), labels=False)
    logits, grads = _step(chunked, _batch(), labels=False)
    assert logits.shape == (BATCH, SEQ, VOCAB) and torch.equal(logits, ref_logits)
    assert all(torch.equal(grads[n], g) for n, g in ref_grads.items())


def test_never_materialises_the_logits(megatron_one_rank):
    tokens = SEQ * BATCH
    stock, chunked = _pair(torch.float32, tied=True)
    with _MaxNumel() as mode:
        _step(chunked, _batch())
    assert mode.largest < tokens * VOCAB, mode.largest
    with _MaxNumel() as mode:  # the probe sees stock's logits
        _step(stock, _batch())
    assert mode.largest >= tokens * VOCAB


def test_rechunks_and_refuses_what_it_cannot_serve(megatron_one_rank):
    from llm_act.patches.megatron.output import chunked_loss_tokens, use_chunked_loss

    stock, chunked = _pair(torch.float32, tied=False)
    assert chunked_loss_tokens(stock) is None and chunked_loss_tokens(chunked) == 8
    use_chunked_loss(chunked, chunk_tokens=5)
    assert chunked_loss_tokens(chunked) == 5
    with pytest.raises(ValueError, match="chunk_tokens"):
        use_chunked_loss(chunked, chunk_tokens=0)
    with pytest.raises(TypeError, match="GPTModel"):
        use_chunked_loss(torch.nn.Linear(2, 2))
    stock.config.defer_embedding_wgrad_compute = True
    with pytest.raises(NotImplementedError, match="defer_embedding_wgrad_compute"):
        use_chunked_loss(stock)
    stock.config.defer_embedding_wgrad_compute = False
    stock._postprocess = stock._postprocess  # someone else's instance patch
    with pytest.raises(RuntimeError, match="someone else"):
        use_chunked_loss(stock)


def _tp_worker(rank, world_size, port, expected_loss):
    import warnings

    warnings.filterwarnings("ignore")
    from llm_act import ActConfig
    from llm_act.patches.megatron import block_spec
    from llm_act.patches.megatron.output import use_chunked_loss

    T.init_parallel(tp=world_size, rank=rank, world_size=world_size, port=port, seed=1234)
    for sequence_parallel in (False, True):
        torch.manual_seed(0)
        sp = dict(sequence_parallel=True, tensor_model_parallel_size=world_size) if sequence_parallel else {}
        cfg = T.small_config(hidden_size=HIDDEN, num_attention_heads=4, num_layers=1, **sp)
        # megatron's torch norms refuse sequence parallelism; our spec's keep the stock numbers
        spec = block_spec(ActConfig(), cfg) if sequence_parallel else None
        stock = T.gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, spec=spec)
        chunked = T.gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, spec=spec)
        chunked.load_state_dict(stock.state_dict())
        use_chunked_loss(chunked, chunk_tokens=8)
        ref_loss, ref_grads = _step(stock, _batch())
        loss, grads = _step(chunked, _batch())
        where = (rank, sequence_parallel)
        assert float((loss - expected_loss).abs().max()) < 1e-4, where
        assert float((loss - ref_loss).abs().max()) < 1e-5, where
        for name, ref in ref_grads.items():
            assert rel_error(grads[name], ref) < 1e-5, (where, name)


@pytest.mark.dist
def test_tp2_matches_stock_tp2_and_tp1(megatron_one_rank):
    """Vocab-parallel, then also sequence-parallel: the chunked loss equals stock's under the
    same parallelism, and the one-rank loss."""
    torch.manual_seed(0)
    cfg = T.small_config(hidden_size=HIDDEN, num_attention_heads=4, num_layers=1)
    stock = T.gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=SEQ)
    loss, _ = _step(stock, _batch())
    T.spawn(_tp_worker, 2, loss, timeout=120)
