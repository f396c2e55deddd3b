"""The model: a decoder-only Transformer and the layers it is built from.

- ``transformer.py``: ``Transformer`` (attention, MLPs, norms, blocks), one cached forward for
  training, evaluation and every decoder;
- ``positions.py``: position schemes (learned, sinusoidal, rotary with its scalings, ALiBi);
- ``documents.py``: attention masks within documents;
- ``kv_cache.py``: keys/values of every layer (grown as they fill, reordered for beams) and the
  left padding of a batch's rows;
- ``quant.py``: int8/int4 weight-only linears; ``lora.py``: LoRA adapters on a model's linears;
- ``skeleton.py``: a model on the meta device, for checks and loaders;
- ``fastpath/``: CPU inference fast paths, behind one hook (``Transformer.fast_step``).
"""
