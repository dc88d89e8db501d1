"""GPT pretraining on megatron-core with llm_act, for torchrun (Megatron-LM's flag names).

    torchrun --nproc_per_node 2 launch/pretrain_gpt.py --tensor-model-parallel-size 2 \
        --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 \
        --micro-batch-size 4 --train-iters 40 --act-compress

Runs on CPU (gloo) and on GPUs (NCCL); the loop lives in `llm_act.train`.
"""
import sys

from llm_act.process.deferred_compile import defer_torch_compile

defer_torch_compile()  # before megatron-core is imported: it starts about 4 s sooner

from llm_act.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
