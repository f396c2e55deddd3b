"""Other formats in and out: Hugging Face folders and GGUF files.

- ``families/``: one adapter per model family (gpt2, llama, qwen2, mistral): names, configs and
  limits, used by every import and export below;
- ``load.py``: a local Hugging Face folder as an lmcli model and tokenizer;
- ``weights.py``: (sharded) safetensors read without copies, the model built around them;
- ``export.py``: an lmcli model as a Hugging Face folder;
- ``gguf.py``: an lmcli model as a GGUF file for llama.cpp.
"""
