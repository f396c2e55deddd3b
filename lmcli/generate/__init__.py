"""Text from a model: the KV cache, prompts and cached steps, sampling, and beam search.

- ``kv_cache.py``: keys/values of every layer (grown as they fill, reordered for beams) and the
  left padding of a batch's rows;
- ``decoding.py``: prompts to ids, ``prefill``, one cached ``step``, the sliding window;
- ``sampling.py``: the next-token rule (temperature, top-k/p, min-p, repetition penalty) and
  ``generate``, which streams text as it comes;
- ``beam.py``: batched beam search (beams are the batch dimension) and ``beam_texts``.
"""
