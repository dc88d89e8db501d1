"""The declared contract between the runtime and the layers (`llm_act.layer_contract`).

- every binder class declares `LayerBinder` and implements each of its members itself (a member
  inherited from the protocol would be a stub returning None), and the binders of real models
  (a megatron-core GPT converted by `apply`, its DeepSpeed variant, a generic block stack) are
  instances of the runtime-checkable protocol, found with `binder_of` on every site's module;
- the runtime and measurement reach no private member of a layer (`_act_recompute`,
  `_mlp_kind`), and their imports point down (docs/architecture.md): measurement imports no
  runtime, patches or training loop, the runtime no patches or training loop, the patches no
  training loop, benches or CLI. The sources are scanned, imports inside functions included.
"""
from __future__ import annotations

import ast
import importlib
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from llm_act.layer_contract import LayerBinder, SiteModule, binder_of

ROOT = Path(__file__).resolve().parents[2]
#: what the runtime and measurement may call on a binder: exactly the protocol's members
MEMBERS = ("codec_names", "bind", "mlp_kind", "recompute_scope", "producer", "model_shape")


#: every class that implements the contract: (module, class)
BINDERS = (("llm_act.patches.megatron.recompute", "LayerRecompute"),
           ("llm_act.patches.deepspeed.megatron_recompute", "DeepSpeedLayerRecompute"),
           ("llm_act.patches.deepspeed.generic", "BlockRecompute"))


def test_the_protocol_declares_what_the_runtime_calls():
    declared = {n for n in vars(LayerBinder) if not n.startswith("_")}
    assert declared == set(MEMBERS)
    for name in MEMBERS:
        assert getattr(LayerBinder, name).__doc__, f"LayerBinder.{name} says why"


@pytest.mark.parametrize("module, name", BINDERS, ids=[n for _, n in BINDERS])
def test_every_binder_class_declares_and_implements_the_contract(module, name):
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, LayerBinder)
    for name in MEMBERS:
        assert getattr(cls, name) is not getattr(LayerBinder, name), f"{cls.__name__}.{name} is the stub"


def _gpt_binders(**overrides):
    from llm_act import ActConfig
    from llm_act.patches.megatron import apply
    from tests import testing as T

    warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")
    torch.manual_seed(0)
    model = T.gpt_model(T.small_config(hidden_size=32, num_attention_heads=2, num_layers=2, **overrides),
                        vocab_size=32, max_sequence_length=16)
    controller = apply(model, ActConfig(plan="compress"))
    binders = {}
    for layer in controller.layers:
        # (the final norm, after the blocks, has no binder: the controller binds it site by site)
        found = {id(binder_of(controller.module(layer, s))) for s in controller.sites(layer)
                 if s != "final_norm.input"}
        assert len(found) == 1, f"layer {layer}: every site's module has the layer's one binder"
        assert binder_of(controller.module(layer, "final_norm.input")) is None if layer == 1 else True
        binders[layer] = binder_of(controller.module(layer, controller.sites(layer)[0]))
    return controller, binders


@pytest.mark.usefixtures("megatron_one_rank")
def test_megatron_binders_are_layer_binders():
    from llm_act.measurement.measure import _no_recompute
    from llm_act.patches.deepspeed.megatron_recompute import DeepSpeedLayerRecompute
    from llm_act.patches.megatron.recompute import LayerRecompute

    controller, binders = _gpt_binders()
    x = torch.randn(4, 8)
    for layer, binder in binders.items():
        assert type(binder) is LayerRecompute and isinstance(binder, LayerBinder)
        assert binder.mlp_kind() == "fewbit"
        torch.testing.assert_close(binder.producer("mlp.fc2_input")(x), F.gelu(x), rtol=0, atol=0)
        assert _no_recompute(controller, layer) == ()
    adopted = DeepSpeedLayerRecompute.adopt(binders[0], checkpointing=None)
    assert isinstance(adopted, LayerBinder) and binder_of(controller.module(0, "ln1.input")) is adopted
    controller.reinstall()  # binds through the contract, the adopted class included

    # the analytic model of the layer, from its TransformerConfig (the budget check asks this)
    shape = binders[0].model_shape(count=2, seq_length=16, micro_batch=3, dtype="fp32",
                                   position_embedding="rope", attention="stock")
    assert (shape.num_layers, shape.hidden_size, shape.num_attention_heads) == (2, 32, 2)
    assert (shape.seq_length, shape.micro_batch_size, shape.activation) == (16, 3, "gelu")

    # every module the controller holds is a SiteModule: what the runtime reads of it is declared
    modules = {id(controller.module(layer, site)): controller.module(layer, site)
               for layer in controller.layers for site in controller.sites(layer)}
    assert all(isinstance(m, SiteModule) for m in modules.values()), [type(m) for m in modules.values()]
    assert controller.module(0, "mlp.act_input").act_activation == "gelu"
    assert controller.module(0, "attn.q").act_attention is not None
    assert controller.module(0, "ln1.input").act_attention is None

    controller, binders = _gpt_binders(activation_func=F.relu)
    for layer, binder in binders.items():
        assert binder.mlp_kind() == "mask"
        torch.testing.assert_close(binder.producer("mlp.fc2_input")(x), F.relu(x), rtol=0, atol=0)
        assert _no_recompute(controller, layer) == ("mlp.fc2_input",)


def test_generic_block_binders_are_layer_binders():
    from llm_act import ActConfig
    from llm_act.measurement.measure import _no_recompute
    from llm_act.measurement.measured_profile import RECOMPUTABLE
    from llm_act.patches.deepspeed import generic
    from tests.patches.deepspeed.test_config import Net

    handle = generic.apply(Net(2), ActConfig(plan="compress"))
    ctl = handle.controller
    for layer, sites in enumerate(handle.sites):
        binder = binder_of(ctl.module(layer, ctl.sites(layer)[0]))
        assert type(binder) is generic.BlockRecompute and binder is binder_of(sites)
        assert isinstance(binder, LayerBinder)
        assert binder.mlp_kind() is None and binder.producer("mlp.fc2_input") is None
        assert binder.model_shape(count=1, seq_length=8, micro_batch=2, dtype="fp32",
                                  position_embedding="rope", attention="stock") is None
        module = ctl.module(layer, ctl.sites(layer)[0])
        assert isinstance(module, SiteModule) and module.act_activation is None and module.act_attention is None
        # no megatron layer: measurement offers no single-site recompute there
        assert set(_no_recompute(ctl, layer)) == RECOMPUTABLE
    ctl.reinstall()


def test_a_duck_typed_binder_is_checked_structurally():
    class Partial:
        def codec_names(self, choice):
            return {}

        def bind(self, choice, codecs):
            pass

    assert not isinstance(Partial(), LayerBinder)
    assert binder_of(torch.nn.Linear(2, 2)) is None


# ---- the sources --------------------------------------------------------------------------

PRIVATE = {"_act_recompute", "_mlp_kind"}
#: package folder -> module prefixes it must not import (the layers above it)
ABOVE = {
    "llm_act/measurement": ("llm_act.runtime", "llm_act.patches", "llm_act.generic", "llm_act.attention",
                            "llm_act.train", "llm_act.bench", "llm_act.cli"),
    "llm_act/runtime": ("llm_act.patches", "llm_act.generic", "llm_act.attention", "llm_act.train",
                        "llm_act.bench", "llm_act.cli"),
    "llm_act/patches": ("llm_act.train", "llm_act.bench", "llm_act.cli"),
}


def _trees(folder: str):
    for path in sorted((ROOT / folder).rglob("*.py")):
        yield path.relative_to(ROOT), ast.parse(path.read_text(), filename=str(path))


def _imported(node: ast.AST) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom) and node.module and not node.level:
        return [node.module] + [f"{node.module}.{a.name}" for a in node.names]
    return []


@pytest.mark.parametrize("folder", ["llm_act/runtime", "llm_act/measurement"])
def test_no_private_reach_into_the_layers(folder):
    found = []
    for path, tree in _trees(folder):
        for node in ast.walk(tree):
            name = (node.attr if isinstance(node, ast.Attribute)
                    else node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None)
            if name in PRIVATE:
                found.append(f"{path}:{node.lineno}: {name}")
    assert not found, "reach the layer through llm_act.layer_contract:\n" + "\n".join(found)


#: what a layer's modules declare (`SiteModule`): the runtime and measurement read it as
#: attributes, never by name through getattr / hasattr
DECLARED = {"act_activation", "act_attention", "set_attention_mode"}


@pytest.mark.parametrize("folder", ["llm_act/runtime", "llm_act/measurement"])
def test_no_reflection_on_what_site_modules_declare(folder):
    found = [f"{path}:{node.lineno}: {node.value!r}" for path, tree in _trees(folder) for node in ast.walk(tree)
             if isinstance(node, ast.Constant) and node.value in DECLARED]
    assert not found, "read it as declared by llm_act.layer_contract.SiteModule:\n" + "\n".join(found)


#: fields of megatron-core's TransformerConfig: the runtime and measurement read none (a layer's
#: analytic model comes from its binder, `LayerBinder.model_shape`)
CONFIG_FIELDS = {"num_attention_heads", "ffn_hidden_size", "num_query_groups", "gated_linear_unit",
                 "kv_channels", "add_bias_linear", "hidden_dropout", "attention_dropout"}


@pytest.mark.parametrize("folder", ["llm_act/runtime", "llm_act/measurement"])
def test_no_transformer_config_is_read_below_the_integration(folder):
    found = [f"{path}:{node.lineno}: .{node.attr}" for path, tree in _trees(folder) for node in ast.walk(tree)
             if isinstance(node, ast.Attribute) and node.attr in CONFIG_FIELDS]
    assert not found, "ask the layer's binder (LayerBinder.model_shape):\n" + "\n".join(found)


@pytest.mark.parametrize("folder", sorted(ABOVE))
def test_imports_point_down(folder):
    found = []
    for path, tree in _trees(folder):
        for node in ast.walk(tree):
            for name in _imported(node):
                if any(name == p or name.startswith(p + ".") for p in ABOVE[folder]):
                    found.append(f"{path}:{node.lineno}: imports {name}")
    assert not found, "an import points up (docs/architecture.md):\n" + "\n".join(sorted(set(found)))
