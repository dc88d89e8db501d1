"""Models without megatron-core layers (Hugging Face-style decoders, plain torch blocks).

Such a model has no compressed layers, but it does have repeated blocks (the longest
`ModuleList` of one block class: `model.layers`, `transformer.h`). Each block gets:

- the generic saved-tensor hook path of `llm_act.generic.hooks` (GACT's): everything the block
  saves for backward is encoded with the codec its *site* has in the plan. The site of a
  saved tensor is read from the submodule that saves it: for the Hugging Face families with a
  declared table (`hf_families`: gpt2, llama, mistral, qwen2, qwen3) from that table, and
  inside their attention call q, k, v and the attention's own tensors apart through
  transformers' attention interface (`hf_attention`, which also refuses an attn_implementation
  it cannot book); for any other model from the submodule's name (`q_proj`/`c_attn` ->
  `attn.qkv_input`, `o_proj` -> `attn.out`, `down_proj` -> `mlp.fc2_input`, ...; see
  `SITE_OF`; a Hugging Face model says so in one line). So the block is planned like a
  megatron-core block, by the same
  `Controller`: one `BlockSites` stands for the block's sites in the controller's module
  table and receives the codec instances it picks (their random streams live in the
  controller and its checkpoints). Few-bit codecs need the activation function's own
  backward, so `mlp.act_input` takes a value codec here (`act_activation = None`).
- per-block recompute (Megatron's "full", GACT's CB1) when the config asks for plan
  "recompute": the block keeps only its input (`ln1.input`, kept or encoded) and re-runs
  in backward, through `torch.utils.checkpoint` or, when the DeepSpeed config has
  `"activation_checkpointing"`, through `deepspeed.checkpointing` (see `recompute`). The
  controller's plan shows each such block as `llm_act.plan.recompute_layer(...)` (`ln1.input`
  kept or its codec, every other site "recompute"); `BlockRecompute` binds that choice by
  keeping the block's site hooks off, so the block input is encoded once, by the wrapper.
  Under plan "auto" the planner switches blocks between that and per-site codecs at
  tracking points (`_wrap_switch`, through torch's checkpoint); under another plan it is
  fixed when `apply` runs.
- the output layer and loss of a Hugging Face causal LM called with labels, under
  `output_loss` "chunked" or "auto" (`hf_output`: transformers' loss computed chunk by chunk
  inside the output layer, never holding the logits), as on megatron-core.
- per-site recompute on a family's blocks: `attn.qkv_input` and `mlp.fc1_input`, each a
  norm's output, rebuilt in backward by replaying the norm on its input site's value
  (`hf_replay`), chosen by "auto" or named in `codecs`; every other site recomputes only
  with the whole block.

Never more than stock (`llm_act.generic.hooks`): each saved tensor is encoded in its logical shape
(never as a flat storage buffer), once per storage, and only where its codec's size formula
stores no more than the raw tensor; otherwise it is kept raw and booked at its site
(`GenericModel.declined` tells how much each block kept that way).

Recomputation calls the block's original `forward`, whose submodules are entered through
`__call__`, so ZeRO-3 gathers their parameters again in backward.
"""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from typing import Any, Callable, Iterator, Mapping, Optional

import torch

from llm_act.codecs.base import Codec
from llm_act.codecs.registry import FEWBIT_CODECS, KEEP, MASK_CODECS, RECOMPUTE
from llm_act.config import ActConfig
from llm_act.generic.checkpoint import checkpointed_call
from llm_act.generic.hooks import SavedTensorCompression
from llm_act.layer_contract import LayerBinder
from llm_act.ledger import current_ledger
from llm_act.output.choice import CHUNKED, STOCK
from llm_act.patches.deepspeed import hf_attention, hf_families, hf_output, hf_replay
from llm_act.patches.deepspeed import recompute as recompute_lib
from llm_act.plan import recompute_layer
from llm_act.runtime.controller import Controller
from llm_act.runtime.logs import speaks_for_stage
from llm_act.runtime.seeds import SEED_STRIDE, replica_seed
from llm_act.sites import (
    ATTN_DROPOUT_MASK,
    ATTN_HIDDEN_DROPOUT_MASK,
    ATTN_OUT,
    ATTN_Q,
    ATTN_QKV_INPUT,
    CHECKPOINT_SITE,
    LN2_INPUT,
    MASK_SITES,
    MLP_ACT_INPUT,
    MLP_FC1_INPUT,
    MLP_FC2_INPUT,
    MLP_HIDDEN_DROPOUT_MASK,
    MODEL_SITES,
    MOE_SITES,
    SITES,
)

log = logging.getLogger("llm_act.runtime.controller")

#: last path component of a submodule of a block -> the site of what it saves (models without
#: a declared table: `hf_families.FAMILIES`)
SITE_OF: dict[str, str] = {
    **dict.fromkeys(("input_layernorm", "ln_1", "ln1", "attention_norm", "self_attn_layer_norm",
                     "norm1"), CHECKPOINT_SITE),
    **dict.fromkeys(("q_proj", "k_proj", "v_proj", "qkv_proj", "c_attn", "query_key_value",
                     "Wqkv", "wq", "wk", "wv", "query", "key", "value"), ATTN_QKV_INPUT),
    **dict.fromkeys(("o_proj", "out_proj", "wo", "dense"), ATTN_OUT),
    **dict.fromkeys(("post_attention_layernorm", "ln_2", "ln2", "ffn_norm", "final_layer_norm",
                     "norm2"), LN2_INPUT),
    **dict.fromkeys(("gate_proj", "up_proj", "gate_up_proj", "c_fc", "fc1", "w1", "w3",
                     "dense_h_to_4h"), MLP_FC1_INPUT),
    **dict.fromkeys(("act_fn", "act", "activation_fn", "activation"), MLP_ACT_INPUT),
    **dict.fromkeys(("down_proj", "fc2", "w2", "dense_4h_to_h"), MLP_FC2_INPUT),
    **dict.fromkeys(("attn_dropout", "attention_dropout"), ATTN_DROPOUT_MASK),
    **dict.fromkeys(("resid_dropout",), ATTN_HIDDEN_DROPOUT_MASK),
}
#: containers: what they save themselves (SDPA's q, k, v, out; a gated unit's product inputs)
_ATTENTION = ("self_attn", "attn", "attention", "self_attention")
_MLP = ("mlp", "feed_forward", "ffn")
#: submodule names whose meaning depends on the container (GPT-2's c_proj, dropout)
_BY_PARENT = {("attn", "c_proj"): ATTN_OUT, ("mlp", "c_proj"): MLP_FC2_INPUT,
              ("mlp", "dropout"): MLP_HIDDEN_DROPOUT_MASK}


def site_of(path: str) -> Optional[str]:
    """The site of what the block submodule at `path` (relative to the block) saves."""
    if not path:
        return None
    parts = path.split(".")
    if len(parts) >= 2 and (parts[-2], parts[-1]) in _BY_PARENT:
        return _BY_PARENT[(parts[-2], parts[-1])]
    if parts[-1] in SITE_OF:
        return SITE_OF[parts[-1]]
    if len(parts) == 1 and parts[0] in _ATTENTION:
        return ATTN_Q
    if len(parts) == 1 and parts[0] in _MLP:
        return MLP_ACT_INPUT
    return None


def repeated_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks of the largest `ModuleList` whose children share one class."""
    best: list[torch.nn.Module] = []
    best_size = -1
    for module in model.modules():
        if not isinstance(module, torch.nn.ModuleList) or len(module) == 0:
            continue
        children = list(module)
        if len({type(c) for c in children}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = children, size
    if not best:
        raise ValueError(
            f"model: found no repeated blocks in {type(model).__name__} (a torch.nn.ModuleList "
            "of one block class, like model.layers or transformer.h)"
        )
    return best


class BlockSites:
    """One block's sites as the Controller sees them: it receives the codec per site."""

    #: no few-bit codec at mlp.act_input: the generic path stores the activation's input
    act_activation = None
    #: the block's attention is its own code: what it stores is stock's
    act_attention = None

    def __init__(self, layer: int, sites: tuple[str, ...]):
        self.act_layer = layer
        self.codecs: dict[str, Optional[Codec]] = dict.fromkeys(sites)
        self.stored: set[str] = set()
        """the sites the block's hooks have booked a saved tensor at (a site never booked
        holds nothing: SDPA's `attn.softmax`, a model's missing norm)"""
        self.recomputed: frozenset[str] = frozenset()
        """the sites rebuilt alone in backward under the plan in force (`hf_replay`)"""

    def set_attention_mode(self, mode: str) -> None:
        """Nothing: a generic block's attention is its own code (`layer_contract.SiteModule`)."""

    def set_act_codec(self, site: str, codec: Optional[Codec]) -> None:
        if site not in self.codecs:
            raise ValueError(f"block {self.act_layer} has no site {site!r}")
        if codec is not None and (codec.name in FEWBIT_CODECS or codec.name in MASK_CODECS):
            raise ValueError(f"site {site!r} of a generic block cannot take codec {codec.name!r}")
        self.codecs[site] = codec

    @property
    def compressing(self) -> bool:
        """Whether the block's hooks have anything to do: a site encodes or is rebuilt alone."""
        return bool(self.recomputed) or any(c is not None for c in self.codecs.values())


class BlockRecompute(LayerBinder):
    """How the Controller binds one generic block's {site: choice}: the block's binder in the
    controller's sense (`llm_act.layer_contract.LayerBinder`, the `act_binder` of its
    `BlockSites`, as a megatron-core layer has a `LayerRecompute`), so plans holding
    "recompute" are bound here and never built as codecs.

    A block recomputes as a whole, or single sites of `replays` (a family's norm outputs,
    `hf_replay`), or nothing. Whole, every site but `ln1.input` is rebuilt by re-running the
    block from its input in backward, and `ln1.input` is kept or encoded with its codec
    (`recompute_layer(checkpoint)`; a site the block never stored may say "keep", as a plan
    from a profile that saw nothing there does). Otherwise the sites take their codecs, and
    those of `replays` that say "recompute" are rebuilt from the site their norm reads (which
    then stores a value). Sites the block does not offer (masks, MoE) are not looked at.
    Whether the block can recompute whole:

    - `switchable` (plan "auto"): whatever the plan in force says, changed at any tracking
      point (`recompute_scope` "sites" where the block has `replays`, else "whole"): `bind`
      sets `recompute` and the block input's codec (the controller's instance,
      `checkpoint_codec`), which `_wrap_switch` reads per forward;
    - otherwise fixed by `apply` (`recompute_scope` "fixed"): with `recompute`, the only choice
      bound is `recompute_layer(checkpoint)`, the wrapper `apply` installed encoding the block
      input itself; without, per-site codecs and single sites of `replays`.
    """

    def __init__(self, sites: BlockSites, recompute: bool, checkpoint: str = KEEP, switchable: bool = False,
                 replays: Optional[Mapping[str, torch.nn.Module]] = None):
        self.sites, self.recompute, self.checkpoint = sites, recompute, checkpoint
        self.switchable = switchable
        self.replays: dict[str, torch.nn.Module] = dict(replays or {})
        """site -> the norm that rebuilds it alone (`hf_replay.producers`)"""
        self.checkpoint_codec: Optional[Codec] = None
        """the block input's codec while the block recomputes whole under plan "auto" (None: kept)"""
        sites.act_binder = self  # how the runtime finds it (`layer_contract.binder_of`)

    def codec_names(self, choice: dict[str, str]) -> dict[str, str]:
        """{site: codec name} of the codecs `bind(choice, ...)` needs: a block recomputed
        whole needs the block input's (under plan "auto"; none where `apply` fixed it: its
        wrapper builds its own)."""
        stored, whole = self._checked(choice)
        if whole:
            ckpt = stored.get(CHECKPOINT_SITE, KEEP)
            return {CHECKPOINT_SITE: ckpt} if self.switchable and ckpt != KEEP else {}
        return {s: n for s, n in stored.items() if n not in (KEEP, RECOMPUTE)}

    def bind(self, choice: dict[str, str], codecs: dict[str, Codec]) -> None:
        """Give every site of the block its codec under `choice` (None: kept, or recomputed
        alone or with the whole block)."""
        stored, whole = self._checked(choice)
        if self.switchable:
            self.recompute = whole
            self.checkpoint_codec = codecs.get(CHECKPOINT_SITE) if whole else None
        self.sites.recomputed = frozenset() if whole else frozenset(
            s for s, n in stored.items() if n == RECOMPUTE)
        for site, name in stored.items():
            self.sites.set_act_codec(site, None if whole or name in (KEEP, RECOMPUTE) else codecs[site])

    def mlp_kind(self) -> None:
        """None: llm_act does not know a generic block's MLP (its sites are found by name)."""
        return None

    def recompute_scope(self) -> str:
        """Under plan "auto": "sites" (single sites of `replays`, and the whole block), or
        "whole" for a block without them (whole-block recompute, or none, at any tracking
        point); else "fixed" (as `apply` installed it)."""
        if not self.switchable:
            return "fixed"
        return "sites" if self.replays else "whole"

    def producer(self, site: str) -> Optional[torch.nn.Module]:
        """The norm that rebuilds `site` from its input's value (`hf_replay`); None for every
        other site (the block's ops are its own code: they are recomputed with the whole block)."""
        return self.replays.get(site)

    def model_shape(self, **observed) -> None:
        """None: a generic block has no analytic model (its budget is checked by measurement)."""
        return None

    def _checked(self, choice: dict[str, str]) -> tuple[dict[str, str], bool]:
        """({site: choice} over the block's sites, whether the block recomputes whole)."""
        stored = {s: choice.get(s, KEEP) for s in self.sites.codecs}
        where = f"generic block {self.sites.act_layer}"
        recomputed = sorted(s for s, n in stored.items() if n == RECOMPUTE)
        if not self.switchable and self.recompute:
            whole = recompute_layer(self.checkpoint)
            wrong = {s: n for s, n in stored.items() if n != whole[s]}
            if wrong:
                raise ValueError(
                    f"{where} is recomputed as a whole from {CHECKPOINT_SITE} = {self.checkpoint!r} "
                    f"(plan \"recompute\" when llm_act was applied), which a plan cannot change: "
                    f"got {wrong}")
            return stored, True
        if not recomputed:
            return stored, False
        alone = set(recomputed) <= set(self.replays)
        if self.switchable and not alone:
            # a site the block never stored may say "keep" (the profile saw nothing there)
            holding = self.sites.stored & set(stored) if self.sites.stored else set(stored)
            wrong = {s: stored[s] for s in sorted(holding - {CHECKPOINT_SITE}) if stored[s] != RECOMPUTE}
            if stored.get(CHECKPOINT_SITE) == RECOMPUTE:
                wrong[CHECKPOINT_SITE] = RECOMPUTE
            if not wrong:
                return stored, True
        if not alone:
            how = (f"only {', '.join(sorted(self.replays))} alone (a norm's output, replayed), and every "
                   "other site only with the whole block" if self.replays else "only with the whole block")
            raise ValueError(
                f"{where} cannot recompute {sorted(set(recomputed) - set(self.replays))} alone: it "
                f"recomputes {how}, from its input (every site it stores 'recompute' but {CHECKPOINT_SITE}, "
                "kept or encoded: llm_act.plan.recompute_layer, under plan \"auto\" or \"recompute\")")
        # (a replayed norm's input, ln1.input or ln2.input, is never recomputed alone: it stores a value)
        return stored, False


class _BlockHooks(SavedTensorCompression):
    """The generic hooks of one block, with the codec of the site that saves each tensor: the
    innermost submodule with a site (`enter` / `leave`), or inside an attention call the site
    `hf_attention.AttentionSaves` tells (`inside`)."""

    def __init__(self, block: torch.nn.Module, sites: BlockSites, seed: int,
                 replays: Optional[hf_replay.Replays] = None):
        self.sites = sites
        self.current: list[Optional[str]] = []
        self.saves: Optional[hf_attention.AttentionSaves] = None
        self.replays = replays
        super().__init__(block, self._choose, seed=seed, layer=sites.act_layer)
        if replays is not None:
            replays.hook(lambda: self.active)

    def __enter__(self) -> "_BlockHooks":
        if self.replays is not None:
            self.replays.reset()
        return super().__enter__()

    def _pack(self, t: torch.Tensor) -> Any:
        """A norm's output saved at a site the plan recomputes alone is packed as its replay
        (`hf_replay`); everything else as the generic hooks pack it."""
        replays = self.replays
        if replays is None:
            return super()._pack(t)
        if self.saves is None and self.site in self.sites.recomputed:
            packed = replays.packed(self.site, t)
            if packed is not None:
                self.sites.stored.add(self.site)
                return packed
        packed = super()._pack(t)
        replays.saved(t, packed)
        return packed

    def site_of(self, t: torch.Tensor) -> str:
        site = self.site if self.saves is None else self.saves.site_of(t)
        self.sites.stored.add(site)
        return site

    def _choose(self, t: torch.Tensor) -> Optional[Codec]:
        """The codec instance the site holds (the controller's, whose random stream it
        checkpoints, or a measuring probe's), None where the site keeps."""
        return self.sites.codecs.get(self.site_of(t))

    @contextlib.contextmanager
    def inside(self, saves: hf_attention.AttentionSaves) -> Iterator[None]:
        """Book what an attention call saves by `saves` (`hf_attention.Booking`)."""
        outer, self.saves = self.saves, saves
        try:
            yield
        finally:
            self.saves = outer

    def enter(self, site: Optional[str]) -> None:
        self.current.append(site)
        self.site = next((s for s in reversed(self.current) if s is not None), "other")

    def leave(self) -> None:
        if self.current:
            self.current.pop()
        self.site = next((s for s in reversed(self.current) if s is not None), "other")


@dataclasses.dataclass
class GenericModel:
    """What `apply` did to a plain model: its blocks, their sites and hooks, the controller."""

    controller: Controller
    blocks: list[torch.nn.Module]
    sites: list[BlockSites]
    hooks: list[_BlockHooks]
    recompute: bool = False
    recompute_codec: Optional[str] = None

    def declined(self) -> dict[int, int]:
        """{block: raw bytes} its last forward kept because the site's codec would have
        stored more than the raw tensor (tiny tensors, odd shapes); blocks without any are
        left out."""
        return {i: h.stats.declined_bytes for i, h in enumerate(self.hooks) if h.stats.declined}

    def extra_state(self) -> dict[str, Any]:
        """Random streams of codecs the hooks built themselves (not the controller's)."""
        return {str(i): {name: c.state_dict() for name, c in h._codecs.items()}
                for i, h in enumerate(self.hooks) if h._codecs}

    def load_extra(self, state: dict[str, Any]) -> None:
        for i, codecs in state.items():
            hooks = self.hooks[int(i)]
            for name, codec_state in codecs.items():
                SavedTensorCompression.codec(hooks, name).load_state_dict(codec_state)


def generic_sites() -> tuple[str, ...]:
    """The sites a generic block offers the controller: those plans may compress, masks
    excepted (the hooks bit-pack saved masks losslessly anyway), and the MoE sites (the
    generic path names its sites by submodule; a Hugging Face MoE block has other names), and
    no site after the blocks (`MODEL_SITES`: a megatron-core TransformerBlock's final norm)."""
    return tuple(s for s in SITES if s not in MASK_SITES and s not in MOE_SITES and s not in MODEL_SITES)


def _check_not_checkpointing(hf: Any) -> None:
    """`hf`: the Hugging Face model in the model (`hf_families.hf_model`), or None."""
    if hf is not None and hf.is_activation_checkpointing:
        raise ValueError(
            "model: Hugging Face gradient checkpointing is on, and llm_act plans recomputation "
            "itself; call model.gradient_checkpointing_disable() (or set "
            '"activation_compression": {"enabled": false})'
        )


def _check_paths(family: Any, blocks: list[torch.nn.Module], model: str, kind: str) -> None:
    """Refuse, in one line, blocks that lack a submodule their family's site table declares
    (`hf_families`): what it saves would be booked at the wrong site."""
    for i, block in enumerate(blocks):
        have = {path for path, _ in block.named_modules()}
        missing = sorted(path for path in family.sites if path not in have)
        if missing:
            raise ValueError(
                f"model: {model}'s block {i} ({type(block).__name__}) has no {', '.join(missing)}, which "
                f"the {kind} site table declares (llm_act books what each submodule saves by its "
                "path); fix: keep the decoder layer's submodules as transformers builds them (wrappers "
                "that add submodules, as LoRA's, are fine)")


def _no_cache_in_training(hf: Any) -> None:
    """Say once, in one line, when the loop computes the loss from the logits (no labels in
    the call: the output layer and loss are then the loop's); and absorb Hugging Face's
    `use_cache` into the plan: a training forward of `hf` (train mode,
    gradients on) runs with `use_cache=False`, as under HF's own gradient checkpointing. The
    KV cache its config turns on by default would hold every layer's raw k and v until the
    output is dropped, after backward: the bytes a plan saves at `attn.k` / `attn.v` (and a
    recomputed block's) would still be held. A training call that asks for the cache itself
    (`use_cache=True`) is refused in one line; evaluation and generation keep it."""

    said: list[bool] = []

    def pre(module: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        if not (module.training and torch.is_grad_enabled()):
            return args, kwargs
        if not said and kwargs.get("labels") is None and len(args) < 2:
            said.append(True)
            if speaks_for_stage():
                log.info("llm_act: %s is trained without labels in its call: its loss is computed from "
                         "the logits outside the model, which llm_act leaves as the loop computes it; "
                         "the blocks are planned", type(module).__name__)
        if kwargs.get("use_cache") is True:
            raise ValueError(
                f"{type(module).__name__}: use_cache=True in a training forward keeps every layer's k "
                "and v for the whole step, which llm_act compresses or recomputes; fix: drop "
                "use_cache=True from training calls (llm_act trains with use_cache=False)")
        return args, {**kwargs, "use_cache": False}

    hf.register_forward_pre_hook(pre, with_kwargs=True, prepend=True)  # before the output switch's


def _price_the_loss(hf: Any, controller: Controller) -> None:
    """Tell the planner what the loss's backward holds on top of every stored byte
    (`Controller.loss_event_bytes`), from each training forward's logits: two float32 tensors
    of their size, the gradients of cross-entropy's log-probabilities and of its input, as
    transformers' loss (it upcasts the logits) and a loop's `cross_entropy(logits.float(), ...)`
    make them. Where no block's backward transient is larger, that is the step's peak."""

    def post(module: Any, _args: tuple, out: Any) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return
        logits = getattr(out, "logits", None)
        if torch.is_tensor(logits):
            controller.loss_event_bytes = 2 * 4 * logits.numel()
        elif getattr(out, "loss", None) is not None and controller.output is not None:
            sizes = controller.output.sizes()  # the chunked loss: one chunk's logits at a time
            if sizes is not None:
                controller.loss_event_bytes = 2 * 4 * min(sizes.chunk_tokens, sizes.tokens) * sizes.vocab_local

    hf.register_forward_hook(post)


def apply(model: torch.nn.Module, config: ActConfig, checkpointing: Any = None,
          mpu: Any = None) -> GenericModel:
    """Plan the repeated blocks of `model` with a Controller (see the module docstring).

    `checkpointing`: DeepSpeed's `activation_checkpointing` settings (`ds_config.Checkpointing`)
    or None; with them, recompute goes through `deepspeed.checkpointing` (with `mpu`).
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    hf = hf_families.hf_model(model)
    _check_not_checkpointing(hf)
    output_mode = config.output_loss_mode()
    if output_mode != STOCK:
        why = (f"{type(model).__name__} is not a Hugging Face causal LM (the chunked loss stands for "
               "transformers' ForCausalLMLoss)" if hf is None else hf_output.refusal(hf))
        if why is not None and output_mode == CHUNKED:
            raise ValueError(f"output_loss 'chunked': {why}; fix: set output_loss to 'stock', or 'auto' to let "
                             "the planner use it where it can")
        if why is not None:
            output_mode = STOCK
    blocks = repeated_blocks(model)
    for i, block in enumerate(blocks):
        if getattr(block, "_llm_act_generic", None) is not None:
            raise ValueError(f"model: block {i} was already prepared by llm_act")
    family = hf_families.family_of(hf, blocks[0])
    if family is not None:
        _check_paths(family, blocks, type(hf).__name__, hf.config.model_type)
        hf_attention.check(type(hf).__name__, hf.config, blocks[0].get_submodule(family.attention),
                           family.bypass)
    # single sites rebuilt by replaying a norm (`hf_replay`): a family's blocks only
    paths = hf_replay.producers(family.sites) if family is not None else {}
    recompute = config.plan == RECOMPUTE
    ckpt_codec = config.codecs.get(CHECKPOINT_SITE, KEEP)
    names = generic_sites()
    if recompute:
        recompute_lib.check(checkpointing, ckpt_codec, len(blocks))
        other = sorted(s for s, c in config.codecs.items()
                       if s in names and s != CHECKPOINT_SITE and c != RECOMPUTE)
        if other:
            raise ValueError(
                f"codecs: under plan \"recompute\" a generic block is recomputed as a whole from "
                f"its input; only codecs['{CHECKPOINT_SITE}'] applies, not {other}"
            )
    else:
        single = sorted(s for s, c in config.codecs.items() if c == RECOMPUTE and s not in paths)
        if single:
            alone = (f"it rebuilds only {', '.join(sorted(paths))} alone, by replaying their norm; "
                     if paths else "")
            raise ValueError(
                f"codecs: a generic block of {type(model).__name__} cannot recompute {single} alone ({alone}"
                "use plan \"recompute\" to recompute whole blocks)")
    # plan "auto" switches blocks to whole-block recompute and back at tracking points, through
    # torch's checkpoint; with DeepSpeed's activation checkpointing configured it keeps to codecs
    switchable = config.plan == "auto" and not (checkpointing is not None and checkpointing.configured)
    if config.plan == "auto" and not switchable and speaks_for_stage():
        log.info("llm_act: plan 'auto' does not recompute %s's blocks: the DeepSpeed config's "
                 "activation_checkpointing recomputes only under plan 'recompute' (drop it to let "
                 "'auto' choose whole-block recompute)", type(model).__name__)
    sites = [BlockSites(i, names) for i in range(len(blocks))]
    binders = [BlockRecompute(bs, recompute, ckpt_codec, switchable,
                              {site: block.get_submodule(path) for site, path in paths.items()})
               for bs, block in zip(sites, blocks)]
    controller = Controller(config, {i: dict.fromkeys(names, s) for i, s in enumerate(sites)},
                            num_layers=len(blocks))
    controller.backward_priced = True  # plain autograd: its gradients in flight are measured by shape
    if switchable:  # what measurement times a whole-block recompute by
        controller.layer_modules.update(enumerate(blocks))
    if output_mode != STOCK:  # the model's output layer and loss, chunked or chosen (`hf_output`)
        controller.output = hf_output.HFOutputSwitch(hf, config.output_chunk_tokens)
        controller.output.set(CHUNKED if output_mode == CHUNKED else STOCK)
    hooks = []
    for i, (block, bs) in enumerate(zip(blocks, sites)):
        h = _BlockHooks(block, bs, seed=replica_seed(config.seed) + SEED_STRIDE * i,
                        replays=hf_replay.Replays(block, paths) if paths and not recompute else None)
        _track_sites(block, h, site_of if family is None else family.sites.get)
        if family is not None:
            hf_attention.book(block.get_submodule(family.attention), h, type(hf).__name__)
        hooks.append(h)
    handle = GenericModel(controller, blocks, sites, hooks, recompute,
                          None if ckpt_codec == KEEP else ckpt_codec)
    if recompute:
        recompute_lib.wrap_blocks(blocks, handle.recompute_codec, checkpointing, seed=config.seed,
                                  mpu=mpu)
    else:
        for block, bs, h, binder in zip(blocks, sites, hooks, binders):
            _wrap_compress(block, bs, h)
            if switchable:
                _wrap_switch(block, binder)
    for block in blocks:
        block._llm_act_generic = handle
    if hf is not None and "use_cache" in inspect.signature(hf.forward).parameters:
        _no_cache_in_training(hf)
    if hf is not None:
        _price_the_loss(hf, controller)
    return handle


def _track_sites(block: torch.nn.Module, hooks: _BlockHooks,
                 site_at: Callable[[str], Optional[str]]) -> None:
    """Enter the site `site_at(path)` gives each submodule of `block` while it runs."""
    for path, sub in block.named_modules():
        if not path:
            continue
        site = site_at(path)

        def pre(_m, _args, site=site):
            if hooks.active:
                hooks.enter(site)

        def post(_m, _args, _out):
            if hooks.active:
                hooks.leave()

        sub.register_forward_pre_hook(pre)
        sub.register_forward_hook(post, always_call=True)


def _wrap_switch(block: torch.nn.Module, binder: BlockRecompute) -> None:
    """Under plan "auto": while `binder.recompute` (the plan in force recomputes the block
    whole), a training forward runs the block's own forward under torch's non-reentrant
    checkpoint (`generic.checkpoint.checkpointed_call`: the block input kept, or encoded with
    the controller's codec); otherwise the per-site forward below it (`_wrap_compress`)."""
    compressed = block.forward
    own = type(block).forward.__get__(block)
    layer = binder.sites.act_layer
    # built once: it reads the codec the plan in force gives the block input at each save
    encoded = SavedTensorCompression(block, lambda t: binder.checkpoint_codec, require_grad=False,
                                     min_numel=1, layer=layer, site=CHECKPOINT_SITE)

    def switched_forward(*args: Any, **kwargs: Any):
        if not (binder.recompute and block.training and torch.is_grad_enabled()):
            return compressed(*args, **kwargs)
        hooks = None if binder.checkpoint_codec is None else encoded
        return checkpointed_call(own, hooks, layer, *args, **kwargs)

    block.forward = switched_forward


def _wrap_compress(block: torch.nn.Module, sites: BlockSites, hooks: _BlockHooks) -> None:
    forward = block.forward

    def compressed_forward(*args: Any, **kwargs: Any):
        # every site kept and no ledger counting: stock's forward, no hook on any saved tensor
        booked = sites.compressing or current_ledger() is not None
        if not (block.training and torch.is_grad_enabled() and booked) or hooks.active:
            return forward(*args, **kwargs)
        with hooks:
            hooks.current = []
            hooks.site = "other"
            return forward(*args, **kwargs)

    block.forward = compressed_forward
