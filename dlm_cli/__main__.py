from dlm_cli.main import app

app()
