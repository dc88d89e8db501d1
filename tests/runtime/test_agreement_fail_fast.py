"""Ranks that disagree fail fast, never hang (2 gloo processes each).

- megatron-core GPT under TP=2: `apply` with a different `--act-compress-plan`, different
  codec overrides, or JSON plans of equal path but different content on rank 1 raises
  `Disagreement` on both ranks within seconds, naming the field and each rank's value; so
  does `set_plan` with different plans. Under PP=2 the stages hold different layers and the
  same setup agrees.
- DeepSpeed door (ZeRO-2, DP=2, a Hugging Face Llama): a different "activation_compression"
  section on rank 1 stops both ranks in `initialize`; `set_plan` with different plans stops
  both; equal plans train on.
- A collective of ours that one rank never joins ends in `CollectiveError` naming the
  operation and the group after `LLM_ACT_COLLECTIVE_TIMEOUT` seconds (shortened here).
Every spawn has an overall timeout, so a regression fails instead of hanging CI.
"""
from __future__ import annotations

import datetime
import json
import os
import time
import warnings

import pytest
import torch

from llm_act.runtime import agreement
from tests import testing as T

pytestmark = pytest.mark.dist

#: seconds within which every rank must have raised: the collectives involved are instant,
#: this leaves room for a loaded CI machine and stays far below the default timeout (300 s)
FAST = 20.0
#: LLM_ACT_COLLECTIVE_TIMEOUT in the timeout test
SHORT = 1.5


def _raises(fn, match: str) -> str:
    """The Disagreement message `fn()` raises within FAST seconds; it must contain `match`."""
    begun = time.monotonic()
    with pytest.raises(agreement.Disagreement) as info:
        fn()
    assert time.monotonic() - begun < FAST
    message = str(info.value)
    assert match in message, message
    return message


def _same_everywhere(message: str) -> None:
    got = agreement.gather(message)
    assert got[0] == got[1], got


def _megatron_worker(rank, world, port, tmp):
    warnings.filterwarnings("ignore")
    from llm_act import ActConfig
    from llm_act.patches.megatron import apply
    from tests import gpt_runs as R

    T.init_parallel(tp=2, rank=rank, world_size=world, port=port)

    # a different plan flag on rank 1
    model = R.build(dropout=0.0)
    msg = _raises(lambda: apply(model, ActConfig(plan="keep" if rank else "compress")),
                  "llm_act: ranks disagree on the activation-compression setup: plan: rank 0 "
                  "'compress', rank 1 'keep'; give every rank the same --act-compress-* flags")
    _same_everywhere(msg)

    # a different codec override on rank 1 (bytes per site differ, the plan flag does not)
    codecs = {"mlp.fc1_input": "int8"} if rank else {}
    model = R.build(dropout=0.0)
    msg = _raises(lambda: apply(model, ActConfig(plan="compress", codecs=codecs)),
                  "codecs: rank 0 {}, rank 1 {'mlp.fc1_input': 'int8'};")
    assert "plan at" not in msg  # a differing setting explains the differing plan
    _same_everywhere(msg)

    # the same flags, a JSON plan file of the same name but other content on each rank
    here = os.path.join(tmp, str(rank))
    os.makedirs(here, exist_ok=True)
    with open(os.path.join(here, "plan.json"), "w") as f:
        json.dump({"version": 1, "blocks": [{"layers": [0, 1],
                                             "choice": {"mlp.fc1_input": "int8" if rank else "keep"}}]}, f)
    os.chdir(here)
    model = R.build(dropout=0.0)
    msg = _raises(lambda: apply(model, ActConfig(plan="plan.json")),
                  "plan at mlp.fc1_input (layers 0-1): rank 0 'keep', rank 1 'int8'")
    assert "codecs" not in msg and msg.count("plan at") == 1, msg
    _same_everywhere(msg)

    # equal setups agree; set_plan with different plans stops both ranks, equal ones switch
    model = R.build(dropout=0.0)
    ctl = apply(model, ActConfig(plan="keep"))
    with ctl.step():
        R.step(model)
    msg = _raises(lambda: ctl.set_plan({0: {"mlp.fc2_input": "int4" if rank else "int8"}}),
                  "llm_act: ranks disagree on the plan asked for with set_plan: plan at "
                  "mlp.fc2_input (layer 0): rank 0 'int8', rank 1 'int4'; call set_plan with "
                  "the same plan on every rank")
    _same_everywhere(msg)
    assert ctl.pending_plan is None and ctl.plan[0]["mlp.fc2_input"] == "keep"
    ctl.set_plan("compress")
    with ctl.step():
        R.step(model)
    assert ctl.plan[0]["mlp.fc2_input"] != "keep"

    # PP=2: each stage holds one layer of its own, the same setup agrees
    T.init_parallel(pp=2, rank=rank, world_size=world, port=port)
    from megatron.core import parallel_state as ps

    stage = T.gpt_model(T.small_config(pipeline_model_parallel_size=2, pipeline_dtype=torch.float32), vocab_size=R.VOCAB, max_sequence_length=R.SEQ,
                        pre_process=ps.is_pipeline_first_stage(), post_process=ps.is_pipeline_last_stage())
    ctl = apply(stage, ActConfig(plan="compress"))
    assert ctl.layers == (rank,), ctl.layers
    ctl.set_plan({rank: {"mlp.fc1_input": "int8" if rank else "int4"}})  # own layers only
    T.destroy_parallel()


def test_megatron_ranks_that_disagree_stop(tmp_path):
    T.spawn(_megatron_worker, 2, str(tmp_path), timeout=180)


def _deepspeed_engine(section):
    """A 2-layer Llama under ZeRO-2 with a torch optimizer (no DeepSpeed op to build)."""
    from llm_act.patches.deepspeed import hf_decoder, initialize

    model = hf_decoder.build("llama", hidden_size=64, num_layers=2, max_positions=64, seed=7)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
              "zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer": True,
              "steps_per_print": 10**6, "activation_compression": section}
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    return lambda: initialize(model=model, optimizer=optimizer, config=config)[0]


def _deepspeed_worker(rank, world, port):
    warnings.filterwarnings("ignore")
    import deepspeed

    from llm_act.patches.deepspeed import hf_decoder

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    deepspeed.init_distributed(dist_backend="gloo")
    msg = _raises(_deepspeed_engine({"plan": "keep" if rank else "compress", "adapt": False}),
                  "llm_act: ranks disagree on the activation-compression setup: plan: rank 0 "
                  "'compress', rank 1 'keep'; give every rank the same --act-compress-* flags "
                  '(DeepSpeed: the same "activation_compression" section)')
    _same_everywhere(msg)

    engine = _deepspeed_engine({"plan": "keep", "adapt": False})()  # equal sections agree
    ctl = engine.act_controller
    tokens = torch.randint(0, 256, (2, 33), generator=torch.Generator().manual_seed(rank))

    def train_step():
        engine.backward(hf_decoder.lm_loss(engine, tokens[:, :-1], tokens[:, 1:]))
        engine.step()

    train_step()
    _raises(lambda: ctl.set_plan({i: {"mlp.fc1_input": "int8" if rank else "int4"} for i in ctl.plan}),
            "plan at mlp.fc1_input (layers 0-1): rank 0 'int4', rank 1 'int8'")
    ctl.set_plan({i: {"mlp.fc1_input": "int8"} for i in ctl.plan})
    train_step()
    assert ctl.iteration == 2 and all(c["mlp.fc1_input"] == "int8" for c in ctl.plan.values())


def test_deepspeed_ranks_that_disagree_stop():
    pytest.importorskip("deepspeed")
    pytest.importorskip("transformers")
    T.spawn(_deepspeed_worker, 2, timeout=300)


def _timeout_worker(rank, world, port):
    import torch.distributed as dist

    os.environ[agreement.TIMEOUT_ENV] = str(SHORT)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    # the payload path first: objects of different sizes, a broadcast, a disagreement
    assert agreement.gather("x" * (1 + 1000 * rank)) == ["x", "x" * 1001]
    assert agreement.broadcast({"plan": rank}, agreement.Groups()) == {"plan": 0}
    _raises(lambda: agreement.agree({"seed": 7 + rank, "plan": "keep"}, "test setup", "fix it"),
            "llm_act: ranks disagree on the test setup: seed: rank 0 7, rank 1 8; fix it")
    side = dist.new_group([0, 1])
    store = dist.distributed_c10d._get_default_store()  # a side channel, not a collective
    if rank == 1:  # never joins: busy elsewhere until rank 0 has given up twice
        store.wait(["rank 0 done"], datetime.timedelta(seconds=60))
        return
    for call, op, group in (
        (lambda: agreement.gather({"a": 1}), "all_gather of statistics (sizes)", "the world group (2 ranks)"),
        (lambda: agreement.broadcast(1, agreement.Groups(stage=side)), "broadcast of the plan (size)",
         "the group of global ranks 0-1"),
    ):
        begun = time.monotonic()
        with pytest.raises(agreement.CollectiveError) as info:
            call()
        waited = time.monotonic() - begun
        assert SHORT <= waited + 0.1 < SHORT + 10, waited
        message = str(info.value)
        for part in (f"llm_act: {op} over {group} did not complete on rank 0", agreement.TIMEOUT_ENV,
                     "another rank of the group never reached this call"):
            assert part in message, message
    store.set("rank 0 done", "1")


def test_a_rank_that_never_joins_ends_in_a_timeout_error():
    T.spawn(_timeout_worker, 2, timeout=60)


@pytest.mark.parametrize("raw", ["0", "-3", "soon", "inf"])
def test_the_timeout_must_be_a_positive_number(monkeypatch, raw):
    monkeypatch.setenv(agreement.TIMEOUT_ENV, raw)
    with pytest.raises(ValueError, match=f"{agreement.TIMEOUT_ENV}: expected a positive number of seconds"):
        agreement.collective_timeout()
    monkeypatch.setenv(agreement.TIMEOUT_ENV, "12.5")
    assert agreement.collective_timeout() == 12.5
    monkeypatch.delenv(agreement.TIMEOUT_ENV)
    assert agreement.collective_timeout() == agreement.DEFAULT_TIMEOUT_S
