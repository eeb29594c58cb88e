"""One thin Typer module per subcommand: parse, call the engine or a tool package, render."""
