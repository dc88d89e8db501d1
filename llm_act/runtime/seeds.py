"""The codecs' seeds: stable across runs, restarts and plan switches, and equal only where the
stored tensor is equal.

One job: where a codec's random stream starts (`codec_seed`: per layer, site, data-parallel
replica and tensor-parallel rank; `replica_seed`: the replica's own range). Apart from the
`Controller`, which builds the plan's codecs with these seeds, because more than it builds
codecs: the generic path's checkpoint and hooks and the memory bench seed theirs alike, and the
seeds are checked without a controller.
"""
from __future__ import annotations

from typing import Optional

from llm_act.runtime.agreement import data_parallel_rank, tensor_parallel_rank
from llm_act.sites import SITES, tp_replicated

#: distance between the codec seeds of consecutive layers (more than the number of sites)
SEED_STRIDE = 1000
#: distance between the codec seeds of data-parallel replicas (more than any layer count's)
DP_SEED_STRIDE = 10_000_000
#: distance between the codec seeds of tensor-parallel ranks at a site whose stored tensor
#: differs across them (more than any data-parallel replica's offset, below 100 000 replicas)
TP_SEED_STRIDE = 1_000_000_000_000


def replica_seed(base: int, dp_rank: Optional[int] = None) -> int:
    """`base` moved to this data-parallel replica's own range (`dp_rank` default: this
    process's, from `agreement.data_parallel_rank`). Replicas see different data, and with
    different stochastic-rounding draws their compression noise is independent, so it
    averages out in the gradient all-reduce instead of adding up coherently. TP ranks of a
    replica share it; `codec_seed` moves it apart again wherever they store different data."""
    if dp_rank is None:
        dp_rank = data_parallel_rank()
    return int(base) + DP_SEED_STRIDE * int(dp_rank)


def codec_seed(base: int, layer: int, site: str, dp_rank: Optional[int] = None,
               tp_rank: Optional[int] = None, sequence_parallel: bool = False) -> int:
    """The seed of the codec at (layer, site): stable across runs, restarts and plan
    switches (it depends on nothing else). Equal only where the stored tensor is equal:

    - per data-parallel replica (`replica_seed`);
    - per tensor-parallel rank (`tp_rank` default: this process's, from
      `agreement.tensor_parallel_rank`) wherever the TP ranks store different data: their
      heads or hidden slice, and under `sequence_parallel` their token shard at every site
      (`sites.tp_replicated`), so the shards' rounding noise is independent;
    - the same on every TP rank of a replica where they all store the same tensor (the
      norms' and column-parallel linears' inputs without sequence parallelism): the
      replicated parameters' gradients (the norms' weights), which each rank computes from
      its own copy, stay bit-identical across the ranks.

    TP rank 0 keeps the seeds it had before the TP offset existed."""
    seed = replica_seed(base, dp_rank) + SEED_STRIDE * int(layer) + SITES.index(site)
    if tp_replicated(site, sequence_parallel):
        return seed
    if tp_rank is None:
        tp_rank = tensor_parallel_rank()
    return seed + TP_SEED_STRIDE * int(tp_rank)
