"""The `switchsim` command line, on top of every package: each package offers an add_parser for its own
verbs (switchsim.cli, topologies.cli, inabench.cli, inabench.model_cli) and this package puts them
together. `switchsim` (the console command), `python -m inacli` and `python -m switchsim` run main()."""
from .main import build_parser, main  # noqa: F401 - the package's API
