"""Gradient error of the two backwards for lossy Q/K/V, on a real megatron-core layer (CPU).

    .venv/bin/python tools/attention_backward_error.py [--s 256] [--seeds 3] [--time]

With codecs at `attn.q/k/v` (and `attn.out`), the core attention's backward either
recomputes out and logsumexp from the decoded Q/K/V ("recompute", consistent with them) or
runs only the attention backward from the stored output and the forward's logsumexp
("stored", exact from the true Q/K; the output is the projection's, encoded when
`attn.out` is). For each, the relative L2 error of dq, dk, dv (the core attention's input
gradients) and of the layer's input gradient against the exact gradient (the same layer,
same backend, nothing encoded), mean over seeds. "sharp" multiplies the QKV weights by 3
(attention logits x9): the peaked attention of a trained model, where the uniform
attention at initialisation hides errors in P. `--time` adds the attention's backward time
(CPU) of both paths, and the FLOPs the stored path saves.
"""
from __future__ import annotations

import argparse
import math
import time
import warnings

import torch

warnings.filterwarnings("ignore")

QKV = ("attn.q", "attn.k", "attn.v")
CODEC_SETS = [  # (label, q/k/v codec, attn.out codec)
    ("int4_channel, out keep", "int4_channel", None),
    ("int4_channel, out outlier_int4", "int4_channel", "outlier_int4"),
    ("fp8_e4m3, out keep", "fp8_e4m3", None),
    ("fp8_e4m3, out fp8_e4m3", "fp8_e4m3", "fp8_e4m3"),
]


def build(s, h, a, groups, dropout, dtype, sharp):
    from llm_act.patches.megatron.swap import convert_layer
    from llm_act.train.small_gpt import small_config, transformer_layer
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    cfg = small_config(num_layers=1, hidden_size=h, num_attention_heads=a,
                               num_query_groups=groups, dropout=dropout, dtype=dtype,
                               add_bias_linear=True)
    torch.manual_seed(0)
    layer = transformer_layer(cfg).to(dtype)
    if sharp != 1.0:
        with torch.no_grad():
            layer.self_attention.linear_qkv.weight.mul_(sharp)
    sites = convert_layer(layer, 0, attention=True)
    layer.self_attention.core_attention.set_attention_mode("auto")
    emb = RotaryEmbedding(kv_channels=h // a, rotary_percent=1.0, use_cpu_initialization=True)(s)
    return layer, sites, emb


def run(layer, emb, x, seed):
    """(dq, dk, dv, dx) of one forward/backward, all RNG reseeded (same dropout masks)."""
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    torch.manual_seed(seed)
    model_parallel_cuda_manual_seed(seed)
    layer.zero_grad(set_to_none=True)
    x = x.detach().clone().requires_grad_(True)
    got = []

    def grab(module, args):
        for t in args[:3]:
            t.retain_grad()
        got.extend(args[:3])

    hook = layer.self_attention.core_attention.register_forward_pre_hook(grab)
    try:
        out = layer(x, attention_mask=None, rotary_pos_emb=emb)[0]
    finally:
        hook.remove()
    gy = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 100)).to(out.dtype)
    out.backward(gy)
    return [t.grad.detach().double() for t in got] + [x.grad.detach().double()]


def rel(a, b):
    return float((a - b).norm() / b.norm())


def set_codecs(sites, qkv, out, seed):
    from llm_act.codecs import make_codec

    for s in QKV:
        sites[s].set_act_codec(s, None if qkv is None else make_codec(qkv, seed=seed + QKV.index(s)))
    sites["attn.out"].set_act_codec("attn.out", None if out is None else make_codec(out, seed=seed + 7))


def errors(args):
    from llm_act import cpu
    from llm_act.train import parallel

    cpu.install()
    parallel.init_parallel(tp=1)
    rows = []
    for dropout in (0.0, 0.1):
        for sharp in (1.0, 3.0):
            for dtype in args.dtypes:
                layer, sites, emb = build(args.s, args.h, args.a, args.groups, dropout, dtype, sharp)
                core = layer.self_attention.core_attention
                for label, qkv, out in CODEC_SETS:
                    acc = {m: [0.0] * 4 for m in ("recompute", "stored")}
                    for seed in range(args.seeds):
                        x = torch.randn(args.s, args.b, args.h,
                                        generator=torch.Generator().manual_seed(1000 + seed)).to(dtype)
                        set_codecs(sites, None, None, 0)
                        exact = run(layer, emb, x, seed)
                        for mode in acc:
                            core.set_lossy_backward(mode)
                            set_codecs(sites, qkv, out, 10 * seed)
                            got = run(layer, emb, x, seed)
                            for i in range(4):
                                acc[mode][i] += rel(got[i], exact[i]) / args.seeds
                        core.set_lossy_backward("auto")
                    rows.append((dropout, sharp, str(dtype).replace("torch.", ""), label, acc))
    parallel.destroy_parallel()
    head = f"{'drop':>4} {'sharp':>5} {'dtype':>8}  {'codecs (q/k/v, out)':31s}  {'path':9s}" \
           f" {'dq':>8} {'dk':>8} {'dv':>8} {'dx':>8}   stored/recompute (dq dk dv dx)"
    print(head)
    print("-" * len(head))
    for dropout, sharp, dt, label, acc in rows:
        for mode in ("recompute", "stored"):
            e = acc[mode]
            ratio = ""
            if mode == "stored":
                ratio = "  " + " ".join(f"{a / b:5.3f}" for a, b in zip(e, acc["recompute"]))
            print(f"{dropout:4.1f} {sharp:5.1f} {dt:>8}  {label:31s}  {mode:9s}"
                  + "".join(f" {v:8.5f}" for v in e) + ratio)


def timing(args):
    """The attention Function alone (CPU, one thread): backward time of each path (the two
    interleaved, best of `repeats`), and the FLOPs the stored path saves."""
    from llm_act.attention import attention

    torch.set_num_threads(1)
    s, b, a, d = args.time_s, args.b, args.a, args.h // args.a
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, b, a, d, generator=g).requires_grad_() for _ in range(3))
    dout = torch.randn(q.shape, generator=g)
    codecs = {site: "int4_channel" for site in QKV}
    print(f"\nattention alone, s={s} b={b} heads={a} d={d}, causal, fp32, CPU, 1 thread; "
          "int4_channel at q/k/v; backward time, best of "
          f"{args.repeats} (the paths interleaved)")
    for backend, p in (("sdpa", 0.0), ("chunked", 0.1)):
        best = {"recompute": math.inf, "stored": math.inf}
        for _ in range(args.repeats):
            for mode in best:
                out = attention(q, k, v, True, p, backend=backend, codecs=codecs,
                                generator=torch.Generator().manual_seed(1), lossy_backward=mode)
                t0 = time.perf_counter()
                torch.autograd.grad(out, (q, k, v), dout)
                best[mode] = min(best[mode], time.perf_counter() - t0)
        print(f"  {backend:7s} p={p:.1f}  recompute {best['recompute'] * 1e3:8.1f} ms   stored "
              f"{best['stored'] * 1e3:8.1f} ms   stored/recompute "
              f"{best['stored'] / best['recompute']:.3f}")
    fwd = 2 * 2 * b * a * s * s * d / 2  # QK^T and PV, causal half
    print(f"  FLOPs per layer (causal): forward 4*b*h*s^2*d/2 = {fwd / 1e9:.2f} GFLOP, backward "
          f"(5 matmuls) {2.5 * fwd / 1e9:.2f} GFLOP: recompute runs {3.5 * fwd / 1e9:.2f}, stored "
          f"{2.5 * fwd / 1e9:.2f} ({1 / 3.5:.0%} less)")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--s", type=int, default=256)
    ap.add_argument("--b", type=int, default=2)
    ap.add_argument("--h", type=int, default=512)
    ap.add_argument("--a", type=int, default=8)
    ap.add_argument("--groups", type=int, default=None, help="K/V groups (GQA); default: heads")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--bf16", action="store_true", help="also run the layers in bf16")
    ap.add_argument("--time", action="store_true")
    ap.add_argument("--time-s", type=int, default=512)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-errors", action="store_true")
    args = ap.parse_args()
    args.dtypes = [torch.float32] + ([torch.bfloat16] if args.bf16 else [])
    if not args.no_errors:
        errors(args)
    if args.time:
        timing(args)


if __name__ == "__main__":
    main()
