"""lmcli: train and use decoder-only Transformer language models from the command line.

Where things live (docs/architecture.md says where to change what):

- ``cli.py`` the commands; ``options.py`` flags derived from ``config.py``, where every option
  is declared once;
- ``model.py`` the Transformer (attention, MLPs, norms); ``positions.py`` its position schemes;
  ``tokenizer.py``; ``tasks.py`` what a model is trained to do (lm, translation, sft);
- ``data/`` corpora, the token cache, training windows, parallel text;
- ``train/`` the training loop, its state, optimizer, losses, run folder and reports;
- ``generate/`` the KV cache, cached decoding, the row engine, sampling and beam search;
- ``evaluate.py`` perplexity and bits per byte; ``bleu.py`` BLEU and chrF;
- ``checkpoint.py`` the checkpoint format; ``sources.py`` what a command is given as its model;
  ``lora.py`` LoRA layers, ``lora_run.py`` a LoRA run's base; ``hf/`` Hugging Face folders and
  GGUF files, one adapter per model family (``hf/families/``);
- ``fastpath/`` CPU inference fast paths behind ``Transformer.fast_step``;
- ``device.py`` device and precision; ``distributed.py`` torchrun.
"""

__version__ = "0.1.0"
