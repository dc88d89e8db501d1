"""`python -m llm_act.cli` and the `llm-act` command (`run`, the console script)."""
import sys

from llm_act.process.deferred_compile import defer_torch_compile


def run(argv=None) -> int:
    """`llm_act.cli.main.main`, its modules imported after `defer_torch_compile()` (megatron-core
    then starts about 4 s sooner in each `llm-act` process)."""
    defer_torch_compile()
    from llm_act.cli.main import main

    return main(argv)


if __name__ == "__main__":
    sys.exit(run())
