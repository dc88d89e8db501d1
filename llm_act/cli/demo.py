"""`llm-act demo`: every default codec on the activations of one real GPT block, in seconds.

Builds one stock megatron-core `TransformerLayer` on CPU, runs forward + backward on random
input, captures the tensor at every site of the design brief (by module hooks on the stock
modules), encodes each with its default codec (the "compress" plan, Adacc sec. 3.2) and prints,
per site, the bytes stock stores, the bytes the codec stores and the round-trip error. For
`mlp.act_input` the few-bit codec stores f'(x), so its error is measured against gelu'(x).
"""
from __future__ import annotations

import torch

from llm_act import cpu
from llm_act.codecs import make_codec
from llm_act.codecs.fewbit import derivative
from llm_act.sites import BLOCK, DEFAULT_CODECS
from llm_act.train import parallel, small_gpt

def _capture_table() -> dict[str, tuple[str, str]]:
    """site -> (module path inside a TransformerLayer, which tensor of the call), from the
    schema: a site's first input tag, else the output of the module that makes it. The
    dense block's value sites only (no masks, attention internals, qk-norm or MoE), and the
    final norm's input (`Site.scope` "model"), which is a layer's output (path "")."""
    out = {}
    for site in BLOCK:
        if site.scope == "model":
            out[site.name] = ("", "out")
            continue
        if site.family not in ("block", "qkv", "dense_mlp"):
            continue
        tag = next((t for t in site.tags if t.how == "input"), None)
        if tag is not None:
            out[site.name] = (tag.slot, f"in{tag.arg}")
        elif site.made_by is not None:
            out[site.name] = (site.made_by, "out_plus_bias")
    return out


_CAPTURE = _capture_table()


def capture_sites(layer: torch.nn.Module, hidden: torch.Tensor, mask=None) -> dict[str, torch.Tensor]:
    """Run `layer` forward+backward on `hidden` and return {site: tensor} for the captured sites."""
    got: dict[str, torch.Tensor] = {}
    handles = []

    def hook(site: str, which: str):
        def fn(module, args, kwargs, output):
            if which.startswith("in"):
                tensors = list(args) + [kwargs[k] for k in ("query", "key", "value") if k in kwargs]
                got[site] = tensors[int(which[2:])].detach().clone()
            elif which == "out":  # the layer's hidden-state output (TransformerLayer: (hidden, context))
                got[site] = (output[0] if isinstance(output, tuple) else output).detach().clone()
            else:
                out, bias = output if isinstance(output, tuple) else (output, None)
                got[site] = (out if bias is None else out + bias).detach().clone()
        return fn

    for site, (path, which) in _CAPTURE.items():
        handles.append(layer.get_submodule(path).register_forward_hook(hook(site, which), with_kwargs=True))
    try:
        out = layer(hidden, attention_mask=mask)
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().mean().backward()
    finally:
        for h in handles:
            h.remove()
    return got


def measure(site_tensors: dict[str, torch.Tensor], activation: str = "gelu") -> list[dict]:
    """Encode each site's tensor with its default codec; bytes and relative RMS error per site."""
    rows = []
    for site, x in site_tensors.items():
        name = DEFAULT_CODECS[site]
        codec = make_codec(name, activation=activation)
        enc = codec.encode(x)
        y = codec.decode(enc).float()
        ref = derivative(activation)(x.double()).float() if name.startswith("fewbit") else x.float()
        err = ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()
        rows.append({"site": site, "codec": name, "stock_bytes": x.numel() * x.element_size(),
                     "codec_bytes": enc.nbytes, "rel_rms_error": err, "shape": tuple(x.shape)})
    return rows


def run_demo(seq_length: int = 256, micro_batch_size: int = 2, hidden_size: int = 512,
             num_heads: int = 8, bf16: bool = True) -> str:

    dtype = torch.bfloat16 if bf16 else torch.float32
    cpu.install()  # the demo owns its process: megatron-core on CPU needs the stand-ins
    parallel.init_parallel()
    try:
        torch.manual_seed(0)
        cfg = small_gpt.small_config(hidden_size=hidden_size, num_attention_heads=num_heads,
                                     num_layers=1, dtype=dtype, add_bias_linear=True)
        layer = small_gpt.transformer_layer(cfg)
        hidden = torch.randn(seq_length, micro_batch_size, hidden_size, dtype=dtype, requires_grad=True)
        rows = measure(capture_sites(layer, hidden))
    finally:
        parallel.destroy_parallel()
    sbh = seq_length * micro_batch_size * hidden_size
    lines = [
        f"llm_act demo: one megatron-core GPT layer on CPU, s={seq_length} b={micro_batch_size} "
        f"h={hidden_size} a={num_heads} {str(dtype).replace('torch.', '')}; every site at its "
        "default codec (the 'compress' plan)",
        "",
        f"{'site':<16} {'codec':<13} {'stock B/sbh':>11} {'ours B/sbh':>10} {'saved':>7} {'rel err':>8}",
    ]
    tot_s = tot_c = 0
    for r in rows:
        tot_s += r["stock_bytes"]
        tot_c += r["codec_bytes"]
        lines.append(f"{r['site']:<16} {r['codec']:<13} {r['stock_bytes'] / sbh:>11.3f} "
                     f"{r['codec_bytes'] / sbh:>10.3f} {1 - r['codec_bytes'] / r['stock_bytes']:>6.1%} "
                     f"{r['rel_rms_error']:>8.4f}")
    lines.append(f"{'total':<16} {'':<13} {tot_s / sbh:>11.3f} {tot_c / sbh:>10.3f} "
                 f"{1 - tot_c / tot_s:>6.1%}")
    lines.append("")
    lines.append(f"saved {(tot_s - tot_c) / 2**20:.2f} MiB of {tot_s / 2**20:.2f} MiB at these sites "
                 f"({tot_s / max(tot_c, 1):.1f}x smaller); dropout masks use 'regen' (0 bytes per element). "
                 "rel err = ||decode - x|| / ||x|| (for mlp.act_input: against gelu'(x)).")
    return "\n".join(lines)
