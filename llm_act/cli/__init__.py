"""`llm-act`: the command line (`main`), one module per subcommand that needs more than a flag."""
from llm_act.cli.main import main

__all__ = ["main"]
