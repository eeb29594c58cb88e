"""`dlm estimate`: GPU memory plans from config.json alone (never imports torch)."""
