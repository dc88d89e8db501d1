"""What `initialize` adds to a DeepSpeed engine: the controller, its clock and its checkpoint.

- `engine.act_controller`: the `llm_act.Controller` of the wrapped model.
- the budget check without a probe (`llm_act.runtime.budget_check.FirstForward`): the controller measures
  the first forward through hooks on `engine.module` and, with a user budget, checks it at
  the first `engine.step()` (`PlanOverBudget`, `BudgetTooSmall`, on every rank).
- `engine.step()`: on an optimizer step (a gradient-accumulation boundary) the step runs
  inside `controller.step()`, so the controller advances one iteration per optimizer step
  and switches plans only there, never between the micro-batches of one step. Inside a
  user's own `with controller.step():` the engine leaves the counting to it. The ranks
  need no exchange here: they agreed on the setup in `initialize`, every plan switch is
  agreed where it is asked for (`Controller.set_plan`, the adaptive planner's broadcast),
  and a rank that asks for a different plan stops every rank with an error naming it
  instead of being overruled silently.
- `engine.save_checkpoint(...)` adds the controller's state to `client_state` under the key
  `"llm_act"`; `engine.load_checkpoint(...)` takes it out again, restores the controller
  and returns the rest of `client_state` as DeepSpeed would.
"""
from __future__ import annotations

import functools
from typing import Any, Callable, Optional

#: the client_state key that holds llm_act's state in a DeepSpeed checkpoint
STATE_KEY = "llm_act"


def attach(engine: Any, controller: Any, extra_state: Optional[Callable[[], dict]] = None,
           load_extra: Optional[Callable[[dict], None]] = None) -> Any:
    """Attach `controller` to `engine` (see the module docstring); returns the engine.

    `extra_state`/`load_extra`: more state to keep in checkpoints beside the controller's
    (the generic path's hook codecs).
    """
    if getattr(engine, "act_controller", None) is not None:
        raise ValueError("engine: already has an act_controller (initialize was applied twice)")
    engine.act_controller = controller
    controller.boundary = "engine.step()"
    module = getattr(engine, "module", None)
    if module is not None:
        controller.watch(module)  # the first step's budget check; a no-op where apply() watches already

    step = engine.step

    @functools.wraps(step)
    def act_step(*args: Any, **kwargs: Any):
        if not engine.is_gradient_accumulation_boundary() or getattr(controller, "_in_step", False):
            return step(*args, **kwargs)
        with controller.step():
            return step(*args, **kwargs)

    save = engine.save_checkpoint

    @functools.wraps(save)
    def act_save_checkpoint(save_dir, tag=None, client_state=None, *args: Any, **kwargs: Any):
        state = dict(client_state or {})
        if STATE_KEY in state:
            raise KeyError(f"client_state: the key {STATE_KEY!r} is reserved for llm_act's state")
        state[STATE_KEY] = {"version": 1, "controller": controller.state_dict(),
                            "extra": extra_state() if extra_state is not None else {}}
        return save(save_dir, tag, state, *args, **kwargs)

    load = engine.load_checkpoint

    @functools.wraps(load)
    def act_load_checkpoint(*args: Any, **kwargs: Any):
        load_path, client_state = load(*args, **kwargs)
        if client_state and STATE_KEY in client_state:
            state = client_state.pop(STATE_KEY)
            controller.load_state_dict(state["controller"])
            if load_extra is not None:
                load_extra(state.get("extra", {}))
        return load_path, client_state

    engine.step = act_step
    engine.save_checkpoint = act_save_checkpoint
    engine.load_checkpoint = act_load_checkpoint
    return engine
