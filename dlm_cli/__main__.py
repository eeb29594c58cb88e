from dlm_cli.main import main

if __name__ == "__main__":  # spawned tensor-parallel ranks import this module too
    main()
