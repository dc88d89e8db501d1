"""Codec bandwidth: encode+decode bytes moved per second, as a fraction of a plain copy.

The copy bandwidth is measured in the same process on a tensor of the same size (bytes
read + bytes written), so the fraction is a ratio taken side by side. A codec's encode
reads x and writes the record; decode reads the record and writes x. On a GPU the Triton
kernels run; on CPU the torch references (`--quick` sizes), which is only a smoke check.
"""
from __future__ import annotations

import torch

from llm_act.bench.timing import machine_line, median_ms
from llm_act.codecs import make_codec

DEFAULT_CODECS = ("int8", "int4", "int2", "int4_channel", "outlier_int4", "dual2",
                  "fp8_e4m3", "fp8_e5m2", "fewbit3", "bitmask")


def _input(name: str, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if name == "bitmask":
        return (torch.rand(shape, device=device) > 0.1).to(dtype)
    return torch.randn(shape, device=device, dtype=dtype)


def run(size_mib: float = 256.0, dtype: torch.dtype = torch.bfloat16, codecs=DEFAULT_CODECS,
        device: str | None = None, repeat: int = 5) -> tuple[str, list[dict]]:
    """Measure every codec; returns (machine line, rows)."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    hidden = 4096
    numel = int(size_mib * 2**20) // torch.tensor([], dtype=dtype).element_size()
    rows_ = max(1, numel // hidden)
    shape = (rows_, hidden)
    x = torch.randn(shape, device=dev, dtype=dtype)
    y = torch.empty_like(x)
    copy_ms = median_ms(lambda: y.copy_(x), dev, repeat=repeat)
    nbytes = x.numel() * x.element_size()
    copy_gbs = 2 * nbytes / copy_ms / 1e6
    out = []
    for name in codecs:
        codec = make_codec(name, activation="gelu")
        xin = _input(name, shape, dtype, dev)
        enc = codec.encode(xin)
        enc_ms = median_ms(lambda: codec.encode(xin), dev, repeat=repeat)
        dec_ms = median_ms(lambda: codec.decode(enc), dev, repeat=repeat)
        moved = 2 * (nbytes + enc.nbytes)  # encode: read x, write record; decode: the reverse
        gbs = moved / (enc_ms + dec_ms) / 1e6
        out.append({
            "codec": name, "bits_per_element": round(enc.bits_per_element(), 3),
            "encode_ms": enc_ms, "decode_ms": dec_ms, "GB/s": gbs, "of_copy": gbs / copy_gbs,
        })
    header = f"{machine_line(dev)}; tensor {shape} {str(dtype).replace('torch.', '')} " \
             f"({nbytes / 2**20:.0f} MiB); copy {copy_gbs:.1f} GB/s"
    return header, out


def table(header: str, rows: list[dict]) -> str:
    lines = [header, "",
             "| codec | bits/elem | encode ms | decode ms | GB/s | fraction of copy |",
             "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['codec']} | {r['bits_per_element']:.3f} | {r['encode_ms']:.3f} | "
                     f"{r['decode_ms']:.3f} | {r['GB/s']:.1f} | {r['of_copy']:.2f} |")
    return "\n".join(lines)
