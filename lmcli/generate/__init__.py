"""Text from a model: prompts and cached steps, sampling, and beam search.

- ``decoding.py``: prompts to ids (in a task's prompt form), ``prefill``, one cached ``step``,
  the sliding window;
- ``rules.py``: the next-token rule (repetition penalty, temperature, top-k/p, min-p, a seeded
  draw) and the text rules (stop strings, text decoded a few tokens at a time), pure functions;
- ``engine.py``: the row engine: rows under every rule of their ``SampleConfig``, joining and
  leaving a batch, and the model's steps that feed them (``lmcli sample``, ``chat``, ``serve``);
- ``sampling.py``: ``generate``, which streams text as it comes, and ``sample_texts``;
- ``beam.py``: batched beam search (beams are the batch dimension) and ``beam_texts``;
- ``speculative.py``: a draft model's proposals checked by the target; ``constrain.py``: JSON
  schema, regex and grammar masks; ``prefix_cache.py``: keys/values of prompts kept for reuse;
- ``chat.py``: ``ChatSession``, a conversation answered turn by turn (``lmcli chat``).

Nothing here reads a task's name or imports ``lmcli.data``: the prompt form comes from the
task (``lmcli.tasks``).
"""
