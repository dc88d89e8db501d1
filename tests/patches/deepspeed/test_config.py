"""The DeepSpeed door's config handling: bad values name the key, overlaps are refused.

No process group is needed: the section is read before DeepSpeed starts anything.
"""
import json

import pytest
import torch

pytest.importorskip("deepspeed")

from llm_act.config import ActConfig  # noqa: E402
from llm_act.patches.deepspeed import ds_config, generic, initialize  # noqa: E402


def _ds(section, **extra):
    return {"train_micro_batch_size_per_gpu": 1, "activation_compression": section, **extra}


class Block(torch.nn.Module):
    def __init__(self, h=32):
        super().__init__()
        self.ln_1 = torch.nn.LayerNorm(h)
        self.c_fc = torch.nn.Linear(h, 4 * h)
        self.act = torch.nn.GELU()
        self.down_proj = torch.nn.Linear(4 * h, h)

    def forward(self, x):
        return x + self.down_proj(self.act(self.c_fc(self.ln_1(x))))


class Net(torch.nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.layers = torch.nn.ModuleList(Block() for _ in range(n))
        self.head = torch.nn.Linear(32, 8)

    def forward(self, x):
        for block in self.layers:
            x = block(x)
        return self.head(x)


@pytest.mark.parametrize("section, key", [
    ({"budget": "lots"}, "activation_compression.budget"),
    ({"plan": "fastest"}, "activation_compression.plan"),
    ({"enabled": "yes"}, "activation_compression.enabled"),
    ({"codecs": {"attn.out": "int3"}}, "activation_compression.codecs"),
    ({"adapt_interval_max": 0}, "activation_compression.adapt_interval_max"),
    ({"budgte": "60GB"}, "'budgte'"),
    ("compress", "activation_compression"),
])
def test_bad_values_name_the_key(section, key, tmp_path):
    model = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError) as err:
        initialize(model=model, model_parameters=model.parameters(), config=_ds(section))
    assert key in str(err.value)
    # the same through a JSON file given as args.deepspeed_config, as the launcher does
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(_ds(section)))

    class Args:
        deepspeed_config = str(path)
        local_rank = -1

    with pytest.raises(ValueError) as err:
        initialize(args=Args(), model=model, model_parameters=model.parameters())
    assert key in str(err.value)


def test_good_section_is_read():
    cfg = ds_config.act_config(_ds({"enabled": True, "budget": "2GiB", "plan": "compress"}))
    assert isinstance(cfg, ActConfig) and cfg.budget == 2 * 2**30 and cfg.plan == "compress"
    assert ds_config.act_config({"train_micro_batch_size_per_gpu": 1}) is None


def test_config_given_twice_is_refused():
    class Args:
        deepspeed_config = "a.json"

    with pytest.raises(ValueError, match="config"):
        ds_config.source(Args(), {"x": 1}, None)


def test_checkpoint_input_codec_with_deepspeed_checkpointing_is_refused():
    ckpt = ds_config.checkpointing({"activation_checkpointing": {"cpu_checkpointing": True}})
    cfg = ActConfig(plan="recompute", codecs={"ln1.input": "int8"})
    with pytest.raises(ValueError, match=r"codecs\['ln1.input'\].*activation_checkpointing"):
        generic.apply(Net(), cfg, ckpt)


def test_contiguous_checkpointing_needs_enough_buffers():
    ckpt = ds_config.checkpointing({"activation_checkpointing": {
        "partition_activations": True, "contiguous_memory_optimization": True,
        "number_checkpoints": 2}})
    with pytest.raises(ValueError, match="number_checkpoints"):
        generic.apply(Net(n=3), ActConfig(plan="recompute"), ckpt)
    with pytest.raises(ValueError, match="activation_checkpointing.cpu_checkpointing"):
        ds_config.checkpointing({"activation_checkpointing": {"cpu_checkpointing": "yes"}})


def test_generic_sites_follow_submodule_names():
    assert generic.site_of("self_attn.q_proj") == "attn.qkv_input"
    assert generic.site_of("attn.c_proj") == "attn.out"
    assert generic.site_of("mlp.c_proj") == "mlp.fc2_input"
    assert generic.site_of("mlp.act_fn") == "mlp.act_input"
    assert generic.site_of("post_attention_layernorm") == "ln2.input"
    assert generic.site_of("self_attn.rotary_emb") is None
    net = Net(n=3)
    assert generic.repeated_blocks(net) == list(net.layers)
    with pytest.raises(ValueError, match="no repeated blocks"):
        generic.repeated_blocks(torch.nn.Linear(2, 2))


def test_generic_compress_keeps_forward_and_shrinks_saved_bytes():
    from llm_act.ledger import SavedTensorLedger

    torch.manual_seed(0)
    ref, net = Net(), Net()
    net.load_state_dict(ref.state_dict())
    handle = generic.apply(net, ActConfig(plan="compress"))
    assert handle.controller.enabled and not handle.recompute
    x = torch.randn(4, 64, 32)
    with SavedTensorLedger() as keep:
        y_ref = ref(x)
    with SavedTensorLedger() as comp:
        y = net(x)
    torch.testing.assert_close(y, y_ref)  # compression changes only what backward sees
    assert comp.total_bytes < 0.35 * keep.total_bytes
    sites = {site for (layer, site) in comp.by_site() if layer is not None}
    assert {"ln1.input", "mlp.fc1_input", "mlp.fc2_input"} <= sites
    y.square().mean().backward()
    y_ref.square().mean().backward()
    for p, q in zip(net.parameters(), ref.parameters()):
        assert torch.nn.functional.cosine_similarity(p.grad.flatten(), q.grad.flatten(), 0) > 0.95


@pytest.mark.parametrize("section,names", [({"enabled": True, "plan": "nope"}, "plan"),
                                           ({"enabled": True, "budgett": "1GB"}, "budgett"),
                                           ({"enabled": True, "biased_codecs": "ignore"}, "biased_codecs")])
def test_ds_train_refuses_a_bad_section_in_one_line(tmp_path, capsys, section, names):
    """Our launcher owns its process: a config error is one line (per rank), exit code 2, no
    traceback, before any process group or op build."""
    from pathlib import Path

    from llm_act.train.ds_train import main

    cfg = json.loads((Path(__file__).resolve().parents[3] / "launch" / "ds_config.json").read_text())
    cfg["activation_compression"] = section
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    assert main(["--deepspeed_config", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ds_train.py: error: ") and err.count("\n") == 1 and names in err, err
    assert "Traceback" not in err
