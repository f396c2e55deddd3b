"""lmcli models in EleutherAI's lm-evaluation-harness, and its tasks in ``lmcli eval --harness``.

- ``lm.py``: ``LmcliLM``, the harness's ``LM`` for lmcli's models, registered as ``lmcli``;
- ``runner.py``: ``run_harness`` (``lmcli eval --harness``), the harness's task index, its results
  as lmcli's rows, and ``task_config``: an lmcli task file as a harness task;
- ``__main__.py``: ``python -m lmcli.eval.harness ARGS``, the ``lm_eval`` command with ``lmcli``
  among its models.

lm-evaluation-harness 0.4.13 finds models only in its own registry: it reads no entry point or
plugin, and ``--include_path`` holds task YAMLs only. So the registration happens when this
package is imported, and ``python -m lmcli.eval.harness ARGS`` is ``lm_eval ARGS`` with it imported:
``python -m lmcli.eval.harness --model lmcli --model_args path=RUN --tasks hellaswag``. In Python:
``import lmcli.eval.harness`` then ``lm_eval.simple_evaluate(model="lmcli", ...)``.
"""

from lmcli.eval.harness.lm import LmcliLM
from lmcli.eval.harness.runner import harness_results, run_harness, task_config, task_manager

__all__ = ["LmcliLM", "harness_results", "run_harness", "task_config", "task_manager"]
