"""How the processes share the model (``--parallel``): the choice, and Muon's matrices spread
over the ranks."""

from __future__ import annotations

import pytest
from helpers import train_config

from lmcli.config.files import replace_options
from lmcli.errors import LmcliError
from lmcli.train.distributed import Dist
from lmcli.train.optim import owners
from lmcli.train.parallel import choose_parallel

TWO = Dist(0, 0, 2)


def test_auto_shards_only_when_a_replica_does_not_fit_one_device() -> None:
    auto = train_config(corpus=("x",))
    assert choose_parallel(auto, TWO, need=10, available=100) == "ddp"
    assert choose_parallel(auto, TWO, need=100, available=10) == "fsdp"
    assert choose_parallel(auto, TWO, need=100, available=None) == "ddp", "unknown memory: replicate"
    assert choose_parallel(auto, Dist(), need=100, available=10) == "none", "one process: as it is"
    fsdp = train_config(corpus=("x",), parallel="fsdp")
    assert choose_parallel(fsdp, TWO, need=10, available=100) == "fsdp"


def test_fsdp_refuses_bleu_samples_decoded_by_rank_0_alone() -> None:
    cfg = train_config(corpus=("x",), parallel="fsdp", task="translation", bleu_samples=4)
    with pytest.raises(LmcliError, match="--parallel fsdp cannot decode BLEU samples"):
        choose_parallel(cfg, TWO, need=0, available=None)


@pytest.mark.parametrize(
    "task",
    [
        dict(task="dpo", init_from="m"),
        dict(task="grpo", init_from="m", reward=("number",)),
        dict(task="distill", teacher="t"),
    ],
)
def test_fsdp_refuses_post_training_and_distillation(task: dict) -> None:
    cfg = train_config(corpus=("x",), **task)
    with pytest.raises(LmcliError, match=f"--parallel fsdp does not run --task {task['task']} yet"):
        choose_parallel(replace_options(cfg, parallel="fsdp"), TWO, need=0, available=None)
    assert choose_parallel(cfg, TWO, need=10, available=100) == "ddp"


def test_muon_gives_each_rank_about_the_same_newton_schulz_work() -> None:
    shapes = [(96, 32), (32, 32), (32, 96), (32, 32), (32, 32), (32, 32)]
    owner = owners(shapes, 2)
    assert owner == owners(shapes, 2), "the same answer on every rank"
    cost = [0, 0]
    for shape, rank in zip(shapes, owner, strict=True):
        cost[rank] += shape[0] * shape[1] * min(shape)
    assert max(cost) <= 1.5 * min(cost) and set(owner) == {0, 1}
    assert owners(shapes, 1) == [0] * len(shapes)
