"""llm_act for DeepSpeed: `initialize(...)`, `deepspeed.initialize` with our config section.

`"activation_compression": {"enabled": true, "plan": "compress", ...}` in the DeepSpeed
JSON (the keys are `llm_act.ActConfig`'s fields) turns it on; the controller is at
`engine.act_controller` and advances on `engine.step()`. Importing this package needs only
torch; DeepSpeed is imported when `initialize` runs. (The function is bound here eagerly on
purpose: importing the submodule `initialize` lazily would rebind the package attribute
`initialize` to the module.)
"""
from llm_act.patches.deepspeed.initialize import initialize

__all__ = ["initialize"]
