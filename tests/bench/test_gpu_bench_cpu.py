"""`llm_act.bench.gpu` end to end on CPU: a tiny GPT, every scheme, the largest-micro-batch
search, the tables, the target lines and the files. The numbers mean nothing on CPU; what is
checked is the logic a device run depends on. CPU has no peak-memory counter, so a step's
memory is the SavedTensorLedger's bytes held at the end of forward (the bench says so), and
`capacity_bytes` stands in for the card: a step above it fails as an out-of-memory would.
"""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from llm_act.bench import gpu as G  # noqa: E402

SHAPE = G.GpuShape(layers=2, hidden=32, heads=2, seq=16, vocab=64)


@pytest.fixture(scope="module")
def result():
    # the card: room for stock at micro-batch 2 and a bit more (found by a first sweep's
    # ledger bytes, which grow linearly in the micro-batch size)
    probe = G.run(SHAPE, device="cpu", sizes=(1,), repeat=0, schemes=(G.STOCK,))
    stock1 = probe["rows"][0]["mem_bytes"]
    cap = int(stock1 * 2.5)
    return G.run(SHAPE, device="cpu", sizes=(1, 2), repeat=1, capacity_bytes=cap, max_mbs=4), cap


def test_every_scheme_measured_with_ledger_bytes(result):
    res, cap = result
    assert res["memory_kind"] == "ledger" and res["capacity"] == cap
    for name in G.SCHEMES:
        rows = [r for r in res["rows"] if r["scheme"] == name]
        assert rows, name
        for r in rows:
            if r["fits"]:
                assert r["tokens_per_s"] > 0 and 0 < r["mem_bytes"] <= cap, r


def test_auto_budget_is_full_recomputes_measured_memory(result):
    """"ours auto @ full memory" plans with the budget = full recompute's measured bytes at
    the same micro-batch size (here the ledger's; on a GPU the cuda peak)."""
    res, _ = result
    by = {(r["scheme"], r["mbs"]): r for r in res["rows"]}
    for m in (1, 2):
        full = by[(G.FULL, m)]
        assert full["fits"]
        auto = by[(G.AUTO_AT_FULL, m)]
        assert auto["budget"] == full["mem_bytes"]
        assert 0 <= auto["static"] <= auto["budget"]
        if auto["fits"]:
            assert auto["plan"] and set(auto["plan"]) >= {"ln1.input", "mlp.fc1_input"}


def test_largest_search_doubles_then_bisects(result):
    res, cap = result
    found = res["largest"]
    assert set(found) == set(G.SCHEMES) - {G.AUTO_AT_FULL}
    st = found[G.STOCK]
    assert st["exact"] and st["failed"] == st["mbs"] + 1  # bisected to the edge
    assert 2 <= st["mbs"] < 4
    # full recompute stores less per sample than stock: it fits at least as many
    assert G.largest(res, G.FULL) >= G.largest(res, G.STOCK)
    assert G.largest(res, G.COMPRESS) >= G.largest(res, G.STOCK)


def test_table_targets_and_files(result, tmp_path):
    from llm_act.bench import kernels

    res, _ = result
    header, krows = kernels.run(size_mib=0.25, device="cpu", codecs=("int8", "outlier_int4"), repeat=1)
    text = G.markdown(res, krows, header)
    for name in G.SCHEMES:
        assert f"| {name} |" in text, name
    assert "Throughput against stock" in text and "Throughput against megatron full" in text
    assert "SavedTensorLedger's bytes" in text
    lines = G.targets(res, krows)
    assert len(lines) == 5
    for line, what in zip(lines, ("ours at full recompute's memory", "our largest micro-batch",
                                  "keep >= 0.98x stock", "compress >= 0.9x stock",
                                  "kernels >= 85% of copy")):
        assert what in line and line.split(":")[0] in ("- PASS", "- FAIL", "- n/a"), line
        assert line in text
    assert G.targets(res)[4].startswith("- n/a")
    paths = G.save(res, str(tmp_path), text, krows)
    assert (tmp_path / "gpu.md").read_text().strip() == text.strip()
    data = json.loads((tmp_path / "gpu.json").read_text())
    assert {r["scheme"] for r in data["rows"]} == set(G.SCHEMES)
    assert (tmp_path / "gpu_throughput.png").stat().st_size > 0 and paths["png"].endswith(".png")


def test_time_budget_skips_and_still_tables():
    res = G.run(SHAPE, device="cpu", sizes=(1,), repeat=0, time_budget_s=0.0)
    assert res["rows"] == [] and len(res["skipped"]) == len(G.SCHEMES)
    assert "Not measured (time budget)" in G.table(res)


@pytest.mark.gpu
def test_cuda_branch_on_a_tiny_gpt():
    """The same logic on CUDA (run by tools/gpu_suite.sh's gpu tests): peak memory from
    `torch.cuda.max_memory_allocated`, the auto budget = full recompute's measured peak, and
    the largest-micro-batch search against an emulated small card (no real OOM needed)."""
    shape = G.GpuShape(layers=2, hidden=256, heads=4, seq=256, vocab=512)
    res = G.run(shape, device="cuda", sizes=(1, 2), repeat=2, max_mbs=8, isolate=False)
    assert res["memory_kind"] == "cuda peak" and res["card"] > 0
    by = {(r["scheme"], r["mbs"]): r for r in res["rows"]}
    for name in G.SCHEMES:
        assert by[(name, 1)]["fits"] or name == G.AUTO_AT_FULL, name
    for m in (1, 2):
        assert by[(G.AUTO_AT_FULL, m)]["budget"] == by[(G.FULL, m)]["mem_bytes"] > 0
    assert all(G.largest(res, s) == 8 for s in (G.STOCK, G.FULL))  # capped: the card is huge
    assert len(G.targets(res)) == 4


def test_each_scheme_in_its_own_process_measures_the_same(result):
    """`isolate=True` (the CUDA default: what one scheme leaves on the card must not decide
    the next one's numbers) runs each scheme in a spawned process; the ledger's bytes, the
    fits, the largest micro-batch and the auto budget (full recompute's measured memory,
    handed from one child to the next) are the in-process run's."""
    res, cap = result
    schemes = (G.STOCK, G.FULL, G.AUTO_AT_FULL)
    iso = G.run(SHAPE, device="cpu", sizes=(1, 2), repeat=0, capacity_bytes=cap, max_mbs=4,
                schemes=schemes, isolate=True)
    key = lambda rows: [(r["scheme"], r["mbs"], r["fits"], r.get("mem_bytes"), r.get("budget"))  # noqa: E731
                        for r in rows if r["scheme"] in schemes]
    assert key(iso["rows"]) == key(res["rows"]) and len(key(iso["rows"])) == 6
    assert {s: iso["largest"][s] for s in (G.STOCK, G.FULL)} == {s: res["largest"][s] for s in (G.STOCK, G.FULL)}
    assert iso["static"] == res["static"]
