"""Each codec's encode and decode on the Triton path are (close to) one pass over memory
(issue 26): bytes moved near the floor of reading the input once and writing the record
once, little re-reading inside the kernels, at most two kernels a GPU would run and no
host sync. Measured on CPU under the interpreter by `tests.kernels.traffic`."""
import math
import os

import pytest

from tests.kernels.traffic import CODECS, SHAPE, describe, run_codec
from tests.no_syncs import force_triton

pytest.importorskip("triton")
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="counts the Triton interpreter's loads and stores")

#: total bytes / one-pass minimum (read x once + write Encoded.nbytes once; decode reversed)
ENCODE_TOTAL, DECODE_TOTAL = 1.15, 1.05
#: kernel bytes loaded by all lanes / distinct bytes loaded (re-reads, gathers)
ENCODE_LANE, DECODE_LANE = 1.2, 1.5
#: Triton launches + non-view torch ops, per encode and per decode
MAX_STEPS = 2
LIMITS = {"encode": (ENCODE_TOTAL, ENCODE_LANE), "decode": (DECODE_TOTAL, DECODE_LANE)}


@pytest.fixture(scope="module")
def measured():
    """codec name -> run_codec's figures, each codec run once for both phases."""
    runs = {}

    def get(name):
        if name not in runs:
            runs[name] = run_codec(name)
        return runs[name]

    with pytest.MonkeyPatch.context() as mp:
        force_triton(mp)
        yield get


@pytest.mark.parametrize("phase", ["encode", "decode"])
@pytest.mark.parametrize("name", CODECS)
def test_one_pass(measured, name, phase):
    t, minimum = measured(name)[phase]
    total_limit, lane_limit = LIMITS[phase]
    wrong = []
    if t.syncs:
        wrong.append(f"{len(t.syncs)} host syncs")
    if t.steps > MAX_STEPS:
        wrong.append(f"{len(t.launches)} launches + {len(t.ops)} torch ops > {MAX_STEPS}")
    if t.total > total_limit * minimum:
        wrong.append(f"total {t.total / minimum:.2f}x the one-pass minimum > {total_limit}")
    if t.lane_read > lane_limit * t.kernel_read:
        wrong.append(f"lane reads {t.lane_read / t.kernel_read:.2f}x unique > {lane_limit}")
    assert not wrong, f"{name} {phase}: " + "; ".join(wrong) + "\n" + describe(
        t, math.prod(SHAPE))
