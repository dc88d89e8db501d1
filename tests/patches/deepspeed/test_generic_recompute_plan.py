"""Plan "recompute" on a generic model (no megatron-core layers): the controller's plan shows
what runs -- every block `recompute_layer(...)`, `ln1.input` kept or its codec -- while the
blocks are recomputed by the wrapper `generic.apply` installs (torch's checkpoint here), the
block input encoded once (by the wrapper, never by the site hooks too), the gradients those
of the stock model. Whether a block recomputes is fixed at `apply`: a plan that switches is
refused, the plan in force staying.
"""
import pytest
import torch

from llm_act.codecs import registry
from llm_act.config import ActConfig
from llm_act.patches.deepspeed import generic
from llm_act.plan import compress_layer, recompute_layer
from tests.patches.deepspeed.test_config import Net  # the same small stack of blocks


def _pair(n=3):
    torch.manual_seed(0)
    ref, net = Net(n), Net(n)
    net.load_state_dict(ref.state_dict())
    return ref, net


def _grads(model, x):
    model.zero_grad()
    model(x).square().mean().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("checkpoint", ["keep", "int8"])
def test_recompute_plan_is_reported(checkpoint):
    codecs = {} if checkpoint == "keep" else {"ln1.input": checkpoint}
    handle = generic.apply(Net(), ActConfig(plan="recompute", codecs=codecs))
    ctl = handle.controller
    assert handle.recompute and ctl.enabled
    assert ctl.plan == {i: recompute_layer(checkpoint) for i in range(3)}
    assert handle.recompute_codec == (None if checkpoint == "keep" else checkpoint)
    # the site hooks encode nothing, and the controller builds no codec: the block input's
    # codec is the wrapper's own
    assert all(c is None for bs in handle.sites for c in bs.codecs.values())
    assert ctl.state_dict()["codecs"] == {}
    assert "recompute" in ctl.describe(ctl.plan)


def test_recompute_gradients_are_stock():
    ref, net = _pair()
    handle = generic.apply(net, ActConfig(plan="recompute"))
    assert handle.controller.plan[0] == recompute_layer()
    x = torch.randn(4, 16, 32)
    want, got = _grads(ref, x), _grads(net, x)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_recompute_encodes_the_block_input_once(monkeypatch):
    int8 = type(registry.make_codec("int8"))
    encoded = []
    encode = int8.encode

    def counting(self, x):
        encoded.append(tuple(x.shape))
        return encode(self, x)

    monkeypatch.setattr(int8, "encode", counting)
    ref, net = _pair()
    handle = generic.apply(net, ActConfig(plan="recompute", codecs={"ln1.input": "int8"}))
    assert handle.controller.plan[2]["ln1.input"] == "int8"
    x = torch.randn(4, 16, 32)
    out = net(x)
    assert encoded == [(4, 16, 32)] * 3  # one block input per block, nothing else
    out.square().mean().backward()
    assert len(encoded) == 3  # backward decodes, it does not encode again
    torch.testing.assert_close(out, ref(x))  # the forward itself is stock


def test_recompute_plan_cannot_switch_to_codecs():
    handle = generic.apply(Net(), ActConfig(plan="recompute"))
    ctl = handle.controller
    before = ctl.plan
    with pytest.raises(ValueError, match="recomputed as a whole"):
        ctl.set_plan("compress")
    with pytest.raises(ValueError, match="recomputed as a whole"):  # another block-input codec
        ctl.set_plan({i: recompute_layer("int8") for i in range(3)})
    assert ctl.plan == before
    assert all(c is None for bs in handle.sites for c in bs.codecs.values())
    ctl.set_plan("recompute")  # the same plan again binds
    assert ctl.plan == before


def test_compress_plan_cannot_switch_to_recompute():
    handle = generic.apply(Net(), ActConfig(plan="compress"))
    ctl = handle.controller
    assert not handle.recompute
    assert ctl.plan[0] == compress_layer(fewbit=False)
    before = ctl.plan
    with pytest.raises(ValueError, match="recomputes only with the whole block"):
        ctl.set_plan("recompute")
    assert ctl.plan == before
    assert handle.sites[0].codecs["mlp.fc1_input"] is ctl.codec(0, "mlp.fc1_input")


def test_recompute_with_other_site_codecs_is_refused():
    with pytest.raises(ValueError, match=r"codecs: .*only codecs\['ln1.input'\] applies.*attn.out"):
        generic.apply(Net(), ActConfig(plan="recompute", codecs={"attn.out": "int8"}))
    # masks are not sites of a generic block, and "recompute" agrees with the plan
    handle = generic.apply(Net(), ActConfig(plan="recompute", codecs={
        "attn.hidden_dropout_mask": "bitmask", "mlp.fc1_input": "recompute"}))
    assert handle.controller.plan[1]["mlp.fc1_input"] == "recompute"


def test_recompute_plan_survives_a_checkpoint():
    handle = generic.apply(Net(), ActConfig(plan="recompute", codecs={"ln1.input": "int8"}))
    state = handle.controller.state_dict()
    again = generic.apply(Net(), ActConfig(plan="recompute", codecs={"ln1.input": "int8"}))
    notes = again.controller.load_state_dict(state)
    assert any("restored the checkpoint's plan" in n for n in notes)
    assert again.controller.plan == {i: recompute_layer("int8") for i in range(3)}
