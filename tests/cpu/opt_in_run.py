"""Run by tests/cpu/test_opt_in.py in a fresh process, so that no earlier
`llm_act.cpu.install()` leaks in: what `init_parallel`, `layer_spec` and `apply` do on a
CPU-only host without the stand-ins, then the same after `llm_act.cpu.install()`.

    python -m tests.cpu.opt_in_run

prints one JSON object: case -> "ok", "ok <loss>" or "<ExceptionType>: <message>", and the
megatron-core objects carrying the shim's mark before and after the install.
"""
from __future__ import annotations

import json
import logging
import sys
import warnings

import torch


def patched() -> list[str]:
    """megatron-core (and torch) objects the CPU shim has marked."""
    from llm_act.cpu.stand_ins import MARK

    names = [name for name, mod in list(sys.modules.items())
             if name.startswith("megatron") and getattr(vars(mod).get("torch"), MARK, False)]
    random = sys.modules["megatron.core.tensor_parallel.random"]
    moe_utils = sys.modules.get("megatron.core.transformer.moe.moe_utils")
    for label, obj in (("CudaRNGStatesTracker.fork", random.CudaRNGStatesTracker.__dict__["fork"]),
                       ("_get_cuda_rng_state", random._get_cuda_rng_state),
                       ("maybe_move_tensor_to_cpu", getattr(moe_utils, "maybe_move_tensor_to_cpu", None)),
                       ("torch.nn.Module.cuda", torch.nn.Module.cuda)):
        if getattr(obj, MARK, False):
            names.append(label)
    return sorted(names)


def outcome(fn) -> str:
    try:
        result = fn()
    except Exception as err:  # the case's answer, reported to the test
        return f"{type(err).__name__}: {err}"
    return "ok" if result is None else f"ok {result}"


def main() -> dict:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch.distributed as dist

    from llm_act import cpu
    from llm_act.patches.megatron import apply, layer_spec
    from llm_act.train import parallel
    from tests import testing as T

    out: dict = {}

    def model(pe="learned_absolute", spec=None, **cfg):
        torch.manual_seed(0)
        return T.gpt_model(T.small_config(**cfg), position_embedding_type=pe, spec=spec)

    def train(m, plan, **act):
        apply(m, {"plan": plan, **act})
        ids, pos, labels = T.gpt_batch(2, 16, generator=torch.Generator().manual_seed(1))
        loss = m(ids, pos, None, labels=labels).float().mean()
        loss.backward()
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in m.parameters())
        return f"{loss.item():.6f}"

    moe = dict(num_moe_experts=4, moe_router_topk=2, add_bias_linear=False)

    def moe_spec():
        return T.local_layer_spec(num_experts=4, moe_grouped_gemm=False)

    out["init_parallel"] = outcome(lambda: parallel.init_parallel(seed=1234))
    out["init_parallel started gloo"] = dist.is_initialized()
    # one gloo rank and megatron's parallel state, without seeding the RNG tracker
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{parallel.free_port()}",
                            rank=0, world_size=1)
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(1, 1)

    out["dense compress"] = outcome(lambda: train(model(), "compress"))
    out["dense layer_spec"] = outcome(
        lambda: train(model(spec=layer_spec({"plan": "compress"})), "compress"))
    out["dense keep sdpa"] = outcome(lambda: train(model(), "keep", attention="sdpa"))
    out["moe compress"] = outcome(lambda: train(model(spec=moe_spec(), **moe), "compress"))
    out["dense hidden dropout"] = outcome(lambda: train(model(hidden_dropout=0.1), "compress"))
    rope = model(pe="rope")
    out["rope"] = outcome(lambda: train(rope, "compress"))
    out["rope converted"] = type(rope.decoder.layers[0].self_attention.core_attention).__name__
    out["keep"] = outcome(lambda: train(model(), "keep"))
    out["recompute"] = outcome(lambda: train(model(), "recompute"))
    out["attention dropout"] = outcome(lambda: train(model(attention_dropout=0.1), "compress"))
    out["moe keep"] = outcome(lambda: train(model(spec=moe_spec(), **moe), "keep", attention="sdpa"))
    alltoall = T.small_config(moe_token_dispatcher_type="alltoall", **moe)
    out["layer_spec alltoall"] = outcome(lambda: layer_spec(
        {"plan": "compress"}, alltoall, num_experts=4, moe_grouped_gemm=False) and None)
    out["patched before install"] = patched()

    out["install"] = cpu.install()
    out["installed"] = cpu.installed()
    out["patched after install"] = patched()
    out["init_parallel installed"] = outcome(lambda: parallel.init_parallel(seed=1234))
    out["dense compress installed"] = outcome(lambda: train(model(), "compress"))
    out["rope installed"] = outcome(lambda: train(model(pe="rope"), "compress"))
    out["keep installed"] = outcome(lambda: train(model(), "keep"))
    out["recompute installed"] = outcome(lambda: train(model(), "recompute"))
    dist.destroy_process_group()
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
