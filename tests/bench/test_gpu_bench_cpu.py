"""`llm_act.bench.gpu` end to end on CPU: a tiny GPT, every scheme (megatron-core's own options
included: its full and selective recompute run here, its offloading is a row saying it needs
CUDA), the largest-micro-batch search, the tables, the target lines and the files. The
numbers mean nothing on CPU; what is checked is the logic a device run depends on. CPU has
no peak-memory counter, so a step's memory is the SavedTensorLedger's bytes held at the end
of forward (the bench says so), and `capacity_bytes` stands in for the card: a step above it
fails as an out-of-memory would.
"""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("megatron.core")

from llm_act.bench import gpu as G  # noqa: E402

SHAPE = G.gpt_shape(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=64)


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
    by = {(r["scheme"], r["mbs"]): r for r in res["rows"]}
    for name in G.SCHEMES:
        rows = [r for r in res["rows"] if r["scheme"] == name]
        assert rows, name
        for r in rows:
            if r["fits"]:
                assert r["tokens_per_s"] > 0 and 0 < r["mem_bytes"] <= cap, r
        if name not in (G.NATIVE_OFFLOAD, *G.AUTOS):
            assert by[(name, 1)]["fits"] and by[(name, 2)]["fits"], name
    # megatron-core's own full and selective recompute run on the local spec; its full
    # recompute keeps only the layers' inputs, less than stock; its selective no more than stock
    assert by[(G.NATIVE_FULL, 2)]["mem_bytes"] < by[(G.STOCK, 2)]["mem_bytes"]
    assert by[(G.NATIVE_SELECTIVE, 2)]["mem_bytes"] <= by[(G.STOCK, 2)]["mem_bytes"]


def test_native_offload_is_a_row_saying_it_needs_cuda(result):
    res, _ = result
    rows = [r for r in res["rows"] if r["scheme"] == G.NATIVE_OFFLOAD]
    assert len(rows) == 1 and not rows[0]["fits"]
    assert rows[0]["note"] == G.OFFLOAD_NEEDS_CUDA and "needs CUDA" in rows[0]["note"]
    assert G.NATIVE_OFFLOAD not in res["largest"]


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


def test_auto_at_native_full_budget_is_its_measured_memory(result):
    """"ours auto @ megatron-core full memory": the budget = megatron-core's own full
    recompute's measured bytes at the same size; static memory estimated from our full
    recompute's, as for "ours auto @ full memory"."""
    res, _ = result
    by = {(r["scheme"], r["mbs"]): r for r in res["rows"]}
    for m in (1, 2):
        native = by[(G.NATIVE_FULL, m)]
        assert native["fits"] and res["measured"][G.NATIVE_FULL][m] == native["mem_bytes"]
        auto = by[(G.AUTO_AT_NATIVE_FULL, m)]
        assert auto["budget"] == native["mem_bytes"]
        assert auto["static"] == min(auto["budget"], res["static"][m])
        if auto["fits"]:
            assert auto["plan"] and set(auto["plan"]) >= {"ln1.input", "mlp.fc1_input"}
    assert res["measured"][G.FULL] == {m: by[(G.FULL, m)]["mem_bytes"] for m in (1, 2)}


def test_largest_search_doubles_then_bisects(result):
    res, cap = result
    found = res["largest"]
    # every scheme but the auto ones (planned per size) and the native offload (needs CUDA)
    assert set(found) == set(G.SCHEMES) - set(G.AUTOS) - {G.NATIVE_OFFLOAD}
    st = found[G.STOCK]
    assert st["exact"] and st["failed"] == st["mbs"] + 1  # bisected to the edge
    assert 2 <= st["mbs"] < 4
    # full recompute stores less per sample than stock: it fits at least as many
    assert G.largest(res, G.FULL) >= G.largest(res, G.STOCK)
    assert G.largest(res, G.COMPRESS) >= G.largest(res, G.STOCK)
    assert G.largest(res, G.NATIVE_FULL) >= G.largest(res, G.STOCK)


def test_table_targets_and_files(result, tmp_path):
    from llm_act.bench import kernels

    res, _ = result
    header, krows = kernels.run(size_mib=0.25, device="cpu", codecs=("int8", "outlier_int4"), repeat=1)
    text = G.markdown(res, krows, header)
    for name in G.SCHEMES:
        assert f"| {name} |" in text, name
    for ref in ("stock", "megatron full", "megatron-core full"):
        assert f"Throughput against {ref} (same" in text, ref
    for auto, src in G.AUTOS.items():
        assert f"{auto}: MILP budget = {src}'s measured memory" in text
    assert "SavedTensorLedger's bytes" in text
    assert "our emulations" in text and "megatron-core's own options" in text
    assert f"(†) {G.NATIVE_OFFLOAD}: {G.OFFLOAD_NEEDS_CUDA}" in text
    assert "FP8GlobalStateManager" in text and "Transformer Engine" in text  # what is not run
    lines = G.targets(res, krows)
    assert len(lines) == 7
    for line, what in zip(lines, (
            "ours at full recompute's memory >= 1.15x its throughput",
            "ours auto at megatron-core full's memory >= 1.15x its throughput",
            "ours auto at megatron-core full's memory >= every native option's throughput at that size",
            "our largest micro-batch", "keep >= 0.98x stock", "compress >= 0.9x stock",
            "kernels >= 85% of copy")):
        assert what in line and line.split(":")[0] in ("- PASS", "- FAIL", "- n/a"), line
        assert line in text
    # both auto schemes ran at both sizes beside what they compare to: no n/a
    assert all(not x.startswith("- n/a") for x in lines[:4]), lines
    assert f"not run at mbs 2: {G.NATIVE_OFFLOAD}" in lines[2]
    assert G.NATIVE_FULL in lines[3] and G.FULL in lines[3]
    assert G.targets(res)[6].startswith("- n/a")
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
    shape = G.gpt_shape(num_layers=2, hidden_size=256, num_attention_heads=4, seq_length=256, vocab_size=512)
    res = G.run(shape, device="cuda", sizes=(1, 2), repeat=2, max_mbs=8, isolate=False)
    assert res["memory_kind"] == "cuda peak" and res["card"] > 0
    by = {(r["scheme"], r["mbs"]): r for r in res["rows"]}
    for name in G.SCHEMES:
        # the native offload runs only where Transformer Engine is installed (megatron-core
        # refuses it otherwise: its row says so)
        assert by[(name, 1)]["fits"] or name in G.AUTOS or name == G.NATIVE_OFFLOAD, name
    off = by[(G.NATIVE_OFFLOAD, 1)]
    assert off["fits"] or off["note"].startswith("error: megatron-core refused it"), off
    for m in (1, 2):
        for auto, src in G.AUTOS.items():
            assert by[(auto, m)]["budget"] == by[(src, m)]["mem_bytes"] > 0
    assert all(G.largest(res, s) == 8 for s in (G.STOCK, G.FULL, G.NATIVE_FULL))  # capped: the card is huge
    assert len(G.targets(res)) == 7


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
