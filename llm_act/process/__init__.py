"""What a process that llm_act owns does for itself: `llm-act`, the launchers, the benches'
isolated measurements and the tests' ranks. The library's public API (`apply`, `layer_spec`)
never calls these; they change the whole process.

- `deferred_compile.defer_torch_compile`: megatron-core's `torch.compile`d fusions built at
  their first call, not at import;
- `fresh.fresh_context`: fresh processes forked from a server that imported torch and
  megatron-core once."""
