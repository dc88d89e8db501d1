"""megatron-core's own recompute options that `llm-act bench gpu` compares against: each builds
and trains one step at tiny size on CPU on the installed megatron-core (0.16.1 and 0.19.2 in
CI), with stock's loss and gradients, and every recompute module megatron-core knows is run
or listed as not run with its reason (issue 43)."""
import re

import pytest
import torch

from llm_act.bench import gpu as G

SHAPE = G.gpt_shape(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, vocab_size=128)
RUN = [n for n in G.NATIVE if n != G.NATIVE_OFFLOAD]  # offloading needs CUDA (listed)


def _step(model) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(7)
    ids = torch.randint(0, SHAPE.vocab_size, (2, SHAPE.seq_length))
    pos = torch.arange(SHAPE.seq_length).unsqueeze(0).expand(2, -1)
    loss = model(ids, pos, None, labels=ids).float().mean()
    loss.backward()
    return loss.detach(), [p.grad.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("name", RUN)
def test_native_scheme_trains_one_step_as_stock(name, megatron_one_rank):
    """Recomputation changes what is stored, never what is computed: the loss and every
    gradient equal stock's from the same initial weights."""
    native = G._model(SHAPE, torch.device("cpu"), **G.NATIVE[name])
    assert native.config.recompute_granularity == G.NATIVE[name]["recompute_granularity"]
    loss, grads = _step(native)
    stock_loss, stock_grads = _step(G._model(SHAPE, torch.device("cpu")))
    assert torch.isfinite(loss) and loss.item() > 0
    assert torch.equal(loss, stock_loss)
    assert len(grads) == len(stock_grads) and all(g.abs().sum() > 0 for g in grads[:3])
    for g, s in zip(grads, stock_grads):
        torch.testing.assert_close(g, s, rtol=0, atol=0)


def _known_recompute_modules() -> set[str]:
    """The recompute modules the installed megatron-core accepts, from its own refusal."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    with pytest.raises(AssertionError) as err:
        TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, recompute_granularity="selective",
                          recompute_modules=["no_such_module"])
    found = re.search(r"Allowed modules are: \{(.*)\}", str(err.value))
    assert found, str(err.value)
    return {m.strip(" '\"") for m in found.group(1).split(",")}


def test_every_recompute_module_is_run_or_listed_with_its_reason():
    known = _known_recompute_modules()
    assert {"core_attn", "layernorm", "mlp"} <= known
    run = {m for name in RUN for m in G.NATIVE[name].get("recompute_modules", ())}
    listed = {m for line in G.NATIVE_NOT_RUN if line.startswith("recompute_modules")
              for m in re.findall(r'"(\w+)"', line.split(":")[0])}
    assert known <= run | listed, f"not run and not listed: {sorted(known - run - listed)}"
    assert not run & listed
