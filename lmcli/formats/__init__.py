"""Model files: every way a model is stored, read and written.

- ``checkpoint.py``: run folders and checkpoints (written atomically, checksummed, read
  consistently); ``weights.py``: safetensors weights checked against a config and read;
- ``families/``: one adapter per model family (gpt2, llama, qwen2, mistral, qwen3, smollm3,
  gemma3), each in its own module: names, configs, limits and when export writes it, shared by
  every import and export;
- ``hf/``: a Hugging Face folder in; ``gguf/``: a GGUF file in (header scan, tensors, vocabulary);
- ``model_source.py``: what a model source is (run folder, checkpoint, HF folder, GGUF file,
  LoRA run), decided once; ``lora_base.py``: a LoRA run's base model; ``sources.py``: any model
  source as a model, loaded by its kind; ``verify.py``: ``lmcli verify``;
- ``export/``: a model out as a Hugging Face folder or a GGUF file (above ``sources``).
"""
