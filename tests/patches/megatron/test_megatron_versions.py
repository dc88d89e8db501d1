"""What differs between the megatron-core versions we support (0.16 through 0.19), each
checked on the installed one: the spec forms (`compat`), the bias-dropout-add dtype rule
under `fp32_residual_connection`, and the refusal of each newer option the compressed
layers do not implement (issue 43)."""
from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("megatron.core")

from llm_act import ActConfig  # noqa: E402
from llm_act.patches.megatron import apply, compat, layer_spec  # noqa: E402
from tests import testing as T  # noqa: E402
from tests import gpt_runs as R  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_one_rank")  # tests/conftest.py


@pytest.mark.parametrize("codec", ["keep", "bitmask", "regen"])
@pytest.mark.parametrize("with_bias", [False, True])
def test_bias_dropout_add_is_bit_for_bit_with_bf16_x_and_fp32_residual(codec, with_bias):
    """bf16 activations, an fp32 residual (`fp32_residual_connection=True` with bf16 params)
    and hidden dropout 0.2: our bias-dropout-add, kept or storing its mask packed
    (`bitmask`) or not at all (`regen`), gives stock's output, dtype, gradients and RNG
    consumption bit for bit, on whichever dtype rule the installed megatron-core has (0.16:
    the residual cast to x's dtype; 0.19: x and the bias cast to the residual's).

    A whole GPT cannot be the check here: on CPU without apex, stock megatron-core itself
    fails that configuration (`WrappedTorchNorm` with bf16 weights returns fp32 for the fp32
    residual stream, which the bf16 linear_qkv then refuses)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    from llm_act.codecs import make_codec
    from llm_act.patches.megatron.dropout import ActBiasDropoutAdd

    def run(bda):
        gen = torch.Generator().manual_seed(3)
        x = torch.randn(16, 2, 32, generator=gen).to(torch.bfloat16).requires_grad_()
        residual = torch.randn(16, 2, 32, generator=gen).requires_grad_()
        bias = torch.randn(32, generator=gen).to(torch.bfloat16).requires_grad_() if with_bias else None
        torch.manual_seed(11)
        out = bda(True, False)((x, bias), residual, 0.2)
        grad = torch.randn(out.shape, generator=gen).to(out.dtype)
        out.backward(grad)
        return out.detach(), [t.grad for t in (x, residual, bias) if t is not None], torch.get_rng_state()

    out0, grads0, rng0 = run(get_bias_dropout_add)
    ours = ActBiasDropoutAdd(get_bias_dropout_add, "mlp.hidden_dropout_mask")
    if codec != "keep":
        ours.set_act_codec("mlp.hidden_dropout_mask", make_codec(codec))
    out1, grads1, rng1 = run(ours)
    assert out1.dtype == out0.dtype and torch.equal(out0, out1)
    assert all(torch.equal(a, b) for a, b in zip(grads0, grads1))
    assert torch.equal(rng0, rng1)
    assert out0.dtype == (torch.float32 if compat.bda_follows_residual() else torch.bfloat16)


def test_bias_dropout_add_casts_as_the_installed_stock():
    """`compat.bda_operands` mirrors the installed stock function's dtypes: its output dtype
    for a bf16 x and an fp32 residual is stock's (fp32 on 0.19, bf16 on 0.16)."""
    from megatron.core.fusions.fused_bias_dropout import get_bias_dropout_add

    x = torch.randn(4, 2, 8, dtype=torch.bfloat16, requires_grad=True)
    residual = torch.randn(4, 2, 8, dtype=torch.float32, requires_grad=True)
    bias = torch.randn(8, dtype=torch.bfloat16, requires_grad=True)
    out = get_bias_dropout_add(True, False)((x, bias), residual, 0.0)
    cx, cb, cr = compat.bda_operands(x, bias, residual)
    assert cx.dtype == cb.dtype == cr.dtype == out.dtype
    assert compat.bda_operands(x, None, residual)[1] is None
    same = torch.randn(3, dtype=torch.bfloat16)
    assert compat.bda_operands(same, None, same)[0] is same


def test_spec_forms_are_told_apart_by_type():
    """The `mlp` slot is a `ModuleSpec` (0.16) or a builder (0.17+); compat reads either and
    copies a builder with its class swapped."""
    from megatron.core.transformer.mlp import MLP, MLPSubmodules
    from megatron.core.transformer.moe.experts import SequentialMLP
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.spec_utils import ModuleSpec

    from llm_act.patches.megatron.moe import ActSequentialMLP

    dense = T.local_layer_spec().submodules.mlp
    assert compat.spec_class(dense) is MLP
    assert isinstance(compat.spec_submodules(dense), MLPSubmodules)
    moe = T.local_layer_spec(num_experts=4).submodules.mlp
    assert compat.spec_class(moe) is MoELayer
    experts = compat.spec_submodules(moe).experts
    assert compat.spec_class(experts) is SequentialMLP
    ours = compat.with_class(experts, ActSequentialMLP)
    assert compat.spec_class(ours) is ActSequentialMLP
    assert compat.spec_submodules(ours) is compat.spec_submodules(experts)
    assert compat.spec_class(experts) is SequentialMLP  # the stock slot left as it was
    # both forms, whatever the installed version builds
    sub = compat.spec_submodules(dense)
    as_spec = ModuleSpec(module=SequentialMLP, submodules=sub)
    as_builder = functools.partial(SequentialMLP, submodules=sub)
    for form in (as_spec, as_builder):
        assert compat.spec_class(form) is SequentialMLP
        assert compat.spec_submodules(form) is sub
        swapped = compat.with_class(form, ActSequentialMLP)
        assert type(swapped) is type(form) and compat.spec_class(swapped) is ActSequentialMLP
        replaced = compat.with_submodules(form, None)
        assert compat.spec_class(replaced) is SequentialMLP
    bound = functools.partial(MLP.as_mlp_submodule, submodules=sub) if hasattr(MLP, "as_mlp_submodule") else None
    if bound is not None:
        assert compat.spec_class(bound) is MLP
    with pytest.raises(TypeError, match="does not subclass"):
        compat.with_class(as_spec, MLP)


#: each option of megatron-core 0.17-0.19 our layers would ignore, set to a value that is on
NEW_OPTIONS_ON = [
    ("gtp_weight_remat_size", 2),
    ("expert_gtp_weight_remat_size", 4),
    ("mlp_chunks_for_training", 2),
    ("moe_paged_stash", True),
    ("qk_l2_norm", True),
    ("use_mup", True),
    ("fp8_output_proj", True),
]


@pytest.mark.parametrize("name,value", NEW_OPTIONS_ON, ids=[n for n, _ in NEW_OPTIONS_ON])
def test_each_newer_option_is_refused_in_one_line_naming_it(name, value):
    """`apply` and `layer_spec` refuse each newer option that is on with one line naming it
    and its value (the option set on the built model's config, as Megatron-LM's arguments
    would set it; megatron-core's own checks of the option's partners are not the point)."""
    from llm_act.patches.megatron import unsupported

    model = R.build()
    cfg = model.config
    unsupported.check_transformer_config(cfg, ActConfig())  # off: accepted
    setattr(cfg, name, value)  # the layers share the model's config
    expected = f"^{name}={value!r} is not supported by llm_act yet: "
    with pytest.raises(NotImplementedError, match=expected) as refused:
        apply(model, ActConfig(plan="keep"))
    assert "\n" not in str(refused.value)
    with pytest.raises(NotImplementedError, match=expected):
        layer_spec(ActConfig(), cfg)


def test_options_at_their_off_values_are_accepted():
    """The "off" value of each newer option is what a config of this megatron-core holds by
    default (where it has the field), and what an older config without it reads as."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = T.small_config()
    for name, off in compat.NEW_OPTIONS.items():
        if name in TransformerConfig.__dataclass_fields__:
            assert getattr(cfg, name) == off, name
        assert compat.option(object(), name) == off


def test_hybrid_model_is_refused():
    """megatron-core 0.19 points GPTModel users at HybridModel; apply refuses it by name."""
    from llm_act.patches.megatron import unsupported

    HybridModel = type("HybridModel", (torch.nn.Module,), {})
    with pytest.raises(NotImplementedError, match="HybridModel is not supported by llm_act yet"):
        unsupported.check_modules([HybridModel()])


def test_the_cpu_stand_ins_do_without_megatron_legacy():
    """`megatron.legacy` ships with a Megatron-LM checkout, not in the megatron-core 0.19 wheel:
    an absent module reads as None, an error inside a present one still raises."""
    assert compat.optional_module("megatron.no_such_module_here") is None
    assert compat.optional_module("no_such_top_package.x") is None
    assert compat.optional_module("megatron.core") is not None
