"""`dsv4serve patch status|apply|revert` (placeholder until the patches issue lands)."""

import typer

app = typer.Typer(help="Apply, verify and revert the exllamav3 / vLLM patch sets by content hash.",
                  no_args_is_help=True)
