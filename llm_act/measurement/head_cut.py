"""Measuring passes that share the output layer and the loss: the backward starts below them.

Compression changes what a block saves for backward, never a value of the forward. Every
pass of a measurement (the exact one, a probe, a coherence pass, the plan's, a half batch's)
therefore computes the same logits, the same loss and the same gradient dh at the output
layer's input h; only the backward through the blocks differs. The output layer is a large
share of a pass (on the bench GPT, vocabulary 50,304 against hidden 128: most of it), so:

- the exact pass (`HeadCut.exact`) runs whole, split at h: first the head and the loss,
  which give dh and the head's parameter gradients (a tied embedding's share from the
  head), then the blocks from h with dh. Its gradient is the sum, the same as one backward;
- every later pass (`HeadCut.again`) stops its forward at h (`HeadReached`) and runs the
  blocks' backward from h with the exact pass's dh; its gradient is that plus the head's
  share from the exact pass;
- the sampling half (`HeadCut.half`) runs the blocks from h with dh on half a's rows
  (twice: the half's mean), and takes the head weight's gradient of those rows,
  2 dlogits_a^T h_a, from a hook in the exact pass (one matmul over half the tokens).

Where the forward reaches no head (no output layer given, a pipeline stage without one, a
model whose output layer takes another path), every pass runs whole, as without a cut;
where the head's rows cannot be split (sequence parallelism gathers h inside the head; a
head with a bias; a chunked loss that returns no logits), the half runs whole.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Sequence

import torch

from llm_act.measurement import probing
from llm_act.measurement.replay import unwrap

#: megatron-core's hidden states are [s, b, h]: the batch (the loss's rows) is dim 1
BATCH_DIM = 1


class HeadReached(Exception):
    """Raised by the forward pre-hook of a cut pass at the head: the forward stops there."""

    def __init__(self, h: torch.Tensor):
        super().__init__("the measuring pass reached the output layer")
        self.h = h


def head_of(roots: Sequence[torch.nn.Module]) -> Optional[torch.nn.Module]:
    """The output layer of a megatron-core GPT model that is the one root of a recorded
    step (the last pipeline stage, or no pipeline); None otherwise (several roots, virtual
    pipeline chunks: each pass then runs whole)."""
    if len(roots) != 1:
        return None
    model = unwrap(roots[0])
    head = getattr(model, "output_layer", None)
    if not isinstance(head, torch.nn.Module) or getattr(model, "post_process", True) is False:
        return None
    return head


def _add(head: list, blocks: list, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The head's share plus the blocks' gradient, entry by entry, None counting as zero
    (not a dense zero: under ZeRO-3 a parameter's local tensor is an empty shard, while its
    gradient is whole); zeros where neither has one, as `probing.optional_grad` gives."""
    summed = [b if h is None else h if b is None else h + b for h, b in zip(head, blocks)]
    return [torch.zeros_like(p) if g is None else g for p, g in zip(params, summed)]


def _blocks(h: torch.Tensor, params: Sequence[torch.Tensor], dh: torch.Tensor) -> list:
    """The blocks' gradient from `h` with `dh` (None where a parameter takes no part)."""
    return list(torch.autograd.grad(h, params, dh, allow_unused=True))


class HeadCut:
    """The passes of one measurement over `params` (see the module docstring). `loss_of`
    turns what `forward()` returns into the scalar every pass backpropagates (the batch
    loss); `rows_of` gives the per-row losses (None: a batch of one, no halves)."""

    def __init__(self, head: Optional[torch.nn.Module], params: Sequence[torch.Tensor],
                 loss_of: Callable[[Any], torch.Tensor], rows_of: Callable[[Any], Optional[torch.Tensor]]):
        self.head, self.params = head, list(params)
        self.loss_of, self.rows_of = loss_of, rows_of
        self.dh: Optional[torch.Tensor] = None
        """d(batch loss)/dh of the exact pass; None while no pass was cut"""
        self.head_grads: list = []
        """the head's share of each parameter's exact gradient (None: no share)"""
        self.half_rows: Optional[int] = None
        """rows of half a (the first ones); None where the half runs whole"""
        self.head_half: dict[int, torch.Tensor] = {}
        """parameter index -> the head's share of half a's gradient"""
        self.rows: Optional[int] = None
        """per-row losses the exact pass's output had (None: a scalar loss)"""

    @property
    def signed_rows(self) -> bool:
        """Whether the exact pass had rows to split in halves (two or more per-row losses)."""
        return self.rows is not None and self.rows >= 2

    @property
    def cut(self) -> bool:
        return self.dh is not None

    # ---- the exact pass ---------------------------------------------------------------------
    def exact(self, forward: Callable[[], Any], halves: bool = False) -> list[torch.Tensor]:
        """The exact gradient of the batch loss (split at the head where there is one);
        with `halves`, also what `half` needs of the head."""
        if self.head is None:
            return self._whole(forward(), exact=True)
        box: dict[str, Any] = {}

        def pre(module, args, kwargs):
            h = args[0] if args else kwargs.get("input_")
            if not isinstance(h, torch.Tensor) or not h.requires_grad or "h" in box:
                return None
            detached = h.detach().requires_grad_(True)
            box.update(h=h, detached=detached, weight=kwargs.get("weight"))
            return ((detached, *args[1:]), kwargs) if args else (args, {**kwargs, "input_": detached})

        def post(module, args, kwargs, out):
            logits = out[0] if isinstance(out, (tuple, list)) else out
            if isinstance(logits, torch.Tensor) and "logits" not in box:
                box["logits"] = logits

        handles = [self.head.register_forward_pre_hook(pre, with_kwargs=True),
                   self.head.register_forward_hook(post, with_kwargs=True)]
        try:
            out = forward()
        finally:
            for handle in handles:
                handle.remove()
        self._count_rows(out)
        loss = self.loss_of(out)
        if "h" not in box:  # the forward took another path: one whole backward
            return probing.optional_grad(loss, self.params)
        h, detached = box["h"], box["detached"]
        if halves:
            self._hook_half(out, box)
        first = list(torch.autograd.grad(loss, [detached, *self.params], allow_unused=True))
        dh, head_grads = first[0], first[1:]
        del out, loss, first
        if dh is None:  # the loss does not read the head's output
            dh = torch.zeros_like(h)
        blocks = _blocks(h, self.params, dh)
        self.dh, self.head_grads = dh, head_grads
        return _add(head_grads, blocks, self.params)

    def _hook_half(self, out: Any, box: dict[str, Any]) -> None:
        """A hook on the logits that takes the head weight's gradient of half a's rows
        (where the head is a plain linear of h to the logits, without a bias)."""
        rows = self.rows_of(out)
        weight = box["weight"] if box["weight"] is not None else getattr(self.head, "weight", None)
        logits, detached = box.get("logits"), box["detached"]
        bias = getattr(self.head, "bias", None)
        index = next((i for i, p in enumerate(self.params) if p is weight), None)
        if (rows is None or index is None or logits is None or not logits.requires_grad
                or (isinstance(bias, torch.Tensor) and bias.requires_grad)
                or weight.dim() != 2 or logits.dim() != 3 or detached.dim() != 3
                or logits.shape[:2] != detached.shape[:2] or logits.shape[BATCH_DIM] != rows.shape[0]
                or logits.shape[-1] != weight.shape[0] or detached.shape[-1] != weight.shape[1]):
            return
        half = rows.shape[0] // 2

        def take(g: torch.Tensor) -> None:
            ga = g.narrow(BATCH_DIM, 0, half).float().reshape(-1, g.shape[-1])
            ha = detached.detach().narrow(BATCH_DIM, 0, half).float().reshape(-1, detached.shape[-1])
            self.head_half[index] = (2.0 * ga.t() @ ha).to(weight.dtype)

        logits.register_hook(take)
        self.half_rows = half

    # ---- the later passes -------------------------------------------------------------------
    def again(self, forward: Callable[[], Any], dh: Optional[torch.Tensor] = None,
              head_grads: Optional[list] = None) -> list[torch.Tensor]:
        """The gradient of the batch loss on the same batch with the codecs installed now:
        the blocks' backward from h (with `dh`, default the exact pass's), plus the head's
        share (default the exact pass's); a whole pass where the exact one was not cut."""
        if not self.cut:
            return self._whole(forward())

        def stop(module, args, kwargs):
            h = args[0] if args else kwargs.get("input_")
            raise HeadReached(h)

        handle = self.head.register_forward_pre_hook(stop, with_kwargs=True)
        try:
            forward()
        except HeadReached as reached:
            h = reached.h
        else:
            raise RuntimeError("head_cut: the measuring pass did not reach the output layer it reached "
                               "in the exact pass")
        finally:
            handle.remove()
        blocks = _blocks(h, self.params, self.dh if dh is None else dh)
        return _add(self.head_grads if head_grads is None else head_grads, blocks, self.params)

    def _whole(self, out: Any, exact: bool = False) -> list[torch.Tensor]:
        """One whole backward from the batch loss of `out` (`exact`: of the exact pass)."""
        if exact:
            self._count_rows(out)
        return probing.optional_grad(self.loss_of(out), self.params)

    def _count_rows(self, out: Any) -> None:
        per = self.rows_of(out)
        self.rows = None if per is None else int(per.shape[0])

    def half(self, forward: Callable[[], Any], whole: list[torch.Tensor],
             whole_pass: Callable[[], Optional[list]]) -> Optional[list[list[torch.Tensor]]]:
        """[g_a, g_b]: the gradients of the batch's two halves, each scaled as a full
        batch's (g_b = 2 * whole - g_a); `whole_pass()` gives them where the head's rows
        cannot be split here (see the module docstring)."""
        shares = {i for i, g in enumerate(self.head_grads) if g is not None}
        if not self.cut or self.half_rows is None or not shares <= set(self.head_half):
            return whole_pass()
        mask = torch.zeros(self.dh.shape[BATCH_DIM], dtype=self.dh.dtype, device=self.dh.device)
        mask[:self.half_rows] = 2.0
        shape = [1] * self.dh.dim()
        shape[BATCH_DIM] = -1
        dh_a = self.dh * mask.reshape(shape)
        head_a: list = [None] * len(self.params)
        for i, g in self.head_half.items():
            head_a[i] = g
        g_a = self.again(forward, dh=dh_a, head_grads=head_a)
        return [g_a, [2.0 * w - a for w, a in zip(whole, g_a)]]
