"""`python -m lmcli` (and `torchrun -m lmcli`) entry point."""

from lmcli.cli.app import main

if __name__ == "__main__":
    main()
