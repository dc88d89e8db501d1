"""The README's Megatron-LM recipe, applied to a copy of a Megatron-LM checkout's scripts.

`write_recipe(checkout, out)` copies the checkout's top-level scripts (`pretrain_gpt.py`,
`model_provider.py`, `gpt_builders.py`, ...) into `out`, with the README's additions, and
`command(...)` builds the torchrun line for a tiny GPT on mock data over gloo; `run` runs it
and `losses` reads Megatron-LM's loss lines. Each edit must match the checkout's text
exactly once, so a checkout of another layout fails here, by name, instead of running
without the recipe. Shared by the slow test and docs/megatron_lm.md.

Two layouts, told apart by what `pretrain_gpt.py` contains (tested at tags core_v0.16.1 and
core_r0.19.0): up to 0.16 `pretrain(...)` builds the model through `model_provider.py`
(`partial(model_provider, gpt_builder)`), so the controller is attached there; from 0.19 on
`pretrain_gpt.py` hands `pretrain()` a config container (`gpt_config_from_args`,
`pretrain_cfg_container_from_args`) whose model builder never calls `model_provider.py`, so
the controller goes in through the model config's `pre_wrap_hooks` (each model chunk, before
DDP, where 0.16 attached it). `extra_args_provider=add_arguments` goes where the script names
`extra_args_provider` (0.16: `pretrain(...)`, 0.19: `parse_and_validate_args(...)`).
"""
from __future__ import annotations

import filecmp
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

from llm_act.train import parallel

#: the model edit of a checkout whose `pretrain_gpt.py` builds the model from a config
#: container (0.19): a pre-wrap hook on the model config attaches the controller to each chunk
_PRE_WRAP_HOOK = (
    "pretrain_gpt.py", "    full_config = pretrain_cfg_container_from_args(args, model_cfg)\n",
    "    from llm_act.patches.megatron import apply, config_from_args\n"
    "    act_config = config_from_args(args)  # None unless --act-compress\n"
    "    if act_config is not None:\n"
    "        def act_compress(chunks):\n"
    "            for chunk in chunks:\n"
    "                chunk.act_controller = apply(chunk, act_config)\n"
    "            return chunks\n"
    "        model_cfg.pre_wrap_hooks.append(act_compress)\n"
    "    full_config = pretrain_cfg_container_from_args(args, model_cfg)\n")

#: the model edit of a checkout whose `pretrain()` calls `model_provider.py` (0.16)
_MODEL_PROVIDER = (
    "model_provider.py", "    return model_builder(args, pre_process, post_process, vp_stage, "
                         "config=config, pg_collection=pg_collection)\n",
    "    model = model_builder(args, pre_process, post_process, vp_stage, "
    "config=config, pg_collection=pg_collection)\n"
    "    from llm_act.patches.megatron import apply, config_from_args\n"
    "    act_config = config_from_args(args)  # None unless --act-compress\n"
    "    if act_config is not None:\n"
    "        model.act_controller = apply(model, act_config)\n"
    "    return model\n")

#: the README's additions, in order: each a tuple of (file, stock text, text with the
#: recipe) alternatives, of which the first whose stock text the checkout's file holds is
#: applied (the pre-wrap hook before `model_provider.py`: a 0.19 checkout still has the
#: latter's text, in a file its `pretrain_gpt.py` no longer reaches)
EDITS = (
    (("pretrain_gpt.py", "from model_provider import model_provider\n",
      "from model_provider import model_provider\n"
      "import llm_act.cpu\n"
      "from llm_act.patches.megatron import add_arguments\n"
      "llm_act.cpu.install(megatron_lm=True)  # CPU only; a no-op on a GPU\n"),),
    (("pretrain_gpt.py", "extra_args_provider=add_modelopt_args if has_nvidia_modelopt else None,",
      "extra_args_provider=add_arguments,"),),
    (_PRE_WRAP_HOOK, _MODEL_PROVIDER),
)


def write_recipe(checkout: Path, out: Path) -> None:
    checkout, out = Path(checkout), Path(out)
    texts: dict[str, str] = {}
    for choices in EDITS:
        for name, old, new in choices:
            text = texts.get(name) or (checkout / name).read_text()
            if text.count(old) == 1:
                texts[name] = text.replace(old, new)
                break
        else:
            olds = " or ".join(f"{name}: {old.strip()!r}" for name, old, _ in choices)
            raise ValueError(f"{checkout}: expected {olds} once "
                             f"(is the checkout at tag core_v0.16.1 or branch core_r0.19.0?)")
    for script in checkout.glob("*.py"):  # the modules pretrain_gpt.py imports beside it
        if script.name != "setup.py":
            shutil.copyfile(script, out / script.name)
    for name, text in texts.items():
        (out / name).write_text(text)


def _installed_training() -> Path | None:
    """This interpreter's own `megatron/training` (megatron-core's wheel ships it from 0.19
    on), or None."""
    try:
        spec = importlib.util.find_spec("megatron.training")
    except (ImportError, ValueError):
        return None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    return Path(locations[0]) if locations else None


def uses_installed_megatron(checkout: Path) -> bool:
    """True when the installed `megatron.training` is the checkout's, file for file (the
    checkout's own package not being what is found): then the run takes the installed
    megatron (megatron-core and `megatron.training`) and only the checkout's top-level
    scripts, which `write_recipe` copied; otherwise the checkout goes on PYTHONPATH, its
    `megatron` package included (a 0.16 checkout against the 0.16 wheel, which has no
    `megatron.training`)."""
    ours = Path(checkout).resolve() / "megatron" / "training"
    theirs = _installed_training()
    if theirs is None or not ours.is_dir() or theirs.resolve() == ours:
        return False
    files = sorted(p.relative_to(ours) for p in ours.rglob("*.py"))
    return files == sorted(p.relative_to(theirs) for p in theirs.rglob("*.py")) and all(
        filecmp.cmp(ours / f, theirs / f, shallow=False) for f in files)


def environment(checkout: Path) -> dict[str, str]:
    """The run's environment: one thread per rank; the checkout on PYTHONPATH (after what is
    there) unless `uses_installed_megatron(checkout)`; and make told the interpreter's
    extension suffix, so Megatron-LM's dataset helpers (built by `pretrain()` on rank 0 with
    `make -C <megatron/core/datasets>`) are built for this Python even where the
    `python3-config` on PATH belongs to another one.

    The megatron-core wheel ships the built helpers and `helpers.cpp` but no Makefile, so that
    `make` stops ("no makefile found") and `pretrain()` exits; where the installed package lacks
    it, make reads the checkout's (`MAKEFILES`, with its goal `default`), which finds the
    wheel's helpers up to date."""
    extra = [] if uses_installed_megatron(checkout) else [str(checkout)]
    path = os.pathsep.join(p for p in (*extra, os.environ.get("PYTHONPATH", "")) if p)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1",
               MAKEFLAGS=f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}")
    if not extra:
        makefile = Path(checkout) / "megatron" / "core" / "datasets" / "Makefile"
        installed = _installed_training().parent / "core" / "datasets"
        if not (installed / "Makefile").exists() and makefile.exists():
            env["MAKEFILES"] = str(makefile.resolve())
            env["MAKEFLAGS"] += " .DEFAULT_GOAL=default"
    return env


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
