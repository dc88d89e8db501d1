"""What the adaptive controller does over a short CPU training run of a tiny GPT.

    python launch/adapt_demo.py --steps 200

Trains a 2-layer megatron-core GPT (hidden 64, sequence 32, batch 4, dropout 0.1) on a
synthetic copy task with plan "auto", printing every tracking iteration, every plan change
(the controller's one-line log) and a summary: when it tracked, what changed, the measured
sensitivities, the predicted noise against the sampling noise. The budget is the CPU
default (static + the "compress" plan's memory) unless `--budget` is given.
"""
from __future__ import annotations

import argparse
import logging
import time
import warnings
from typing import Optional

import torch

from llm_act import cpu
from llm_act.plan import describe
from llm_act.train import parallel, small_gpt


def _batch(gen: torch.Generator, batch: int, seq: int, vocab: int):
    """A copy task: the second half of each sequence repeats the first."""
    half = torch.randint(0, vocab, (batch, seq // 2 + 1), generator=gen)
    ids = torch.cat([half, half], dim=1)[:, : seq + 1]
    pos = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    return ids[:, :-1].contiguous(), pos, ids[:, 1:].contiguous()


def run(steps: int = 200, budget: Optional[str] = None, interval_max: int = 64, seed: int = 0,
        layers: int = 2, quiet: bool = False) -> dict:
    """Train and return {"controller", "losses", "seconds"}."""
    from llm_act import ActConfig
    from llm_act.patches.megatron import apply

    warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
    cpu.install()  # the demo owns its process: megatron-core on CPU needs the stand-ins
    parallel.init_parallel(tp=1, seed=seed)
    torch.manual_seed(seed)
    vocab, seq, batch = 128, 32, 4
    cfg = small_gpt.small_config(num_layers=layers, dropout=0.1)
    model = small_gpt.gpt_model(cfg, vocab_size=vocab, max_sequence_length=seq)
    config = ActConfig(plan="auto", budget=budget, adapt_interval_max=interval_max, seed=seed + 1234)
    controller = apply(model, config)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gen = torch.Generator().manual_seed(seed + 1)
    losses = []
    start = time.perf_counter()
    for step in range(steps):
        ids, pos, labels = _batch(gen, batch, seq, vocab)

        def probe(ids=ids, pos=pos, labels=labels):
            return model(ids, pos, None, labels=labels)

        with controller.step(probe=probe):
            loss = model(ids, pos, None, labels=labels).float().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(float(loss))
        if not quiet and controller.adapter.tracked and controller.adapter.tracked[-1] == controller.iteration:
            a = controller.adapter
            ratio = "n/a" if a.noise_ratio is None else f"{a.noise_ratio:.3g}"
            print(f"tracked at iteration {controller.iteration}: loss {losses[-1]:.3f}, "
                  f"next at {a.next_track}, noise/sampling {ratio}, "
                  f"c {({k: float(f'{v:.2g}') for k, v in a.last.get('c', {}).items()})}, "
                  f"outlier rates {({k: round(v, 3) for k, v in a.last.get('outlier', {}).items()})}")
    seconds = time.perf_counter() - start
    parallel.destroy_parallel()
    return {"controller": controller, "losses": losses, "seconds": seconds}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--budget", default=None, help="device budget, e.g. 2MB (default: the CPU default)")
    p.add_argument("--interval-max", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    out = run(args.steps, args.budget, args.interval_max, args.seed, args.layers)
    c = out["controller"]
    a = c.adapter
    print(f"\n{args.steps} steps in {out['seconds']:.1f} s; loss {out['losses'][0]:.3f} -> {out['losses'][-1]:.3f}")
    print(f"tracking iterations: {a.tracked}")
    print(f"budget: {a.budget} bytes; plan changes: {len(a.history)}")
    for h in a.history:
        print(f"  it {h['iteration']}: {h['changes']} | {h['predicted_bytes'] / 2**20:.3f} MiB, "
              f"{h['overhead_ms']:.3f} ms | {h['reason']}")
    print("sensitivity c_i:", {k: float(f"{v:.3g}") for k, v in a.measured.sensitivity.items()})
    print("final plan:\n" + describe(c.plan))


if __name__ == "__main__":
    main()
