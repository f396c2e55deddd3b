"""Text from a model: the KV cache, prompts and cached steps, sampling, and beam search.

- ``kv_cache.py``: keys/values of every layer (grown as they fill, reordered for beams) and the
  left padding of a batch's rows;
- ``decoding.py``: prompts to ids (in a task's prompt form), ``prefill``, one cached ``step``,
  the sliding window;
- ``rules.py``: the next-token rule (repetition penalty, temperature, top-k/p, min-p, a seeded
  draw) and the text rules (stop strings, text decoded a few tokens at a time), pure functions;
- ``engine.py``: the row engine: rows under every rule of their ``SampleConfig``, joining and
  leaving a batch, and the model's steps that feed them (``lmcli sample``, ``chat``, ``serve``);
- ``sampling.py``: ``generate``, which streams text as it comes, and ``sample_texts``;
- ``beam.py``: batched beam search (beams are the batch dimension) and ``beam_texts``.

Nothing here reads a task's name or imports ``lmcli.data``: the prompt form comes from the
task (``lmcli.tasks``).
"""
