"""Codec seeds across ranks (2 gloo processes, a real megatron-core GPT under the
"compress" plan, both ranks fed the same batch):

- TP=2 (no sequence parallelism): the tensor-parallel ranks of one replica draw the same
  stochastic rounding at the replicated sites. They store the same replicated tensors (the
  norms' inputs) and each computes the replicated parameters' gradients (the norms'
  weights) from its own copy, so those gradients must be bit-identical across the ranks,
  or the replicated weights drift apart. (Where the TP ranks hold different data, their
  heads and slices, or token shards under sequence parallelism, the seeds differ:
  test_shard_seeds_dist.)
- DP=2: data-parallel replicas draw different rounding, so their compression noise is
  independent and averages out in the gradient all-reduce: with the same batch on both,
  the gradients differ, and their mean is closer to the uncompressed gradient than
  either replica's alone (with one seed for both it would be no closer).
"""
from __future__ import annotations

import warnings

import pytest
import torch

from tests import testing as T

pytestmark = pytest.mark.dist

REPLICATED = ("input_layernorm.weight", "pre_mlp_layernorm.weight")


def _worker(rank, world, port, mode):
    warnings.filterwarnings("ignore")
    import torch.distributed as dist

    from llm_act import ActConfig
    from llm_act.runtime import agreement
    from llm_act.runtime.seeds import DP_SEED_STRIDE, codec_seed
    from llm_act.patches.megatron import apply
    from tests import gpt_runs as R

    T.init_parallel(tp=2 if mode == "tp" else 1, rank=rank, world_size=world, port=port)
    dp_rank = rank if mode == "dp" else 0
    assert agreement.data_parallel_rank() == dp_rank
    ref = R.build(dropout=0.0, seed=0)
    _, ref_grads, _ = R.step(ref)
    model = R.build(dropout=0.0, seed=0)
    ctl = apply(model, ActConfig(plan="compress"))
    codec = ctl.codec(0, "ln1.input")
    assert codec.seed == codec_seed(1234, 0, "ln1.input", dp_rank) == \
        1234 + DP_SEED_STRIDE * dp_rank + codec_seed(0, 0, "ln1.input", 0)
    _, grads, _ = R.step(model)
    names = [n for n in grads if n.endswith(REPLICATED)]
    assert names, "no norm weights found"
    flat = torch.cat([grads[n].reshape(-1) for n in names])
    ref_flat = torch.cat([ref_grads[n].reshape(-1) for n in names])
    assert not torch.equal(flat, ref_flat)  # compressed: the rounding did something
    both = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(both, flat)
    if mode == "tp":
        assert torch.equal(both[0], both[1]), "TP ranks' replicated gradients differ"
        return
    assert not torch.equal(both[0], both[1]), "DP replicas drew the same rounding"
    one = [float((g - ref_flat).norm()) for g in both]
    mean = float(((both[0] + both[1]) / 2 - ref_flat).norm())
    # with one seed both would be equal and the mean no better; independent rounding noise
    # halves its variance (the deterministic part, few-bit levels and scales, stays): 0.87-0.9
    assert mean < 0.95 * min(one), (mean, one)


@pytest.mark.parametrize("mode", ["tp", "dp"])
def test_codec_seeds_agree_within_a_replica_and_differ_across_replicas(mode):
    T.spawn(_worker, 2, mode, timeout=240)
