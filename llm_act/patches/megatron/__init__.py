"""llm_act for megatron-core: `apply(model, config) -> Controller`, `layer_spec(config)`,
and Megatron-LM's flags `add_arguments(parser)` / `config_from_args(args)`.

Importing this package needs only torch; megatron-core is imported when `apply` or
`layer_spec` runs, with a message naming the extra to install when it is missing.
(The functions are bound here eagerly on purpose: importing the submodule `apply` lazily
would rebind the package attribute `apply` to the module.)
"""
from llm_act.patches.megatron.apply import apply
from llm_act.patches.megatron.args import add_arguments, config_from_args
from llm_act.patches.megatron.spec import block_spec, layer_spec

__all__ = ["add_arguments", "apply", "block_spec", "config_from_args", "layer_spec"]
