"""Every Triton kernel compiles for sm_90 (H100) without a GPU (issue 26): no register
spills, and the main stream (an encode's input load, a decode's output store) moves
vectors (`ld.global.v2/.v4`, `st.global.v2/.v4`), the two things a CPU run cannot see
otherwise. One subprocess (TRITON_INTERPRET=0) compiles all kernels: about 25 s of CPU."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.kernels.sm90_compile import is_vectorised, kernel_ids
from tests.kernels.sm90_kernels import CONFIGS, NOT_VECTORISED_YET

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]
KERNELS = sorted(set(kernel_ids()) | set(CONFIGS))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("sm90") / "kernels.json"
    proc = subprocess.run([sys.executable, "-m", "tests.kernels.sm90_compile", str(out)],
                          cwd=ROOT, env={**os.environ, "TRITON_INTERPRET": "0"},
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def _result(compiled, kernel):
    assert kernel in CONFIGS, f"{kernel} has no compile configuration in sm90_kernels.CONFIGS"
    assert kernel in kernel_ids(), f"{kernel} is configured but no longer exists"
    result = compiled[kernel]
    assert "error" not in result, result["error"]
    return result


def test_not_vectorised_yet_names_configured_kernels():
    assert set(NOT_VECTORISED_YET) <= set(CONFIGS), set(NOT_VECTORISED_YET) - set(CONFIGS)


@pytest.mark.parametrize("kernel", KERNELS)
def test_compiles_without_spills(compiled, kernel):
    r = _result(compiled, kernel)
    assert r["cubin_bytes"] > 0 and r["regs"] is not None, "no cubin or no ptxas report"
    assert (r["spill_stores"], r["spill_loads"]) == (0, 0), \
        f"{kernel} spills: {r['spill_stores']} B stored, {r['spill_loads']} B loaded " \
        f"({r['regs']} registers)"


@pytest.mark.parametrize("kernel", KERNELS)
def test_main_stream_is_vectorised(compiled, kernel):
    r = _result(compiled, kernel)
    stream = CONFIGS[kernel].stream
    assert r["stream"], f"no global access found for {stream!r}: wrong pointer in the config?"
    if kernel in NOT_VECTORISED_YET:
        assert not is_vectorised(r["stream"]), \
            f"{kernel} vectorises now ({r['stream']}): drop it from NOT_VECTORISED_YET"
    else:
        assert is_vectorised(r["stream"]), \
            f"{kernel}'s main stream {stream!r} is not all vector accesses: {r['stream']}"
