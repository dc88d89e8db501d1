"""What the planner is fed: per-site bytes and times from a real step (`measure`, `replay`),
GACT's gradient sensitivities (`sensitivity`), side passes that leave training untouched
(`probing`), the gradient check of a plan (`fidelity`), and the peak of live tensor storage over
a step, transients included (`peak_memory`): the independent check of the planner's peak."""
