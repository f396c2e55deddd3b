"""Hugging Face folders in.

- ``load.py``: a local Hugging Face folder as an lmcli model and tokenizer;
- ``weights.py``: (sharded) safetensors read without copies, the model built around them.
"""
