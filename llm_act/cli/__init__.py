"""`llm-act`: the command line (`llm_act.cli.main`), one module per subcommand that needs more
than a flag (`plan`, `train`, `demo`) and the parsing they share (`parsing`)."""
