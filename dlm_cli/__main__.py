from dlm_cli.main import app

if __name__ == "__main__":  # spawned tensor-parallel ranks import this module too
    app()
