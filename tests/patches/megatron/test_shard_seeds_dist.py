"""Codec seeds of tensor-parallel shards (2 gloo processes, a real megatron-core GPT at
TP=2, dropout 0, both ranks fed the same batch, stochastic int4 at the sites named below).

The rounding error of a site is `decode(encode(x)) - x`, recorded at every encode of both
layers. Two ranks that hold different data but draw the same uniforms have correlated
errors (0.5 in theory: (1[u < f] - f) for two independent fractions f and one u; 0.49
measured on a GPT's shards), so their noise adds up coherently in the gradient instead of
averaging out. With seeds equal only where the tensor is replicated (`sites.TP_LAYOUT`,
`seeds.codec_seed`):

- without sequence parallelism, the replicated sites (norm and column-parallel linear
  inputs) round identically on both ranks (bit-equal errors: the norms' weight gradients
  stay bit-identical, see test_replica_seeds_dist), while the TP-partitioned sites (the
  ranks' heads, hidden and MLP slices) are uncorrelated;
- with sequence parallelism, the token shards at the formerly replicated sites are
  uncorrelated too.
Measured (rank 0 prints them; the old seeds, equal on both TP ranks everywhere, in
brackets): |corr| <= 0.04 at every site, 0.039 at worst (SP ln2.input) [0.46-0.50 at
every partitioned site and SP shard: attn.out 0.46, mlp.fc2_input 0.49, SP ln1.input 0.49].
"""
from __future__ import annotations

import warnings

import pytest
import torch

from tests import testing as T

#: replicated on the TP ranks without sequence parallelism, token shards under it
SP_SITES = ("ln1.input", "attn.qkv_input", "ln2.input", "mlp.fc1_input")
#: split over the TP ranks either way (heads, hidden slice, MLP slices)
PARTITIONED = ("attn.q", "attn.out", "mlp.act_input", "mlp.fc2_input")
BOUND = 0.1


def _record(ctl, sites):
    """site -> list of flattened rounding errors, one per encode of that site (any layer)."""
    errors = {site: [] for site in sites}
    for layer in ctl.layers:
        for site in sites:
            codec = ctl.codec(layer, site)
            assert codec is not None and codec.name == "int4", (layer, site, codec)

            def encode(x, _encode=codec.encode, _codec=codec, _out=errors[site]):
                enc = _encode(x)
                _out.append((_codec.decode(enc).float() - x.detach().float()).reshape(-1))
                return enc

            codec.encode = encode
    return errors


def _both_ranks(errors):
    """site -> (rank 0's errors, rank 1's errors), each concatenated over its encodes."""
    import torch.distributed as dist

    out = {}
    for site, parts in errors.items():
        assert parts, f"{site}: never encoded"
        mine = torch.cat(parts)
        both = [torch.empty_like(mine) for _ in range(2)]
        dist.all_gather(both, mine)
        out[site] = both
    return out


def _corr(a, b) -> float:
    return float(torch.corrcoef(torch.stack([a.double(), b.double()]))[0, 1])


def _run(sequence_parallel: bool):
    from llm_act import ActConfig
    from llm_act.patches.megatron import apply, block_spec
    from tests import gpt_runs as R

    sites = SP_SITES + PARTITIONED
    config = ActConfig(plan="keep", codecs={site: "int4" for site in sites})
    if sequence_parallel:
        sp = dict(sequence_parallel=True, tensor_model_parallel_size=2)
        spec = block_spec(config, T.small_config(dropout=0.0, **sp))
        model = R.build(dropout=0.0, spec=spec, **sp)
    else:
        model = R.build(dropout=0.0)
    ctl = apply(model, config)
    errors = _record(ctl, sites)
    R.step(model)
    return ctl, _both_ranks(errors)


def _worker(rank, world, port):
    warnings.filterwarnings("ignore")
    from llm_act.runtime.seeds import TP_SEED_STRIDE, codec_seed

    T.init_parallel(tp=2, rank=rank, world_size=world, port=port)
    seeds, measured = {}, {}
    ctl, plain = _run(sequence_parallel=False)
    for site in SP_SITES + PARTITIONED:
        seeds[site] = ctl.codec(1, site).seed
        if site in PARTITIONED:
            measured[site] = _corr(*plain[site])
    ctl, sp = _run(sequence_parallel=True)
    # a restart computes the same seeds: every saved stream comes back, none is "foreign"
    notes = ctl.load_state_dict(ctl.state_dict())
    assert notes[1] == f"act codecs: restored the random streams of {2 * len(SP_SITES + PARTITIONED)} codecs", notes
    for site in SP_SITES + PARTITIONED:
        seeds[f"sp {site}"] = ctl.codec(1, site).seed
        measured[f"sp {site}"] = _corr(*sp[site])
    if rank == 0:
        print("\nrounding-error correlation between the TP ranks:",
              ", ".join(f"{k} {v:+.3f}" for k, v in measured.items()))
    bad = {k: round(v, 3) for k, v in measured.items() if abs(v) >= BOUND}
    assert not bad, f"TP shards' rounding errors correlate: {bad}"
    for site in SP_SITES:  # replicated without SP: same seed, same data, same rounding
        assert torch.equal(plain[site][0], plain[site][1]), f"{site}: TP ranks rounded differently"
        assert seeds[site] == codec_seed(1234, 1, site, 0, tp_rank=0)
    for key, seed in seeds.items():
        if key.startswith("sp ") or key in PARTITIONED:
            site = key.removeprefix("sp ")
            assert seed == codec_seed(1234, 1, site, 0, tp_rank=0) + TP_SEED_STRIDE * rank, key


@pytest.mark.dist
def test_tp_shards_draw_independent_rounding_and_replicas_equal():
    T.spawn(_worker, 2, timeout=240)


def test_tp_layout_table():
    from llm_act.runtime.seeds import TP_SEED_STRIDE, codec_seed
    from llm_act.sites import SITES, TP_LAYOUT, tp_replicated

    assert set(TP_LAYOUT) == set(SITES)
    replicated = {s for s in SITES if tp_replicated(s, sequence_parallel=False)}
    assert replicated == {"ln1.input", "attn.qkv_input", "attn.hidden_dropout_mask", "ln2.input",
                          "mlp.fc1_input", "mlp.hidden_dropout_mask",
                          "moe.router_input",  # the router reads the norm's output, as fc1 does
                          "final_norm.input"}  # the residual stream after the last block
    assert not any(tp_replicated(s, sequence_parallel=True) for s in SITES)
    # TP rank 0 and replicated sites keep the seeds they had; the others move per TP rank
    for site in SITES:
        base = 1234 + 5 * 1000 + SITES.index(site)
        assert codec_seed(1234, 5, site, 0, tp_rank=0) == base
        for sp in (False, True):
            moved = not tp_replicated(site, sp)
            assert codec_seed(1234, 5, site, 0, tp_rank=3, sequence_parallel=sp) == \
                base + 3 * TP_SEED_STRIDE * moved
    # one process, no tensor parallelism: TP rank 0
    assert codec_seed(1234, 5, "attn.out", 0, sequence_parallel=True) == 1234 + 5000 + SITES.index("attn.out")
    with pytest.raises(ValueError, match="unknown site"):
        tp_replicated("attn.nope", False)
