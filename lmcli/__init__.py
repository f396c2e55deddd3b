"""lmcli: train and use decoder-only Transformer language models from the command line."""

__version__ = "0.1.0"
