"""The generic path for models without megatron-core layers (plain torch, Hugging Face):
saved-tensor hooks that encode what autograd saves (`hooks`) and per-block recompute
(`checkpoint`)."""
