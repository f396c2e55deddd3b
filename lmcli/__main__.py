"""`python -m lmcli` (and `torchrun -m lmcli`) entry point."""

from lmcli.cli import main

if __name__ == "__main__":
    main()
