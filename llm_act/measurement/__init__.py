"""What the planner is fed: per-site bytes and times from a real step (`measure`, `replay`),
GACT's gradient sensitivities (`sensitivity`), side passes that leave training untouched
(`probing`) and the gradient check of a plan (`fidelity`). The independent check of the
planner's peak, the peak of live tensor storage over a step, is not here: it is the oracle of
the peak bench and the memory tests (`llm_act.bench.live_storage`)."""
