"""`python -m llm_act.cli`: the same as the `llm-act` command."""
import sys

from llm_act.cli.main import main

if __name__ == "__main__":
    sys.exit(main())
