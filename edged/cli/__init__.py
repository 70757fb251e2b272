"""edgectl, one module per subcommand.

A module here that defines `register(sub)` is a subcommand: `register` adds its parser(s) to
argparse's subparsers and sets `func` to the handler `(args) -> int`; its `ORDER` is its place
in `edgectl --help`. `main.py` finds these modules (no hand list) and maps the errors they
share to exit codes; `common.py` holds what several of them use. A subcommand module imports
nothing heavy at module level (numpy, the runtimes, the selection or serving code): its
handler does, so `edgectl status --help` stays light (tests/cli/test_cli_imports.py).
"""
