"""Autograd functions that save an *encoded* activation instead of the raw tensor.

Each forward computes exactly what the stock op computes and, instead of the input,
keeps `codec.encode(input)` (plus what is cheap and exact: the weight, a norm's per-row
statistics). Backward decodes and runs the stock backward formula on the decoded copy.
The encoded records live on the autograd context (not `save_for_backward`), so the
ledger sees them only through `report`, which every function does via its owner module.
"""
from __future__ import annotations

from typing import Callable, Optional

import torch

from llm_act.codecs.base import Codec, Encoded
from llm_act.codecs.bitmask import BitMask


class Record:
    """What one op stores for backward: an encoded tensor plus exact side tensors.

    `.data` lists every stored tensor (for the ledger), `.nbytes` their bytes.
    """

    def __init__(self, enc: Encoded, **side: torch.Tensor):
        self.enc = enc
        self.side = side

    @property
    def data(self) -> dict[str, torch.Tensor]:
        return {**self.enc.data, **{f"side.{k}": v for k, v in self.side.items()}}

    @property
    def nbytes(self) -> int:
        return self.enc.nbytes + sum(t.numel() * t.element_size() for t in self.side.values())


def report_record(owner, site: str, record, replaces: Optional[torch.Tensor]) -> None:
    if owner is not None:
        owner.act_report(site, record, record.nbytes, replaces)


# ---- linear ---------------------------------------------------------------------------------


def megatron_linear_helpers():
    from megatron.core.tensor_parallel import layers as L
    from megatron.core.utils import prepare_input_tensors_for_wgrad_compute

    return L, prepare_input_tensors_for_wgrad_compute


class EncodedLinear(torch.autograd.Function):
    """megatron-core's LinearWithGradAccumulationAndAsyncCommunication without sequence
    parallelism, saving the encoded input. The input gradient needs only the weight; the
    decoded input is used for the weight gradient (ActNN sec. 5.1)."""

    @staticmethod
    def forward(ctx, input, weight, bias, gradient_accumulation_fusion, allreduce_dgrad,
                tp_group, codec: Codec, owner, site: str):
        save_linear_ctx(ctx, input, weight, bias, gradient_accumulation_fusion, tp_group, codec, owner, site)
        ctx.allreduce_dgrad = allreduce_dgrad

        output = torch.matmul(input, weight.t())
        if bias is not None:
            output = output + bias
        return output

    @staticmethod
    def backward(ctx, grad_output):
        L, prepare = megatron_linear_helpers()
        (weight,) = ctx.saved_tensors
        if ctx.gradient_accumulation_fusion:
            weight.main_grad = ctx.main_grad

        grad_input = grad_output.matmul(weight)
        handle = None
        if ctx.allreduce_dgrad:
            handle = torch.distributed.all_reduce(grad_input, group=ctx.tp_group, async_op=True)
        total_input = ctx.codec.decode(ctx.record.enc)
        ctx.record = None
        grad_output, total_input = prepare(grad_output, total_input)
        grad_weight, grad_bias = linear_param_grads(ctx, L, weight, grad_output, total_input)
        if handle is not None:
            handle.wait()
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


def save_linear_ctx(ctx, input, weight, bias, gradient_accumulation_fusion, tp_group,
                    codec: Codec, owner, site: str) -> None:
    """Encode `input` and keep what every compressed linear's backward needs: the weight, the
    encoded input, megatron's flags (plain and sequence-parallel linears share this)."""
    ctx.save_for_backward(weight)
    ctx.record, ctx.codec = Record(codec.encode(input)), codec
    fused = gradient_accumulation_fusion and hasattr(weight, "main_grad")
    ctx.main_grad = weight.main_grad if fused else None
    ctx.use_bias = bias is not None
    ctx.gradient_accumulation_fusion = gradient_accumulation_fusion
    ctx.tp_group = tp_group
    report_record(owner, site, ctx.record, input)


def linear_param_grads(ctx, L, weight, grad_output, total_input):
    """(grad_weight, grad_bias) from the decoded input, megatron's fused accumulation included."""
    if ctx.gradient_accumulation_fusion:
        grad_weight = _accumulate_wgrad(L, weight, grad_output, total_input)
    else:
        grad_weight = grad_output.t().matmul(total_input)
    return grad_weight, (grad_output.sum(dim=0) if ctx.use_bias else None)


def _accumulate_wgrad(L, weight, grad_output, total_input):
    """The gradient-accumulation-fusion branch of megatron's linear backward."""
    if hasattr(weight, "__fsdp_param__"):
        weight.main_grad = weight.get_main_grad()
        torch.matmul(grad_output.t(), total_input, out=weight.main_grad)
    elif weight.main_grad.dtype == torch.float32:
        L.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp32(total_input, grad_output, weight.main_grad)
    elif weight.main_grad.dtype in (torch.float16, torch.bfloat16):
        L.fused_weight_gradient_mlp_cuda.wgrad_gemm_accum_fp16(total_input, grad_output, weight.main_grad)
    else:
        raise RuntimeError("Unsupported gradient type for gradient accumulation fusion")
    if not hasattr(weight, "grad_added_to_main_grad"):
        return None
    make = torch.zeros if getattr(weight, "zero_out_wgrad", False) else torch.empty
    grad_weight = make(weight.main_grad.shape, dtype=total_input.dtype, device=total_input.device)
    weight.grad_added_to_main_grad = True
    return grad_weight


# ---- norms ----------------------------------------------------------------------------------


class EncodedLayerNorm(torch.autograd.Function):
    """LayerNorm saving the encoded input and the exact per-row mean and rstd.

    Forward is aten's native_layer_norm (what F.layer_norm runs); backward is aten's
    native_layer_norm_backward on the decoded input with the exact statistics (the ones
    the stock op saves: float32 on CUDA, the input dtype on CPU).
    """

    @staticmethod
    def forward(ctx, x, weight, bias, normalized_shape, eps, codec, owner, site):
        out, mean, rstd = torch.native_layer_norm(x, normalized_shape, weight, bias, eps)
        record = Record(codec.encode(x), mean=mean, rstd=rstd)
        ctx.save_for_backward(weight, bias)
        ctx.record, ctx.codec, ctx.shape = record, codec, list(normalized_shape)
        report_record(owner, site, record, x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        weight, bias = ctx.saved_tensors
        rec = ctx.record
        x = ctx.codec.decode(rec.enc)
        ctx.record = None
        mask = [ctx.needs_input_grad[0], weight is not None and ctx.needs_input_grad[1],
                bias is not None and ctx.needs_input_grad[2]]
        gx, gw, gb = torch.ops.aten.native_layer_norm_backward(
            grad_out.contiguous(), x, ctx.shape, rec.side["mean"], rec.side["rstd"], weight, bias, mask)
        return gx, gw, gb, None, None, None, None, None


def rms_norm_backward(grad_out, x, rstd, weight, dims):
    """d/dx and d/dw of y = x * rstd * w (rstd exact, float32) at a decoded x, in float32."""
    xhat = x.float() * rstd
    g = grad_out.float()
    gw = None
    if weight is not None:
        reduce = tuple(range(g.dim() - len(dims)))
        gw = (g * xhat).sum(dim=reduce).to(weight.dtype)
        g = g * weight.float()
    gx = rstd * (g - xhat * (g * xhat).mean(dim=dims, keepdim=True))
    return gx.to(x.dtype), gw


class EncodedRMSNorm(torch.autograd.Function):
    """RMSNorm saving the encoded input and the exact per-row rstd (float32)."""

    @staticmethod
    def forward(ctx, x, weight, normalized_shape, eps, codec, owner, site):
        out, rstd = torch.ops.aten._fused_rms_norm(x, list(normalized_shape), weight, eps)
        rstd = rstd.float()
        record = Record(codec.encode(x), rstd=rstd)
        ctx.save_for_backward(weight)
        ctx.record, ctx.codec = record, codec
        ctx.dims = tuple(range(-len(normalized_shape), 0))
        report_record(owner, site, record, x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (weight,) = ctx.saved_tensors
        rec = ctx.record
        x = ctx.codec.decode(rec.enc)
        ctx.record = None
        gx, gw = rms_norm_backward(grad_out, x, rec.side["rstd"], weight, ctx.dims)
        if not ctx.needs_input_grad[1]:
            gw = None
        return gx, gw, None, None, None, None, None


# ---- activations ----------------------------------------------------------------------------


class FewBitActivation(torch.autograd.Function):
    """y = f(x); saves only the few-bit bucket of x, whose decode is q(x) ~ f'(x)."""

    @staticmethod
    def forward(ctx, x, fn: Callable, codec: Codec, owner, site):
        out = fn(x)
        record = Record(codec.encode(x))
        ctx.record, ctx.codec = record, codec
        report_record(owner, site, record, x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q = ctx.codec.decode(ctx.record.enc)
        ctx.record = None
        return grad_out * q, None, None, None, None


class EncodedRecompute(torch.autograd.Function):
    """y = fn(x) for a pointwise-ish fn (SwiGLU, squared ReLU, ...): saves encode(x) and
    differentiates fn again at the decoded x in backward."""

    @staticmethod
    def forward(ctx, x, fn: Callable, codec: Codec, owner, site):
        out = fn(x)
        record = Record(codec.encode(x))
        ctx.record, ctx.codec, ctx.fn = record, codec, fn
        report_record(owner, site, record, x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        x = ctx.codec.decode(ctx.record.enc).detach().requires_grad_(True)
        ctx.record = None
        with torch.enable_grad():
            out = ctx.fn(x)
        (gx,) = torch.autograd.grad(out, x, grad_out)
        return gx, None, None, None, None


_BITMASK = None


def _bitmask() -> Codec:
    """A stateless BitMask for the ReLU mask (it draws nothing, so owning one here keeps
    no random state away from the Controller)."""
    global _BITMASK
    if _BITMASK is None:
        _BITMASK = BitMask()
    return _BITMASK


class MaskActivation(torch.autograd.Function):
    """ReLU saving only the bit-packed mask not(relu(x) <= 0): exact, since relu' is 0 or 1 (1 bit per
    element whatever codec the site names)."""

    @staticmethod
    def forward(ctx, x, owner, site):
        out = torch.relu(x)
        record = Record(_bitmask().encode(~(out <= 0)))
        ctx.record = record
        report_record(owner, site, record, x)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        keep = _bitmask().decode(ctx.record.enc)
        ctx.record = None
        # stock threshold_backward(grad, out, 0): grad where not (out <= 0), else 0
        return grad_out.masked_fill(~keep, 0), None, None
