"""Compile every Triton kernel of `llm_act.kernels` for sm_90 on a machine without a GPU.

`python -m tests.kernels.sm90_compile OUT.json` (with TRITON_INTERPRET=0: the kernels must
be real JITFunctions) compiles each kernel of `sm90_kernels.CONFIGS` with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))` in a fresh Triton cache
(so ptxas really runs), and writes per kernel: registers and spill bytes from ptxas's
report, and the global accesses of the main stream found in the PTX. `kernel_ids()` lists
the kernels by reading the sources, without importing triton.
"""
from __future__ import annotations

import ast
import contextlib
import importlib
import io
import json
import os
import re
import sys
import tempfile
import time
from pathlib import Path

KERNELS_DIR = Path(__file__).resolve().parents[2] / "llm_act" / "kernels"


def _is_jit(decorator) -> bool:
    node = decorator.func if isinstance(decorator, ast.Call) else decorator
    return isinstance(node, ast.Attribute) and node.attr == "jit"


def kernel_ids() -> list[str]:
    """"module._name_kernel" for every @triton.jit `_*_kernel` in kernels/*_triton.py."""
    ids = []
    for path in sorted(KERNELS_DIR.glob("*_triton.py")):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.FunctionDef) and node.name.startswith("_")
                    and node.name.endswith("_kernel") and any(map(_is_jit, node.decorator_list))):
                ids.append(f"{path.stem}.{node.name}")
    return ids


# ---- PTX: which global accesses go through a given kernel parameter ------------------------
_REG = re.compile(r"%[A-Za-z]+\d+")
_GLOBAL = re.compile(r"\b(ld|st)\.global\S*")


def _instructions(ptx: str) -> list[str]:
    body = ptx[ptx.index("{", ptx.index(".entry")):]
    out = []
    for line in body.splitlines():
        line = line.split("//")[0].strip()
        if line and not line.startswith((".", "{", "}", "$")):
            out.append(re.sub(r"^@!?%\w+\s+", "", line))
    return out


def stream_accesses(ptx: str, kernel: str, param: int, kind: str) -> list[str]:
    """Opcodes ("ld.global.v4.b32", ...) of the `kind` ("ld"/"st") global accesses whose
    address derives from parameter `param` (register dataflow; a loaded value starts no
    chain, so a gather through an index does not count)."""
    insts = _instructions(ptx)
    tainted: set[str] = set()
    source = f"[{kernel}_param_{param}]"
    changed = True
    while changed:  # to a fixpoint: loops carry addresses backwards in the text
        changed = False
        for inst in insts:
            op = inst.split()[0]
            if op.startswith("ld.param") and source in inst.replace(" ", ""):
                dst = _REG.findall(inst)[0]
            elif op.startswith(("ld.", "st.", "atom.", "red.")):
                continue
            else:
                regs = _REG.findall(inst)
                if len(regs) < 2 or not tainted.intersection(regs[1:]):
                    continue
                dst = regs[0]
            if dst not in tainted:
                tainted.add(dst)
                changed = True
    found = []
    for inst in insts:
        m = _GLOBAL.search(inst)
        if m and m.group(1) == kind:
            address = inst[inst.index("["):inst.index("]")]
            if tainted.intersection(_REG.findall(address)):
                found.append(m.group(0))
    return found


# ---- compile ---------------------------------------------------------------------------------
_PTXAS = {"regs": r"Used (\d+) registers", "spill_stores": r"(\d+) bytes spill stores",
          "spill_loads": r"(\d+) bytes spill loads", "stack": r"(\d+) bytes stack frame"}


def compile_one(kernel_id: str, config) -> dict:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.compiler import ASTSource
    from triton.runtime.jit import native_specialize_impl

    from llm_act.kernels import EXACT_LAUNCH

    module, name = kernel_id.split(".")
    fn = getattr(importlib.import_module(f"llm_act.kernels.{module}"), name)
    declared = set(config.args) | set(config.constexprs)
    if declared != set(fn.arg_names):
        return {"error": f"the config lacks {sorted(set(fn.arg_names) - declared)} and has "
                         f"{sorted(declared - set(fn.arg_names))} the kernel does not take"}
    signature, constexprs, attrs = {}, dict(config.constexprs), {}
    for i, arg in enumerate(fn.arg_names):
        value = config.args.get(arg)
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif isinstance(value, str):  # a pointer, 16-byte aligned as torch allocates
            signature[arg] = value
            attrs[(i,)] = [["tt.divisibility", 16]]
        else:  # a scalar: specialised as the runtime would
            ty, spec = native_specialize_impl(CUDABackend, value, False, True, True)
            signature[arg] = ty
            if ty == "constexpr":
                constexprs[arg] = spec
            elif spec:
                attrs[(i,)] = CUDABackend.parse_attr(spec)
    log = io.StringIO()
    t0 = time.time()
    with contextlib.redirect_stdout(log):
        compiled = triton.compile(ASTSource(fn, signature, constexprs, attrs),
                                  target=GPUTarget("cuda", 90, 32),
                                  options={**EXACT_LAUNCH, **config.options})
    result = {"seconds": round(time.time() - t0, 2), "cubin_bytes": len(compiled.asm["cubin"])}
    for key, pattern in _PTXAS.items():
        m = re.search(pattern, log.getvalue())
        result[key] = int(m.group(1)) if m else None
    kind, pointer = config.stream.split()
    params = [a for a in fn.arg_names if signature[a] != "constexpr"]
    result["stream"] = stream_accesses(compiled.asm["ptx"], name, params.index(pointer), kind)
    return result


def is_vectorised(stream: list[str]) -> bool:
    """Every main-stream access moves a vector (.v2 / .v4) per thread."""
    return bool(stream) and all(re.search(r"\.v[24]\.", op) for op in stream)


def table(results: dict) -> str:
    rows = ["| kernel | registers | spill st/ld B | main stream accesses | vectorised |",
            "|---|---:|---:|---|---|"]
    for kernel_id, r in results.items():
        if "error" in r:
            rows.append(f"| {kernel_id} | error | | {r['error'][:80]} | |")
            continue
        kinds = sorted(set(r["stream"]), key=r["stream"].index)
        ops = ", ".join(f"{r['stream'].count(k)}x {k}" for k in kinds)
        rows.append(f"| {kernel_id} | {r['regs']} | {r['spill_stores']}/{r['spill_loads']} | "
                    f"{ops} | {'yes' if is_vectorised(r['stream']) else 'no'} |")
    return "\n".join(rows)


def main(out_path: str) -> None:
    from tests.kernels.sm90_kernels import CONFIGS

    results = {}
    for kernel_id, config in CONFIGS.items():
        try:
            results[kernel_id] = compile_one(kernel_id, config)
        except Exception as e:  # noqa: BLE001  (reported per kernel by the test)
            results[kernel_id] = {"error": f"{type(e).__name__}: {e}"[:4000]}
    Path(out_path).write_text(json.dumps(results, indent=1))
    print(table(results))


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        sys.exit("run with TRITON_INTERPRET=0: the interpreter's kernels cannot compile")
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # ptxas's -v report, printed to stdout
    with tempfile.TemporaryDirectory(prefix="sm90-cache-") as cache:
        os.environ["TRITON_CACHE_DIR"] = cache  # a fresh cache: ptxas runs for every kernel
        main(sys.argv[1])
