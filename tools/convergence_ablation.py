"""One convergence run of the bench's GPT (`llm_act.bench.convergence`, 300 steps) with the
"compress" plan changed at some sites, to find which sites a loss gap comes from.

    python tools/convergence_ablation.py SEED VARIANT

VARIANT: compress (the default plan), masks-only (regen masks and our attention, every value
kept), keep-linear-inputs (norm and linear inputs kept), keep-act (mlp.act_input kept),
keep-qkv (attn.q/k/v kept), int4-qkv / int8-qkv (attn.q/k/v stochastic per-group INT4 / INT8).
Prints the validation loss every 30 steps; compare with `stock seed SEED` of
`llm-act bench convergence` (same initial weights and batches). About 4 minutes on 2 cores.
"""
from __future__ import annotations

import sys
import warnings

LINEAR_INPUTS = ("ln1.input", "attn.qkv_input", "attn.out", "ln2.input", "mlp.fc1_input", "mlp.fc2_input")
QKV = ("attn.q", "attn.k", "attn.v")


def variant_choice(variant: str) -> dict[str, str]:
    from llm_act.sites import DEFAULT_CODECS, MASK_SITES

    choice = dict(DEFAULT_CODECS)
    changes = {
        "compress": {},
        "masks-only": {s: ("regen" if s in MASK_SITES else "keep") for s in choice},
        "keep-linear-inputs": {s: "keep" for s in LINEAR_INPUTS},
        "keep-act": {"mlp.act_input": "keep"},
        "keep-qkv": {s: "keep" for s in QKV},
        "int4-qkv": {s: "int4" for s in QKV},
        "int8-qkv": {s: "int8" for s in QKV},
    }
    if variant not in changes:
        raise SystemExit(f"variant: expected one of {', '.join(changes)}, got {variant!r}")
    choice.update(changes[variant])
    return choice


def main(argv: list[str]) -> None:
    if len(argv) != 2:
        raise SystemExit(__doc__)
    seed, variant = int(argv[0]), argv[1]
    warnings.filterwarnings("ignore")
    from llm_act.bench import convergence as C, memory as M
    from llm_act.train import parallel
    from llm_act.train.data import embedded_corpus
    from llm_act.train.loop import quiet_megatron_warnings

    quiet_megatron_warnings()
    scheme = M.Scheme(variant, "", variant_choice(variant), attention="auto", convert_attention=True)
    parallel.init(C.train_args(300, seed, False))
    try:
        run = C.train_one(scheme, 300, 30, seed, False, embedded_corpus())
    finally:
        parallel.destroy_parallel()
    print(f"{variant} seed {seed}: final {run['valid'][-1]:.4f}; every 30 steps "
          + " ".join(f"{v:.4f}" for v in run["valid"]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
