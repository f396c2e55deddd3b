"""What the post-training methods share: the reference they hold, the fields they log (means
between log points), and the memory and words of the reference in the pre-flight."""

from __future__ import annotations

from lmcli.train.post.reference import Reference
from lmcli.train.run import M, Method, Run

WHERE = {
    "adapters": "the base (LoRA adapters off, no copy)",
    "copy": "a frozen copy of the starting model",
    "table": "log-probs precomputed once",
    "none": "none",
}  # the pre-flight's words for each kind of reference


class PostMethod(Method[M]):
    """A post-training method (``--task dpo``/``grpo``): its reference (the model as training
    started, kept as ``Reference`` says) and the quantities each step adds (``add``), averaged
    between log points (``logged``)."""

    def __init__(self, reference: Reference) -> None:
        self.reference = reference
        self._sums: dict[str, float] = {}
        self._counts: dict[str, int] = {}

    def add(self, values: dict[str, float]) -> None:
        for key, value in values.items():
            self._sums[key] = self._sums.get(key, 0.0) + value
            self._counts[key] = self._counts.get(key, 0) + 1

    def logged(self) -> dict[str, float]:
        """The means since the last call (what metrics.jsonl and the progress bar show)."""
        out = {key: total / self._counts[key] for key, total in self._sums.items()}
        self._sums, self._counts = {}, {}
        return out

    def memory(self, run: Run, shards: int) -> int:
        """The training step's bytes and the reference's frozen copy, if it keeps one."""
        return super().memory(run, shards) + self.reference.nbytes

    def reference_words(self) -> str:
        return f"reference: {WHERE[self.reference.kind]}"
