"""The converted megatron-core GPT the measurement tests run on: one fixture, `gpt`, which a
test module tunes with its `gpt` mark (declared in pyproject.toml) instead of building a model
of its own.

    pytestmark = [pytest.mark.usefixtures("megatron_one_rank"), pytest.mark.gpt(dropout=0.1)]
"""
from __future__ import annotations

import pytest

from tests import gpt_runs as R


@pytest.fixture(scope="module")
def gpt(request, megatron_one_rank):
    """(model, controller, forward): a 2-layer GPT converted by `apply` under plan "compress"
    and one forward over one fixed batch, built once per test module as its `gpt` mark says:
    `dropout` (hidden and attention, default 0), `batch_size` (default `gpt_runs.BATCH`), and
    any further `ActConfig` field (`attention="chunked"`, ...)."""
    from llm_act import ActConfig
    from llm_act.patches.megatron import apply

    mark = request.node.get_closest_marker("gpt")
    options = dict(mark.kwargs) if mark is not None else {}
    dropout, batch_size = options.pop("dropout", 0.0), options.pop("batch_size", R.BATCH)
    model = R.build(dropout=dropout, num_layers=2)
    controller = apply(model, ActConfig(plan="compress", **options))
    ids, pos, labels = R.batch(1, batch_size=batch_size)
    return model, controller, lambda: model(ids, pos, None, labels=labels)
