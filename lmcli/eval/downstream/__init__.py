"""Downstream benchmarks: multiple choice, cloze and generation tasks scored from local files.

Not the training tasks of ``lmcli/tasks.py`` (lm, translation, sft): these are the questions a
trained model is asked to see whether it is any good (HellaSwag, ARC, LAMBADA, GSM8K, ...).

- ``formats.py``: task files (lmcli's JSONL rows and the published layouts), read and checked;
- ``scoring.py``: log-likelihoods of continuations, each context run once (a KV cache shared
  by its continuations);
- ``kinds.py``: multiple choice, cloze, generation: prompts, scores (lm-evaluation-harness's
  definitions), aggregation;
- ``evaluate.py``: ``evaluate_tasks`` (``lmcli eval --task``); the scores a validation records
  (``--eval-task``) are ``lmcli.train.task_scores``.

The lm-evaluation-harness backend (``--harness``, ``python -m lmcli.eval.harness``) is
``lmcli/eval/harness/``; it scores through ``scoring.py`` too.
"""
