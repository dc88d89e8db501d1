"""The README's Megatron-LM recipe, applied to a copy of a Megatron-LM checkout's scripts.

`write_recipe(checkout, out)` copies `pretrain_gpt.py` and `model_provider.py` of the
checkout (tag core_v0.16.1) into `out` with the README's additions, and `command(...)`
builds the torchrun line for a tiny GPT on mock data over gloo; `run` runs it and `losses`
reads Megatron-LM's loss lines. Each edit must match the
checkout's text exactly once, so a checkout of another version fails here, by name,
instead of running without the recipe. Shared by the slow test and docs/megatron_lm.md.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys
import sysconfig
from pathlib import Path

from llm_act.train import parallel

#: (file, stock text, text with the recipe) -- the README's additions, in order
EDITS = (
    ("pretrain_gpt.py", "from model_provider import model_provider\n",
     "from model_provider import model_provider\n"
     "import llm_act.cpu\n"
     "from llm_act.patches.megatron import add_arguments\n"
     "llm_act.cpu.install(megatron_lm=True)  # CPU only; a no-op on a GPU\n"),
    ("pretrain_gpt.py", "extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,",
     "extra_args_provider=add_arguments,"),
    ("model_provider.py", "    return model_builder(args, pre_process, post_process, vp_stage, "
                          "config=config, pg_collection=pg_collection)\n",
     "    model = model_builder(args, pre_process, post_process, vp_stage, "
     "config=config, pg_collection=pg_collection)\n"
     "    from llm_act.patches.megatron import apply, config_from_args\n"
     "    act_config = config_from_args(args)  # None unless --act-compress\n"
     "    if act_config is not None:\n"
     "        model.act_controller = apply(model, act_config)\n"
     "    return model\n"),
)


def write_recipe(checkout: Path, out: Path) -> None:
    texts: dict[str, str] = {}
    for name, old, new in EDITS:
        text = texts.get(name) or (Path(checkout) / name).read_text()
        if text.count(old) != 1:
            raise ValueError(f"{checkout}/{name}: expected {old.strip()!r} once "
                             f"(is the checkout at tag core_v0.16.1?)")
        texts[name] = text.replace(old, new)
    for name, text in texts.items():
        (Path(out) / name).write_text(text)


def environment(checkout: Path) -> dict[str, str]:
    """The run's environment: the checkout on PYTHONPATH (after what is there), one thread
    per rank, and make told the interpreter's extension suffix, so Megatron-LM's dataset
    helpers (built by `pretrain()` on rank 0) are built for this Python even where the
    `python3-config` on PATH belongs to another one."""
    path = os.pathsep.join(p for p in (str(checkout), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1",
                MAKEFLAGS=f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}")


def run(checkout: Path, out: Path, timeout: float = 900, **kwargs) -> subprocess.CompletedProcess:
    """`command(out, **kwargs)` in `out`, stdout and stderr together."""
    return subprocess.run(command(out, **kwargs), cwd=out, env=environment(checkout), text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=timeout)


_LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?lm loss: ([0-9.Ee+-]+)")


def losses(log: str) -> dict[int, float]:
    """Megatron-LM's `lm loss` per iteration, from its training log lines."""
    return {int(it): float(v) for it, v in _LOSS.findall(log)}


def command(out: Path, nproc: int, tp: int = 1, pp: int = 1, iters: int = 5,
            compress: bool = False, extra: tuple = ()) -> list[str]:
    """torchrun over gloo for a 4-layer GPT (hidden 64) on mock data, fp32, logging every
    iteration; no lr warm-up, so the first step's (compressed) gradient already moves the
    weights; `compress` adds `--act-compress` (plan "auto")."""
    args = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={nproc}",
        "--master_port", str(parallel.free_port()), str(Path(out) / "pretrain_gpt.py"),
        "--distributed-backend", "gloo", "--transformer-impl", "local",
        "--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp),
        "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
        "--seq-length", "64", "--max-position-embeddings", "64",
        "--micro-batch-size", "2", "--global-batch-size", "4",
        "--train-iters", str(iters), "--lr", "1e-3", "--min-lr", "1e-4",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1024",
        "--split", "100,0,0", "--eval-iters", "0", "--eval-interval", "1000",
        "--log-interval", "1", "--seed", "1234",
        "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
        "--no-bias-gelu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion",
        "--no-persist-layer-norm", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    ]
    if compress:
        args.append("--act-compress")
    return args + list(extra)
