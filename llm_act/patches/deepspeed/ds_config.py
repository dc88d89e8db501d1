"""Reading the DeepSpeed config the way `deepspeed.initialize` will, before it runs.

`deepspeed.initialize` takes its config from `config`, `config_params` or
`args.deepspeed_config` (a dict, a JSON/HJSON path or a base64 string). We need our
`"activation_compression"` section and the `"activation_checkpointing"` one before DeepSpeed
wraps the model, so this module resolves the same source with DeepSpeed's own loader. The
config itself is passed on unchanged: DeepSpeed 0.19 ignores keys it does not know (checked
in tests), so there is nothing to strip.
"""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

from llm_act.config import ActConfig

SECTION = "activation_compression"
CHECKPOINTING = "activation_checkpointing"


@dataclass
class Checkpointing:
    """DeepSpeed's `"activation_checkpointing"` settings that matter to our recompute."""

    configured: bool = False
    partition_activations: bool = False
    cpu_checkpointing: bool = False
    contiguous_memory_optimization: bool = False
    number_checkpoints: Optional[int] = None

    @property
    def stores_checkpoints(self) -> bool:
        """DeepSpeed moves or splits the block inputs itself (our codecs cannot reach them)."""
        return self.partition_activations or self.cpu_checkpointing


def source(args: Any, config: Any, config_params: Any) -> Any:
    """The config object DeepSpeed will read (same precedence as `deepspeed.initialize`)."""
    if config is None and config_params is not None:
        config = config_params
    for name in ("deepspeed_config", "deepscale_config"):
        value = getattr(args, name, None) if args is not None else None
        if value is not None:
            if config is not None:
                raise ValueError(
                    f"config: given both as an argument and as args.{name} ({value!r}); "
                    "deepspeed.initialize accepts only one"
                )
            return value
    return config


def load(cfg: Any) -> dict[str, Any]:
    """The config as a dict (a deep copy; DeepSpeed's loader for paths and base64)."""
    if cfg is None:
        raise ValueError("config: DeepSpeed needs a config (a dict, a JSON path, or "
                         "args.deepspeed_config); got none")
    if isinstance(cfg, dict):
        return copy.deepcopy(cfg)
    from deepspeed.runtime.tensor_parallel.init_utils import load_ds_config

    return copy.deepcopy(load_ds_config(cfg))


def act_config(ds: dict[str, Any]) -> Optional[ActConfig]:
    """Our section as an `ActConfig`, or None when the config has none.

    Unknown keys and bad values raise `ValueError` naming the key (prefixed with the
    section name, so the message points into the DeepSpeed JSON).
    """
    section = ds.get(SECTION)
    if section is None:
        return None
    if not isinstance(section, dict):
        raise ValueError(f"{SECTION}: expected a mapping of ActConfig fields, got {section!r}")
    try:
        return ActConfig.from_dict(section)
    except ValueError as err:
        raise ValueError(f"{SECTION}.{err}" if not str(err).startswith("unknown key")
                         else f"{SECTION}: {err}") from None
    except TypeError as err:  # e.g. a list where a mapping belongs
        raise ValueError(f"{SECTION}: {err}") from None


def checkpointing(ds: dict[str, Any]) -> Checkpointing:
    """DeepSpeed's activation checkpointing settings (all off when the section is absent)."""
    section = ds.get(CHECKPOINTING)
    if section is None:
        return Checkpointing()
    if not isinstance(section, dict):
        raise ValueError(f"{CHECKPOINTING}: expected a mapping, got {section!r}")
    out = Checkpointing(configured=True)
    for key in ("partition_activations", "cpu_checkpointing", "contiguous_memory_optimization"):
        value = section.get(key, False)
        if not isinstance(value, bool):
            raise ValueError(f"{CHECKPOINTING}.{key}: expected true or false, got {value!r}")
        setattr(out, key, value)
    n = section.get("number_checkpoints")
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
        raise ValueError(f"{CHECKPOINTING}.number_checkpoints: expected a positive integer, got {n!r}")
    out.number_checkpoints = n
    return out
