"""Small DeepSpeed training run with llm_act's activation compression (CPU or GPU).

    deepspeed --num_gpus 2 launch/ds_train.py --deepspeed_config launch/ds_config.json
    deepspeed --num_gpus 2 launch/ds_train.py --deepspeed_config launch/ds_config.json --model hf

Prints the loss and the saved-activation bytes of every step; `--no-act-compress` runs the
same without compression. The loop lives in `llm_act.train.ds_train`. On a host without CUDA
it builds no DeepSpeed C++ op: Adam/AdamW run as torch's, and gloo does the all-reduce.
"""
import sys

from llm_act.process.deferred_compile import defer_torch_compile

defer_torch_compile()  # before megatron-core is imported: it starts about 4 s sooner

from llm_act.train.ds_train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
