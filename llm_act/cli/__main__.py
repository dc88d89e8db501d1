"""`python -m llm_act.cli`: the same as the `llm-act` command."""
import sys

from llm_act.cli.main import main

sys.exit(main())
