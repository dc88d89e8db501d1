"""The "no GPU-only semantics" rule of `llm_act.kernels`, checked on the kernel sources.

Under the interpreter every float operation is numpy's (correctly rounded, never fused), so
bit-for-bit tests cannot see a `/` that a GPU compiles to approximate division, nor an
FMA contraction. These checks read the @triton.jit functions instead: a float division of
run-time values must be `tl.math.div_rn`, and the int-quant decode does no per-element
integer division. (`enable_fp_fusion=False` at every launch is checked by the
several-programs test of each family, through the `grids` fixture.)
"""
import ast
import pathlib

import pytest

pytest.importorskip("triton")

import llm_act.kernels as kernels  # noqa: E402

SOURCES = sorted(pathlib.Path(kernels.__file__).parent.glob("*_triton.py"))


def _jit_functions(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and any(
                "jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def _compile_time(expr) -> bool:
    """Only literals and UPPER_CASE names (constexprs): folded by Python, exactly."""
    return all(n.id.isupper() for n in ast.walk(expr) if isinstance(n, ast.Name)) and not any(
        isinstance(n, (ast.Call, ast.Attribute, ast.Subscript)) for n in ast.walk(expr))


def test_sources_found():
    assert {p.name for p in SOURCES} >= {"int_quant_triton.py", "fp8_triton.py",
                                         "outlier_triton.py", "dual_triton.py"}


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: p.name)
def test_no_run_time_float_division(path):
    bad = [f"{path.name}:{n.lineno} {fn.name}: {ast.unparse(n)}"
           for fn in _jit_functions(path) for n in ast.walk(fn)
           if isinstance(n, ast.BinOp) and isinstance(n.op, ast.Div) and not _compile_time(n)]
    assert not bad, "use tl.math.div_rn (a GPU's `/` is approximate):\n" + "\n".join(bad)


def test_int_quant_decode_has_no_per_element_division():
    path = next(p for p in SOURCES if p.name == "int_quant_triton.py")
    fns = {fn.name: fn for fn in _jit_functions(path)}
    for name in ("_decode_groups_kernel", "_decode_axis_kernel"):
        ops = [ast.unparse(n) for n in ast.walk(fns[name]) if isinstance(n, ast.BinOp)
               and isinstance(n.op, (ast.FloorDiv, ast.Mod)) and not _compile_time(n)]
        assert not ops, (name, ops)
