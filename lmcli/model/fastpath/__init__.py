"""Device-specific fast paths, kept out of the model behind one hook (``Transformer.fast_step``).

- ``inference(model)``: a scope in which a CPU model decodes and evaluates faster (packed
  weights, a decoding weight layout, one-token layer steps); ``@scoped`` runs a function of a
  model inside one;
- ``step_threads(model, rows)``: the decoding steps of a small model on one thread.

None of them changes a result (the tests compare every path with the plain forward), and none
does anything elsewhere than on a CPU. ``cpu.py`` holds the scope, the one-token ``LayerStep``s
and the thread count; ``packed.py`` the oneDNN-packed copies of weights.
"""

from lmcli.model.fastpath.cpu import inference, scoped, step_threads

__all__ = ["inference", "scoped", "step_threads"]
