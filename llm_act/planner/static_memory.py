"""What a rank holds besides its blocks' saved tensors, from the model's shape alone.

One job: the memory the planner adds to the blocks' (`llm_act.planner.analytic`) to size a step
on paper. Outside the blocks: what a pipeline stage holds around them (`outer_bytes`: the
embedding's dropout mask, the output layer's input, what the loss saves; the final norm's input
is planned, a block of its own: `llm_act.planner.analytic.outer_profile`),
the peak at the end of forward there (`loss_bytes`) and the stage's input (`input_bytes`).
Static: the parameters one rank holds (`parameters_per_rank`, the experts' share
`expert_parameters_per_rank`) and their weights, gradients and optimizer state under ZeRO
(`static_bytes`). Apart from the block model so that each says one thing; this module reads
what the two share (the losses held through a block's backward, a stored mask's dtype) from
the block model, which reads nothing of it. The budget search (`llm_act.planner.budget`)
and `llm-act plan` add it to the blocks' profile.
"""
from __future__ import annotations

import numbers
from typing import Optional

import torch

from llm_act.planner.analytic import LOSS_BYTES_PER_TOKEN, LOSS_SCALAR_BYTES, mask_dtype
from llm_act.planner.model_shape import DeviceModel, ModelShape, positive_int
from llm_act.sites import EMBEDDING_DROPOUT_MASK, LOSS_LOGITS, LOSS_LOGSUMEXP
from llm_act.output.chunked_loss import stock_logits_bytes, stored_bytes
from llm_act.output.chunked_loss import DEFAULT_CHUNK_TOKENS


def outer_bytes(shape: ModelShape, stage: int, output_loss: str = "stock") -> dict[str, int]:
    """Activation bytes a stage holds outside its blocks (counted, not planned), all
    micro-batches in flight included: the embedding's dropout mask on the first stage; on
    the last stage the output layer's input and the loss under `output_loss` (the final
    norm's input, with the norm's fp32 statistics per token, is planned:
    `llm_act.planner.analytic.outer_profile`, a block of the last stage's `stage_blocks`):

    - "stock": megatron's vocab-parallel cross entropy keeps the fp32 softmax [tokens,
      vocab/tp] and per token a bool target mask and an int64 masked target
      (`llm_act.output.stock_logits_bytes`), as `loss.logits`;
    - "chunked": the chunked linear + cross-entropy keeps one fp32 log-sum-exp per token
      (`loss.logsumexp`; with the output layer's input that is `llm_act.output.stored_bytes`)."""
    if not 0 <= stage < shape.pp:
        raise ValueError(f"stage: expected an int in [0, {shape.pp}), got {stage!r}")
    if output_loss not in ("stock", "chunked"):
        raise ValueError(f"output_loss: expected 'stock' or 'chunked', got {output_loss!r}")
    b, e, inflight = shape.micro_batch_size, shape.elem_bytes, shape.pp - stage
    n_hid = shape.local_seq * b * shape.hidden_size
    out: dict[str, int] = {}
    if stage == 0 and shape.dropout > 0:
        out[EMBEDDING_DROPOUT_MASK] = inflight * n_hid
    if stage == shape.pp - 1:
        tokens = shape.seq_length * b  # the loss sees the whole sequence
        out["output_layer.input"] = inflight * n_hid * e
        if output_loss == "stock":
            out[LOSS_LOGITS] = inflight * stock_logits_bytes(tokens, shape.padded_vocab_size // shape.tp)
        else:
            out[LOSS_LOGSUMEXP] = inflight * (stored_bytes(tokens, shape.hidden_size, e) - tokens * shape.hidden_size * e)
    return out


#: megatron-core 0.16.1's `vocab_parallel_cross_entropy` forward, per token, besides what it
#: saves (`llm_act.output.stock_logits_bytes`): GPTModel's int64 copy of the labels [s, b] (8),
#: the int64 row index (8), the fp32 max logit (4), the gathered target logit (4) and its
#: clone (4), all live at its peak
_CE_BOOKKEEPING = 8 + 8 + 4 + 4 + 4


def _mask_bytes(shape: ModelShape, device: DeviceModel) -> int:
    """Bytes per element of a stored dropout mask (`mask_dtype`, as the block's masks)."""
    return torch.empty((), dtype=mask_dtype(shape, device)).element_size()


def loss_bytes(shape: ModelShape, stage: Optional[int] = None, device: Optional[DeviceModel] = None,
               output_loss: str = "stock", chunk_tokens: Optional[int] = None) -> int:
    """`solve_plan`'s / `evaluate_plan`'s `loss_bytes` for pipeline stage `stage` (None: the
    last): what the step holds outside the blocks while every block's stored tensors are live
    and none has backpropagated yet (the loss, and the output layer's backward), all
    micro-batches in flight included. The peak is at least the stored bytes plus this.

    `outer_bytes` (the output layer's input, what the loss saves; the
    embedding's dropout mask priced for `device`: bool on CUDA, the model dtype on CPU), and
    on the last stage the larger of two events, T = s*b the tokens the loss sees, V the
    padded vocabulary per rank, e bytes per element:

    - "stock" loss, its forward: the logits in the model dtype T*V*e (the output layer's
      result, held by GPTModel while the cross entropy turns its fp32 copy into the softmax)
      and the cross entropy's per-token bookkeeping (`_CE_BOOKKEEPING`, 28 bytes);
    - "stock", the output layer's backward, the loss's softmax freed: the logits' gradient
      T*V*e, the weight's gradient V*h*e (when `DeviceModel.wgrad_temporaries`), the input's
      gradient T*h*e and the per-token losses with the loss and its seed (4T + 8);
    - "chunked" (`llm_act.output.chunked_linear_cross_entropy`, `chunk_tokens` tokens at a
      time), its backward, the larger: the fp32 weight-gradient accumulator V*h*4 and, in
      16 bits, each chunk's partial V*h*e; one chunk's softmax c*V*4 and its 16-bit copy c*V*e
      and the chunk's indices (9 bytes a token); the input's gradient T*h*e; the labels'
      int64 copy, the fp32 incoming gradient, its upcast and the per-token losses (20T), and
      the loss with its seed (8).

    The final norm's input is not here: it is a planned block (`analytic.outer_profile`),
    stored like the blocks' sites. Exact for megatron-core 0.16.1's GPTModel on CPU
    (tests/planner/test_peak_vs_measured.py).
    Not counted: the stage's input (the embedding output, which GPTModel holds until its
    forward returns): when the first layer keeps its input raw it is that stored `ln1.input`;
    a plan that encodes it has both alive at the loss, `input_bytes` more (the planner's
    `input_bytes`)."""

    device = device or DeviceModel()
    stage = shape.pp - 1 if stage is None else stage
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or not 0 <= stage < shape.pp:
        raise ValueError(f"stage: expected an int in [0, {shape.pp}), got {stage!r}")
    if output_loss not in ("stock", "chunked"):
        raise ValueError(f"output_loss: expected 'stock' or 'chunked', got {output_loss!r}")
    chunk = positive_int(DEFAULT_CHUNK_TOKENS if chunk_tokens is None else chunk_tokens, "chunk_tokens")
    stage = int(stage)
    outer = outer_bytes(shape, stage) if output_loss == "stock" else outer_bytes(shape, stage, output_loss)
    b, e, h, inflight = shape.micro_batch_size, shape.elem_bytes, shape.hidden_size, shape.pp - stage
    n_hid = shape.local_seq * b * h
    total = sum(n for k, n in outer.items() if k != EMBEDDING_DROPOUT_MASK)
    if EMBEDDING_DROPOUT_MASK in outer:
        total += inflight * n_hid * _mask_bytes(shape, device)
    if stage != shape.pp - 1:
        return total
    tokens, vocab = shape.seq_length * b, shape.padded_vocab_size // shape.tp
    losses = LOSS_BYTES_PER_TOKEN * tokens + LOSS_SCALAR_BYTES
    if output_loss == "stock":
        forward = tokens * (vocab * e + _CE_BOOKKEEPING)
        wgrad = vocab * h * e if device.wgrad_temporaries else 0
        backward = tokens * vocab * e + wgrad + tokens * h * e + losses - outer[LOSS_LOGITS]
        return total + max(forward, backward)
    c, half = min(chunk, tokens), (e if e != 4 else 0)  # fp32 weights: no 16-bit copies
    # under sequence parallelism the op re-gathers the whole sequence's hidden states
    gathered = tokens * h * e if shape.sequence_parallel and shape.tp > 1 else 0
    backward = (vocab * h * (4 + half) + c * vocab * (4 + half) + 9 * c + tokens * h * e + gathered
                + (8 + 4 + 4) * tokens + losses)
    return total + backward


def input_bytes(shape: ModelShape) -> int:
    """`solve_plan`'s / `evaluate_plan`'s `input_bytes`: the stage's input per rank (the
    embedding output, or the activations received from the previous stage), [s/tp under
    sequence parallelism, b, h] in the model dtype, which the model holds until its forward
    returns: live beside the first block's code at the end of forward when that block
    encodes its checkpoint."""
    return shape.local_seq * shape.micro_batch_size * shape.hidden_size * shape.elem_bytes


def parameters_per_rank(shape: ModelShape, stage: int) -> int:
    """Parameters one rank of pipeline stage `stage` holds (Megatron's layout: column/row
    parallel linears split over TP, norms and row-parallel biases replicated)."""
    h, t, d = shape.hidden_size, shape.tp, shape.head_dim
    a, g = shape.num_attention_heads, shape.num_query_groups
    norm = (2 if shape.normalization == "LayerNorm" else 1) * h
    qkv_out = (a + 2 * g) * d // t
    bias = shape.bias
    layer = (2 * norm
             + h * qkv_out + (qkv_out if bias else 0)
             + a * d // t * h + (h if bias else 0)
             + h * (shape.fc1_width // t) + (shape.fc1_width // t if bias else 0)
             + shape.ffn_hidden_size // t * h + (h if bias else 0))
    if shape.is_moe:  # the router and this rank's experts (no biases) instead of the MLP
        layer -= (h * (shape.fc1_width // t) + (shape.fc1_width // t if bias else 0)
                  + shape.ffn_hidden_size // t * h + (h if bias else 0))
        layer += h * shape.num_experts + shape.num_experts // shape.ep * (
            h * shape.moe_fc1_width + shape.moe_ffn_hidden_size * h)
    if shape.qk_layernorm:  # the q and k norms over head_dim, replicated
        layer += 2 * norm // h * d
    total = shape.layers_per_stage * layer
    emb = shape.padded_vocab_size // t * h
    if stage == 0:
        total += emb + (shape.seq_length * h if shape.position_embedding == "learned_absolute" else 0)
    if stage == shape.pp - 1:
        total += norm
        if not shape.tie_embeddings or shape.pp > 1:  # its own output weight, or the tied copy
            total += emb
    return total


def static_bytes(shape: ModelShape, zero_stage: int = 0, dp: int = 1,
                 stage: Optional[int] = None) -> int:
    """Weights, gradients, fp32 master weights and Adam moments held by one rank.

    Per parameter: weights in the model dtype; gradients in fp32 for bf16 (Megatron's
    main_grad) else in the model dtype; an fp32 master copy unless the model is fp32;
    Adam's two fp32 moments. ZeRO over `dp` ranks shards the optimizer state (stage 1),
    then the gradients (2), then the weights (3). `stage` None: the largest pipeline stage.

    An MoE model's experts (`expert_parameters_per_rank`) shard over their own
    data-parallel group instead, as megatron-core's distributed optimizer does: the `dp`
    data-parallel ranks of the dense parameters hold `ep` different expert shards, so each
    expert parameter is replicated over dp / ep ranks only (1 at dp = ep: nothing to shard).
    """
    if isinstance(zero_stage, bool) or zero_stage not in (0, 1, 2, 3):
        raise ValueError(f"zero_stage: expected 0, 1, 2 or 3, got {zero_stage!r}")
    dp = positive_int(dp, "dp")
    if stage is None:
        return max(static_bytes(shape, zero_stage, dp, k) for k in range(shape.pp))
    if isinstance(stage, bool) or not isinstance(stage, numbers.Integral) or not 0 <= stage < shape.pp:
        raise ValueError(f"stage: expected an int in [0, {shape.pp}), got {stage!r}")
    if shape.ep > 1 and dp % shape.ep:
        raise ValueError(f"dp={dp} is not a multiple of ep={shape.ep}: megatron-core takes the "
                         f"expert-parallel ranks from the data-parallel ones (set dp to a multiple of ep)")
    experts = expert_parameters_per_rank(shape, int(stage))
    e = shape.elem_bytes

    def held(n: int, group: int) -> int:
        weights = n * e
        grads = n * (4 if shape.dtype == "bf16" else e)
        optim = n * ((0 if shape.dtype == "fp32" else 4) + 8)

        def shard(nbytes: int, from_stage: int) -> int:
            return -(-nbytes // group) if zero_stage >= from_stage else nbytes

        return shard(optim, 1) + shard(grads, 2) + shard(weights, 3)

    return held(parameters_per_rank(shape, int(stage)) - experts, dp) + held(experts, dp // shape.ep)


def expert_parameters_per_rank(shape: ModelShape, stage: int) -> int:
    """The share of `parameters_per_rank` in this rank's experts (0 for a dense model): what
    shards over the expert data-parallel group (`static_bytes`)."""
    if not shape.is_moe:
        return 0
    h = shape.hidden_size
    return shape.layers_per_stage * shape.num_experts // shape.ep * (
        h * shape.moe_fc1_width + shape.moe_ffn_hidden_size * h)
