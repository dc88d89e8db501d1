"""No host syncs in the layers' forward and backward (issue 26, item 2), on the torch
references: a `TorchDispatchMode` that fails on every op that needs a device value on the
host (`.item()` / `bool(tensor)` / `int(tensor)` are `_local_scalar_dense`; `nonzero`,
`masked_select`, `unique` have data-dependent shapes; `repeat_interleave` without
`output_size` reads its repeats). On a CPU these cost nothing, on a GPU each stalls the
stream, so a CPU run that never asks for one proves the GPU run will not either.

Covered: plans "keep", "recompute", "compress", and fixed plans with every codec family at its sites,
attention dropout on (regenerated masks); on the torch references and on the Triton kernels
(under the interpreter); every codec alone: tests/kernels/test_sync_free_triton.py.
Not yet here: sequence parallel (its gather exchanges no sizes since issue 26, but it needs
two ranks), MoE routing (token counts per expert on the host, as megatron-core's own
SequentialMLP); issue 26 keeps them open.
"""
from __future__ import annotations

import pytest
import torch

from llm_act import ActConfig
from llm_act.patches.megatron import apply
from tests.no_syncs import NoSyncs
from tests import gpt_runs as R

pytestmark = pytest.mark.usefixtures("megatron_one_rank")

EVERY_SITE_INT = {"ln1.input": "int4", "attn.qkv_input": "int8", "attn.q": "int4_channel",
                  "attn.k": "int4_sym", "attn.v": "fp8_e4m3", "attn.out": "int2",
                  "ln2.input": "fp8_e5m2", "mlp.fc1_input": "int4_asym", "mlp.act_input": "fewbit3",
                  "mlp.fc2_input": "dual2", "attn.dropout_mask": "regen",
                  "attn.hidden_dropout_mask": "bitmask", "mlp.hidden_dropout_mask": "regen"}
SOFTMAX_AND_MASK = {"attn.q": "int8", "attn.softmax": "int4_asym", "attn.dropout_mask": "bitmask"}

PLANS = {
    "keep": ActConfig(plan="keep", adapt=False),
    "compress": ActConfig(plan="compress", adapt=False),
    "recompute": ActConfig(plan="recompute", adapt=False),
    "every codec family": ActConfig(plan="compress", codecs=EVERY_SITE_INT, adapt=False),
    "unfused softmax, bitmask": ActConfig(plan="compress", codecs=SOFTMAX_AND_MASK,
                                          attention="stock", adapt=False),
}


def _step_without_syncs(model) -> None:
    ids, pos, labels = R.batch(1)
    with NoSyncs():
        out = model(ids, pos, None, labels=labels)
        out.float().mean().backward()


def test_the_detector_sees_a_sync():
    with pytest.raises(AssertionError, match="_local_scalar_dense"):
        with NoSyncs():
            torch.ones(3).sum().item()
    with pytest.raises(AssertionError, match="nonzero"):
        with NoSyncs():
            torch.nonzero(torch.ones(3))


@pytest.mark.parametrize("plan", list(PLANS))
def test_layers_forward_and_backward_issue_no_host_sync(plan):
    model = R.build(dropout=0.1)
    apply(model, PLANS[plan])
    R.seed_all(5)
    _step_without_syncs(model)  # the first step builds the codecs' generators
    _step_without_syncs(model)


@pytest.mark.parametrize("plan", ["compress", "every codec family"])
def test_layers_issue_no_host_sync_on_the_triton_path(plan, monkeypatch):
    """The same step with every codec on its Triton kernels (the interpreter on CPU, as a GPU
    would run them): one-pass encodes with the side list inside the kernels."""
    pytest.importorskip("triton")
    from tests.no_syncs import force_triton

    force_triton(monkeypatch)
    model = R.build(dropout=0.1)
    apply(model, PLANS[plan])
    R.seed_all(5)
    _step_without_syncs(model)  # the first step makes the codecs' states
    _step_without_syncs(model)


def test_nonfinite_activations_are_kept_without_a_sync():
    """A NaN in the block input reaches the gradients (NaN stays NaN), with no sync."""
    model = R.build(dropout=0.0)
    apply(model, PLANS["every codec family"])
    ids, pos, labels = R.batch(1)
    emb = model.embedding.word_embeddings.weight
    with torch.no_grad():
        emb[ids[0, 0]] = float("nan")
    with NoSyncs():
        out = model(ids, pos, None, labels=labels)
        out.float().mean().backward()
    assert torch.isnan(model.decoder.layers[0].mlp.linear_fc1.weight.main_grad
                       if getattr(model.decoder.layers[0].mlp.linear_fc1.weight, "main_grad", None) is not None
                       else model.decoder.layers[0].mlp.linear_fc1.weight.grad).any()


@pytest.mark.gpu
@pytest.mark.parametrize("plan", ["compress", "every codec family"])
def test_layers_issue_no_host_sync_on_cuda(plan):
    """The same step on a GPU under `torch.cuda.set_sync_debug_mode("error")`: every
    device-to-host copy or stream sync raises (the Triton kernels, not the references)."""
    model = R.build(dropout=0.1).cuda()
    apply(model, PLANS[plan])
    ids, pos, labels = (t.cuda() for t in R.batch(1))
    R.seed_all(5)
    model(ids, pos, None, labels=labels).float().mean().backward()  # builds codec states
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        model(ids, pos, None, labels=labels).float().mean().backward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
