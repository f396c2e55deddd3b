"""lmcli: train and use decoder-only Transformer language models from the command line.

Where things live, lowest layer first (docs/architecture.md says where to change what; no
module imports a layer above its own):

- ``errors.py``, ``safe_io.py``, ``device.py``, ``tasks.py``: what every layer uses;
- ``config/``: every option, declared once; ``text/``: tokenizers and chat templates;
- ``model/``: the Transformer, its layers, the KV cache, quantized and LoRA linears, fast paths;
- ``data/``: corpora, token shards, windows, examples; ``formats/``: model files in and out;
- ``generate/``: decoding; ``eval/``: perplexity, BLEU, downstream tasks, the harness;
- ``serve/``: the server; ``train/``: the training loop; ``cli/``: the commands.
"""

__version__ = "0.1.0"
