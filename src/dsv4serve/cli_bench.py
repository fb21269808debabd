"""`dsv4serve bench` (placeholder until the bench issue lands)."""

import typer

app = typer.Typer(help="Measure a running seat from the client side.", no_args_is_help=True)
