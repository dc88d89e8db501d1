"""Flags: Megatron-LM's names, `--act-compress*` through `add_arguments`, clear errors."""
import argparse

import pytest

from llm_act.config import ActConfig
from llm_act.patches.megatron import add_arguments, config_from_args
from llm_act.train.args import parse_args


def megatron_like_parser() -> argparse.ArgumentParser:
    """Built as Megatron-LM's `parse_args` builds its parser, with a few of its flags."""
    p = argparse.ArgumentParser(description="Megatron-LM Arguments", allow_abbrev=False)
    g = p.add_argument_group(title="network size")
    g.add_argument("--num-layers", type=int, default=None)
    g.add_argument("--hidden-size", type=int, default=None)
    g = p.add_argument_group(title="training")
    g.add_argument("--micro-batch-size", type=int, default=None)
    g.add_argument("--bf16", action="store_true")
    g.add_argument("--recompute-granularity", type=str, default=None)
    return p


def test_add_arguments_returns_the_parser_and_builds_the_config():
    p = megatron_like_parser()
    assert add_arguments(p) is p  # Megatron-LM: parser = extra_args_provider(parser)
    args = p.parse_args(["--num-layers", "4", "--bf16", "--act-compress", "--act-compress-budget", "60GB",
                         "--act-compress-plan", "compress", "--act-compress-codecs",
                         "ln1.input=int8,mlp.fc2_input=keep", "--no-act-compress-adapt",
                         "--act-compress-adapt-interval-max", "64", "--act-compress-variance-budget",
                         "0.5", "--act-compress-seed", "7", "--act-compress-attention", "sdpa",
                         "--no-act-compress-sensitivity"])
    assert args.num_layers == 4 and args.bf16
    cfg = config_from_args(args)
    assert cfg == ActConfig(plan="compress", budget=60 * 10**9, codecs={"ln1.input": "int8",
                            "mlp.fc2_input": "keep"}, attention="sdpa", adapt=False,
                            adapt_interval_max=64, sensitivity=False, variance_budget=0.5, seed=7)


def test_every_config_field_has_a_flag_and_defaults_match():
    p = add_arguments(megatron_like_parser())
    flags = {a for action in p._actions for a in action.option_strings}
    for field in ActConfig.field_names():
        if field != "enabled":
            assert "--act-compress-" + field.replace("_", "-") in flags
    assert config_from_args(p.parse_args(["--act-compress"])) == ActConfig()
    assert config_from_args(p.parse_args([])) is None


def test_codecs_accept_json():
    p = add_arguments(megatron_like_parser())
    args = p.parse_args(["--act-compress", "--act-compress-codecs", '{"ln2.input": "int4_sym"}'])
    assert config_from_args(args).codecs == {"ln2.input": "int4_sym"}


@pytest.mark.parametrize("argv, flag, words", [
    (["--act-compress-budget", "lots"], "--act-compress-budget", "cannot read 'lots'"),
    (["--act-compress-budget", "-3GB"], "--act-compress-budget", "budget"),
    (["--act-compress-codecs", "ln1.input=nosuch"], "--act-compress-codecs", "nosuch"),
    (["--act-compress-codecs", "ln1.input"], "--act-compress-codecs", "site=codec"),
    (["--act-compress-codecs", "{bad json"], "--act-compress-codecs", "JSON"),
    (["--act-compress-attention", "flash"], "--act-compress-attention", "flash"),
    (["--act-compress-plan", "fastest"], "--act-compress-plan", "fastest"),
    (["--act-compress-adapt-interval-max", "0"], "--act-compress-adapt-interval-max", "positive"),
    (["--act-compress-seed", "x1"], "--act-compress-seed", "integer"),
    (["--act-compress-variance-budget", "-1"], "--act-compress-variance-budget", "non-negative"),
    (["--act-compres"], "--act-compres", "unrecognized"),  # allow_abbrev=False
])
def test_bad_act_flags_are_argparse_errors_naming_the_flag(argv, flag, words, capsys):
    p = add_arguments(megatron_like_parser())
    with pytest.raises(SystemExit) as exc:
        p.parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and words in err, err


def test_act_flag_without_act_compress_is_an_error():
    p = add_arguments(megatron_like_parser())
    with pytest.raises(ValueError, match="--act-compress-budget.*without --act-compress"):
        config_from_args(p.parse_args(["--act-compress-budget", "1GB"]))


def test_add_arguments_rejects_a_non_parser():
    with pytest.raises(TypeError, match="parser"):
        add_arguments({"not": "a parser"})


def test_loop_flags_derive_batch_layout():
    args = parse_args(["--micro-batch-size", "2", "--global-batch-size", "8",
                       "--tensor-model-parallel-size", "2"], world_size=4)
    assert args.data_parallel_size == 2 and args.num_micro_batches == 2
    assert args.act_config is None and args.max_position_embeddings == args.seq_length
    args = parse_args(["--act-compress", "--act-compress-plan", "keep"])
    assert args.act_config == ActConfig(plan="keep")


@pytest.mark.parametrize("argv, world, words", [
    (["--fp16"], 1, "--fp16: not supported"),
    (["--hidden-size", "100", "--num-attention-heads", "3"], 1, "not divisible by --num-attention-heads"),
    (["--global-batch-size", "6", "--micro-batch-size", "4"], 1, "--global-batch-size 6"),
    (["--tensor-model-parallel-size", "2"], 3, "does not divide the world size 3"),
    (["--num-layers", "3", "--pipeline-model-parallel-size", "2"], 2, "--num-layers 3"),
    (["--lr-warmup-iters", "50", "--train-iters", "40"], 1, "--lr-warmup-iters 50"),
    (["--train-iters", "0"], 1, "--train-iters: expected a positive integer"),
    (["--hidden-dropout", "1.5"], 1, "--hidden-dropout"),
    (["--save-interval", "5"], 1, "--save-interval: needs --save"),
    (["--act-compress-plan", "keep"], 1, "without --act-compress"),
    (["--tensor-model-parallel", "2"], 1, "unrecognized"),  # no abbreviations
])
def test_bad_loop_flags_exit_2_with_a_clear_message(argv, world, words, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(argv, world_size=world)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert words in err and "usage:" in err, err
