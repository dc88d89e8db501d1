"""Small GPT runs shared by the apply / controller tests: build a seeded model, run one
forward/backward with fixed RNG streams, and return the loss, the gradients and the ledger."""
from __future__ import annotations

import torch

from llm_act.ledger import SavedTensorLedger
from tests import testing as T
from tests.patches.broken_codec import check_gradients, param_errors  # noqa: F401
from tests.rel_error import rel_error  # noqa: F401

VOCAB, SEQ, BATCH = 128, 32, 2


def seed_all(seed: int) -> None:
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)


def build(dtype=torch.float32, dropout=0.1, num_layers=2, spec=None, seed=0, **overrides):
    """A GPTModel with the same initial weights for the same arguments."""
    seed_all(seed)
    cfg = T.small_config(dtype=dtype, dropout=dropout, num_layers=num_layers, **overrides)
    return T.gpt_model(cfg, vocab_size=VOCAB, max_sequence_length=SEQ, spec=spec)


def batch(seed: int = 1, batch_size: int = BATCH):
    return T.gpt_batch(batch_size, SEQ, VOCAB, generator=torch.Generator().manual_seed(seed))


def step(model, seed: int = 5, data_seed: int = 1, ledger: bool = False):
    """(loss, {name: grad}, ledger or None) of one forward/backward; the RNG streams
    (default generator and megatron's tracker) are reset to `seed` first, so two models
    with equal weights draw equal dropout masks."""
    seed_all(seed)
    ids, pos, labels = batch(data_seed)
    led = SavedTensorLedger() if ledger else None
    if led is not None:
        with led:
            out = model(ids, pos, None, labels=labels)
    else:
        out = model(ids, pos, None, labels=labels)
    loss = out.float().mean()
    loss.backward()
    grads = {n: p.main_grad.clone() if getattr(p, "main_grad", None) is not None else p.grad.clone()
             for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, led


def assert_same(grads_a, grads_b):
    assert grads_a.keys() == grads_b.keys()
    for name in grads_a:
        assert torch.equal(grads_a[name], grads_b[name]), f"gradient of {name} differs"
