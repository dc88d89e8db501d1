"""megatron-core 0.17-0.19's options under their Megatron-LM flags: `launch/pretrain_gpt.py` and
`llm-act train` print the library's one-line refusal and exit 2 under --act-compress, a stock run
passes them to megatron-core, and an installed release without the option says so (issue 43)."""
import pytest

from llm_act.cli.main import main as cli_main
from llm_act.patches.megatron import compat
from llm_act.train import model as train_model
from llm_act.train.args import parse_args
from llm_act.train.loop import main as loop_main

#: (flag words, the option it sets, its value as the refusal names it)
FLAGS = [
    (["--tensor-parallel-num-weight-shards", "2"], "gtp_weight_remat_size", 2),
    (["--expert-tensor-parallel-num-weight-shards", "4"], "expert_gtp_weight_remat_size", 4),
    (["--mlp-chunks-for-training", "2"], "mlp_chunks_for_training", 2),
    (["--moe-paged-stash"], "moe_paged_stash", True),
    (["--qk-l2-norm"], "qk_l2_norm", True),
    (["--use-mup"], "use_mup", True),
    (["--fp8-output-proj"], "fp8_output_proj", True),
]
TINY = ["--num-layers", "1", "--hidden-size", "32", "--num-attention-heads", "2", "--seq-length", "16",
        "--micro-batch-size", "1", "--train-iters", "1"]


def test_every_newer_option_has_one_flag():
    flagged = set(compat.NEW_OPTION_FLAGS) | set(compat.GTP_SHARD_FLAGS)
    assert flagged == set(compat.NEW_OPTIONS) and {f[1] for f in FLAGS} == flagged


def _expected(name: str, value) -> str:
    if compat.has_option(name):
        return f"error: {name}={value!r} is not supported by llm_act yet"
    return f"has no option {name} (megatron-core 0.17 or newer has); drop the flag"


@pytest.mark.parametrize("words,name,value", FLAGS, ids=[f[1] for f in FLAGS])
@pytest.mark.parametrize("door", ["pretrain_gpt", "llm-act train"])
def test_refused_in_one_line_and_exit_2(door, words, name, value, capsys):
    """Before anything is built: the refusal names the option and its value, alone on stderr
    (no usage block, no traceback); on a megatron-core without the option, the error says so."""
    with pytest.raises(SystemExit) as exc:
        if door == "pretrain_gpt":
            loop_main([*TINY, "--act-compress", *words])
        else:
            cli_main(["train", *TINY, *words])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert _expected(name, value) in err
    assert "Traceback" not in err
    if compat.has_option(name):  # the library's refusal: one line, nothing else
        assert len(err.strip().splitlines()) == 1, err


#: options megatron-core itself refuses without a partner option (its own ValueError, named)
NEEDS_PARTNER = {"moe_paged_stash": "moe_expert_rank_capacity_factor", "fp8_output_proj": "fp8"}


@pytest.mark.parametrize("words,name,value", FLAGS, ids=[f[1] for f in FLAGS])
def test_a_stock_run_hands_the_option_to_megatron_core(words, name, value):
    """Without --act-compress nothing is refused: the option reaches megatron-core's
    TransformerConfig (GTP as Megatron-LM derives it: remat size = shards / TP size)."""
    if not compat.has_option(name):
        with pytest.raises(SystemExit):
            parse_args([*TINY, *words])
        return
    args = parse_args([*TINY, *words])
    assert getattr(args, name) == value
    if name in NEEDS_PARTNER:  # megatron-core's own check ran: the option was handed over
        with pytest.raises(ValueError, match=rf"{name}.*{NEEDS_PARTNER[name]}"):
            train_model.transformer_config(args)
        return
    tconfig = train_model.transformer_config(args)
    assert getattr(tconfig, name) == value
    assert all(compat.option(tconfig, n) == off for n, off in compat.NEW_OPTIONS.items() if n != name)


def test_gtp_shards_must_be_a_multiple_of_the_tp_size(capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args([*TINY, "--tensor-model-parallel-size", "2", "--tensor-parallel-num-weight-shards", "3"],
                   world_size=2)
    assert exc.value.code == 2
    assert "--tensor-parallel-num-weight-shards 3: must be a multiple of --tensor-model-parallel-size 2" \
        in capsys.readouterr().err
