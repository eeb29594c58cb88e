"""The `dlm` command line: thin Typer commands over the engine (see docs/cli.md)."""
