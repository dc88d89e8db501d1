"""Measure from the training steps themselves: plan "auto" without a probe.

No loop we do not own (DeepSpeed's engine, Megatron-LM's `pretrain()`, a plain PyTorch
loop, our own loop under pipeline parallelism) will call a probe. So the controller takes
what it needs from the training step that is running anyway, through hooks it installs on
the model (`Controller.watch`):

- on an iteration where the backoff schedule measures, a forward pre-hook on each root
  module keeps a reference to the arguments of that root's first training forward (and,
  on a later pipeline stage, the activation megatron handed it with `set_input_tensor`);
- a forward hook puts a tensor hook on what that forward returns (the loss, or the logits
  or hidden states a loss outside the model reads), which keeps the gradient the real
  backward sends into it;
- at the step boundary the adapter measures with `probe()`: the same forward on the same
  batch, whose "loss" is <output, recorded gradient> -- the real loss linearised at the
  step's output, so its parameter gradient is the training gradient of that batch,
  whatever loss (and loss scale) the loop applies outside the model. It runs inside
  `llm_act.measurement.probing.isolated` like every probe: no RNG stream, gradient buffer or codec
  stream of the run moves.

On every other iteration the hooks only note that a training forward ran (that is how an
`optimizer.step()` is told apart from an optimizer that does not train this model) and
return. The time spent measuring is booked by the adapter (`Adapter.measure_seconds`).
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch.utils import _pytree as pytree


def _loss_outputs(out: Any) -> list[torch.Tensor]:
    """The tensors of a forward's output whose gradient the real backward computes: a
    `loss` entry alone where there is one (a Hugging Face output: its logits feed that
    loss, so counting both would count the loss twice), else every floating tensor that
    requires grad."""
    loss = out.get("loss") if isinstance(out, dict) else getattr(out, "loss", None)
    if isinstance(loss, torch.Tensor) and loss.requires_grad:
        return [loss]
    return [t for t in pytree.tree_leaves(out)
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.requires_grad]


def _add(terms: list[torch.Tensor]) -> torch.Tensor:
    """Per-sample losses added sample by sample when they all have the same batch, else
    one total (then the sampling-noise estimate has no samples to split)."""
    if len({t.numel() for t in terms}) == 1:
        return torch.stack(terms).sum(0)
    return sum(t.sum() for t in terms).reshape(1)


def first_rows(tree: Any, batch: int, rows: int) -> Any:
    """`tree` (a forward's arguments) with every tensor whose leading dimension is the
    batch (`batch` samples: token ids, position ids, labels, a per-sample mask) cut to its
    first `rows` samples; other leaves unchanged (a broadcast [1, ...] mask, flags)."""
    def cut(t: Any) -> Any:
        if isinstance(t, torch.Tensor) and t.dim() > 0 and t.shape[0] == batch:
            return t.narrow(0, 0, rows)
        return t

    return pytree.tree_map(cut, tree)


def unwrap(module: Any) -> Any:
    """The module inside its wrappers (DDP, megatron's Float16Module: `.module`)."""
    while hasattr(module, "module") and isinstance(module.module, torch.nn.Module):
        module = module.module
    return module


class _Call:
    """One recorded root forward: its arguments, its pipeline input and the gradients the
    real backward sent into its outputs."""

    def __init__(self, root: torch.nn.Module, args: tuple, kwargs: dict):
        self.root, self.args, self.kwargs = root, args, kwargs
        self.inputs = [(m, m.input_tensor) for m in root.modules()
                       if isinstance(getattr(m, "input_tensor", None), torch.Tensor)]
        self.grads: dict[int, torch.Tensor] = {}
        self.n_outputs = 0
        # a later pipeline stage's hidden states are [s, b, h]: the batch is dim 1 there
        self.batch_dim = 1 if getattr(unwrap(root), "post_process", True) is False else 0

    @property
    def complete(self) -> bool:
        return self.n_outputs > 0 and len(self.grads) > 0

    @property
    def rows(self) -> Optional[int]:
        """The batch size of the recorded outputs (their gradients' size along the batch
        dimension), None where they disagree or have no batch dimension."""
        sizes = {g.shape[min(self.batch_dim, g.dim() - 1)] for g in self.grads.values() if g.dim() > 0}
        return sizes.pop() if len(sizes) == 1 else None

    def run(self, rows: Optional[int] = None) -> torch.Tensor:
        """The linearised loss of this call, per sample (scaled so its mean is the sum);
        `rows`: of the first `rows` samples alone (`first_rows`), each weighted as in the
        whole batch."""
        b = self.rows
        cut = rows is not None and b is not None and rows < b
        args, kwargs = (first_rows(self.args, b, rows), first_rows(self.kwargs, b, rows)) if cut \
            else (self.args, self.kwargs)
        saved = [(m, m.input_tensor) for m, _ in self.inputs]
        try:
            for m, t in self.inputs:
                # a later pipeline stage's input: [s, b, h]
                m.input_tensor = (t.narrow(1, 0, rows) if cut and t.dim() > 1 and t.shape[1] == b
                                  else t).detach()
            outs = _loss_outputs(self.root(*args, **kwargs))
        finally:
            for m, t in saved:
                m.input_tensor = t
        terms = []
        for i, out in enumerate(outs):
            g = self.grads.get(i)
            if g is not None and cut and g.dim() > 0:
                g = g.narrow(min(self.batch_dim, g.dim() - 1), 0, rows)
            if g is None or g.shape != out.shape:
                continue
            prod = out.float() * g.float()
            if prod.dim() == 0:
                terms.append(prod.reshape(1))
                continue
            dim = min(self.batch_dim, prod.dim() - 1)
            per = prod.transpose(0, dim).reshape(prod.shape[dim], -1).sum(dim=1)
            terms.append(per * per.numel())
        if not terms:
            raise RuntimeError("the recorded step has no output gradient to measure with")
        return _add(terms)


class StepReplay:
    """Records one training step per measuring iteration (see the module docstring).

    `due()` tells whether the forward about to run belongs to an iteration the schedule
    measures."""

    def __init__(self, due: Callable[[], bool], on_record: Optional[Callable[[], None]] = None):
        self.due = due
        self.on_record = on_record
        """called when a step starts being recorded (its first root forward of the iteration)"""
        self.roots: list[torch.nn.Module] = []
        self.handles: list[Any] = []
        self.calls: dict[int, _Call] = {}
        self.forward_seen = False
        """a training forward of a watched root ran since the last step boundary"""
        self.first_forward_time: Optional[float] = None

    def install(self, roots: list[Any]) -> None:
        for root in roots:
            if not isinstance(root, torch.nn.Module) or any(r is root for r in self.roots):
                continue
            self.roots.append(root)
            self.handles.append(root.register_forward_pre_hook(self._pre, with_kwargs=True))
            self.handles.append(root.register_forward_hook(self._post, with_kwargs=True))

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles, self.roots = [], []

    def _pre(self, module: Any, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled():
            return  # evaluation
        if self.first_forward_time is None:
            import time

            self.first_forward_time = time.perf_counter()
        self.forward_seen = True
        if id(module) in self.calls or not self.due():
            return
        self.calls[id(module)] = _Call(module, args, dict(kwargs))
        if self.on_record is not None:
            self.on_record()

    def _post(self, module: Any, args: tuple, kwargs: dict, output: Any) -> None:
        call = self.calls.get(id(module))
        if call is None or call.n_outputs or not torch.is_grad_enabled():
            return
        outs = _loss_outputs(output)
        call.n_outputs = len(outs)
        for i, t in enumerate(outs):
            t.register_hook(lambda g, i=i, call=call: call.grads.setdefault(i, g.detach()))

    def probe(self, rows: Optional[int] = None) -> Optional[Callable[[], torch.Tensor]]:
        """The measuring closure over the recorded step, or None when none was recorded
        completely (no training forward ran, or its backward never reached the output);
        `rows`: over the first `rows` samples of the batch alone (`batch_rows`), each
        weighted as in the whole batch: a measurement costs that share of a pass."""
        calls = [c for c in self.calls.values() if c.complete]
        if not calls:
            return None

        def forward() -> torch.Tensor:
            return _add([c.run(rows) for c in calls])

        return forward

    def batch_rows(self) -> Optional[int]:
        """The samples of the recorded batch (every root's outputs agree), None where they
        cannot be told or the roots disagree: a closure over fewer rows is then not offered."""
        sizes = {c.rows for c in self.calls.values() if c.complete}
        return sizes.pop() if len(sizes) == 1 and None not in sizes else None

    def clear(self) -> None:
        """Drop the recorded step (its inputs and gradients) after the boundary."""
        self.calls = {}
        self.forward_seen = False
