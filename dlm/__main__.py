"""`python -m dlm`: the `dlm` command from a checkout or an environment without its script."""

from dlm.cli.entry import main

if __name__ == "__main__":  # spawned tensor-parallel ranks import this module too
    main()
