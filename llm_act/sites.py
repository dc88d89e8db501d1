"""Names of the tensors a GPT block saves for backward (part of the public API).

Names may grow; once written they stay. `ln1.input` is the block's checkpoint: it may be
kept or compressed but never recomputed.
"""
from __future__ import annotations

SITES: tuple[str, ...] = (
    "ln1.input",
    "attn.qkv_input",
    "attn.q",
    "attn.k",
    "attn.v",
    "attn.softmax",
    "attn.dropout_mask",
    "attn.out",
    "attn.hidden_dropout_mask",
    "ln2.input",
    "mlp.fc1_input",
    "mlp.act_input",
    "mlp.fc2_input",
    "mlp.hidden_dropout_mask",
)

MASK_SITES: frozenset[str] = frozenset(
    {"attn.dropout_mask", "attn.hidden_dropout_mask", "mlp.hidden_dropout_mask"}
)

#: Counted by the ledger outside the blocks, not planned.
OUTER_SITES: tuple[str, ...] = ("embedding.output", "embedding.dropout_mask", "loss.logits")

#: The "compress" plan (Adacc sec. 3.2): layer-specific default codec per site.
DEFAULT_CODECS: dict[str, str] = {
    "ln1.input": "outlier_int4",
    "attn.qkv_input": "outlier_int4",
    "attn.q": "int4_channel",
    "attn.k": "int4_channel",
    "attn.v": "int4_channel",
    "attn.softmax": "int4_asym",
    "attn.dropout_mask": "regen",
    "attn.out": "outlier_int4",
    "attn.hidden_dropout_mask": "regen",
    "ln2.input": "outlier_int4",
    "mlp.fc1_input": "outlier_int4",
    "mlp.act_input": "fewbit3",
    "mlp.fc2_input": "outlier_int4",
    "mlp.hidden_dropout_mask": "regen",
}


def check_site(site: str) -> str:
    if site not in SITES:
        raise ValueError(f"unknown site {site!r}; known sites: {', '.join(SITES)}")
    return site
