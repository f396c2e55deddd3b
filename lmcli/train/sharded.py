"""Writing and restoring a run's checkpoints, whole or sharded (``torch.distributed.checkpoint``).

A whole checkpoint (one process, DDP) is written by rank 0 alone: ``lmcli.formats.checkpoint``'s folder,
the training state in ``trainer_state.pt``. A sharded one (``--parallel fsdp``) is the same
folder with DCP's files in place of ``trainer_state.pt``:

    model.safetensors (or a LoRA run's adapters), config.json, tokenizer.json
                        the whole weights, gathered to rank 0: what eval, sample, export and
                        serve read, unchanged
    .metadata           DCP's index of the shards
    __<rank>_0.distcp   each process's shard of the training state: the model, the optimizer
                        (keyed by parameter name), the weight averages, and the counters, grad
                        scaler and every rank's RNGs (``StateRegistry``'s parts)
    meta.json           step, metrics, the sha256 of every file above

Every process writes its shard into rank 0's temporary folder, in the background
(``dcp.async_save``: the state is copied to host memory, training goes on); once every shard is
written, rank 0 records the checksums and renames the folder into place (``commit_checkpoint``),
so the guarantees of a whole checkpoint hold: atomic, checksummed, one writer (rank 0 holds the
run folder's lock), SIGKILL-safe (a killed save leaves a temporary folder the next start
removes, and the previous checkpoint). Restoring reads the shards with DCP, which reshards: a
checkpoint of N processes resumes on M, or on one process without torchrun.
"""

from __future__ import annotations

import pickle
import shutil
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import (
    ADAPTERS,
    BASE,
    SHARD_INDEX,
    Checkpoint,
    commit_checkpoint,
    is_sharded,
    read_configs,
    read_json,
    save_checkpoint,
    write_files,
)
from lmcli.formats.lora_base import checked_base
from lmcli.formats.weights import unwrap
from lmcli.model import lora
from lmcli.safe_io import temp_dir
from lmcli.train.distributed import Dist, on_main
from lmcli.train.state import StateRegistry

Then = Callable[[Path], None]  # what rank 0 does once a checkpoint is in place (copies: best/, step-N/)


# ----------------------------------------------------------------------------- state dicts


def is_distributed(module: torch.nn.Module) -> bool:
    """Whether ``module``'s parameters are sharded (``fully_shard``): asked of its modules, not
    of its parameters, which are whole tensors while they are gathered (the root's and the last
    block's stay gathered after a forward without a backward: validation)."""
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in module.modules())


def gathered_state(module: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """A sharded module's whole state dict, gathered to rank 0's CPU one tensor at a time (every
    process calls it; the others get {}); a LoRA model's trained tensors alone (what its
    checkpoint stores: the frozen base is not gathered); None for a module that is not sharded."""
    if not is_distributed(module):
        return None
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    frozen = lora.has_adapters(unwrap(module))  # saved as adapters: the base is not written
    options = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=frozen)
    return get_model_state_dict(module, options=options)


def _full(state: dict[str, Any]) -> bool:
    """Whether a state dict holds whole tensors (an ordinary checkpoint's) rather than shards."""
    from torch.distributed.tensor import DTensor

    return not any(isinstance(v, DTensor) for v in _tensors(state))


def _tensors(value: Any) -> list[Any]:
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    return [value] if isinstance(value, torch.Tensor) else []


class ModuleState:
    """A module's state dict as DCP keeps it (``get_model_state_dict``: parameter names, shards of
    sharded parameters); loads whole tensors (an ordinary checkpoint's) as well as shards."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.module)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

        whole = _full(state) and is_distributed(self.module)
        set_model_state_dict(self.module, state, options=StateDictOptions(full_state_dict=whole))


class OptimizerState:
    """An optimizer's state keyed by parameter name (``get_optimizer_state_dict``), for DCP; it
    loads an ordinary checkpoint's state (keyed by parameter index) too. ``MuonAdamW`` is its
    two optimizers."""

    def __init__(self, model: torch.nn.Module, optimizer: Any) -> None:
        self.model, self.optimizer = model, optimizer
        self.parts = [optimizer.muon, optimizer.adamw] if hasattr(optimizer, "muon") else [optimizer]

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

        return get_optimizer_state_dict(self.model, self.parts)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

        whole = "muon" in state or any(isinstance(k, int) for k in state.get("state", {}))
        if whole:  # an ordinary checkpoint's: by index, whole tensors
            saved = [state["muon"], state["adamw"]] if "muon" in state else [state]
            state = self._by_name(saved)
        options = StateDictOptions(full_state_dict=whole and is_distributed(self.model))
        set_optimizer_state_dict(self.model, self.parts, state, options=options)

    def _by_name(self, saved: list[dict[str, Any]]) -> dict[str, Any]:
        """Optimizer state dicts keyed by parameter index, as one keyed by parameter name."""
        names = {id(p): name for name, p in self.model.named_parameters()}
        merged: dict[str, Any] = {"state": {}, "param_groups": []}
        for optim, sd in zip(self.parts, saved, strict=True):
            name_of: dict[int, str] = {}  # the indices run on across the optimizer's groups
            for group, saved_group in zip(optim.param_groups, sd["param_groups"], strict=True):
                ids = dict(zip(saved_group["params"], group["params"], strict=True))
                name_of.update({i: names[id(p)] for i, p in ids.items()})
                merged["param_groups"].append({**saved_group, "params": [name_of[i] for i in ids]})
            merged["state"].update({name_of[i]: s for i, s in sd["state"].items()})
        return merged


def dcp_parts(model: torch.nn.Module, states: StateRegistry) -> dict[str, Any]:
    """What a sharded checkpoint holds: the model, and every registered part of the run, the
    optimizer keyed by parameter name and each weight average's module as the model is."""
    parts: dict[str, Any] = {"model": ModuleState(model)}
    for name, part in states.parts.items():
        if hasattr(part, "param_groups"):
            part = OptimizerState(model, part)
        elif hasattr(part, "averaged"):
            part = ModuleState(part.averaged)
        parts[name] = part
    return parts


# ----------------------------------------------------------------------------- writing


@dataclass
class Pending:
    """A sharded checkpoint being written in the background; ``commit`` puts it in place."""

    future: Any  # DCP's future: done when every process's shard is written
    tmp: Path
    dest: Path
    meta: dict[str, Any]
    then: Then | None
    main: bool

    def commit(self) -> None:
        try:
            self.future.result()
        except BaseException:
            if self.main:
                shutil.rmtree(self.tmp, ignore_errors=True)
            raise
        if self.main:
            commit_checkpoint(self.tmp, self.dest, self.meta)
            if self.then is not None:
                self.then(self.dest)


@dataclass
class Contents:
    """What a checkpoint folder holds besides the module's weights."""

    cfg: Any  # the TrainConfig
    tokenizer: Any
    meta: dict[str, Any]  # meta.json (step, losses, time)
    states: StateRegistry | None = None  # the parts a resume restores (None: weights only)
    base: dict[str, Any] | None = None  # a LoRA run's base reference
    then: Then | None = None  # what rank 0 does once the folder is in place


def save_whole(dest: Path, module: torch.nn.Module, dist_info: Dist, contents: Contents) -> None:
    """A whole checkpoint, by rank 0 (every process calls it: the RNG states are gathered)."""
    c = contents
    state = c.states.state_dict() if c.states is not None else None
    if dist_info.is_main:
        save_checkpoint(dest, module, c.cfg, c.tokenizer, meta=c.meta, state=state, base=c.base)
        if c.then is not None:
            c.then(dest)


def save_sharded(
    dest: Path, module: torch.nn.Module, dist_info: Dist, contents: Contents, group: Any = None
) -> Pending | None:
    """A sharded checkpoint (every process calls it): rank 0 writes the whole weights, configs
    and tokenizer, every process its shard of ``states`` in the background (on ``group``); the
    ``Pending`` write to ``commit``. Without ``contents.states`` (a weight average's folder: weights only)
    it is committed before returning, and None is returned."""
    c = contents
    gathered = gathered_state(module)
    dest = Path(dest)

    def start() -> Path:
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = temp_dir(dest)
        try:
            write_files(tmp, module, c.cfg, c.tokenizer, base=c.base, gathered=gathered)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return tmp

    tmp = on_main(start, dist_info)
    if c.states is None:
        future: Any = _done()
    else:
        import torch.distributed.checkpoint as dcp

        future = dcp.async_save(dcp_parts(module, c.states), checkpoint_id=str(tmp), process_group=group)
    pending = Pending(future, tmp, dest, c.meta, c.then, dist_info.is_main)
    if c.states is None:
        pending.commit()
        return None
    return pending


def _done() -> Any:
    from concurrent.futures import Future

    future: Future = Future()
    future.set_result(None)
    return future


# ----------------------------------------------------------------------------- reading

# What a DCP index (``.metadata``, a pickle) may name: DCP's own record types, torch.Size, dtypes,
# layouts and paths. Anything else is refused before it is built: a run folder is untrusted
# input, and nothing in it may run code (docs/reliability.md).
_INDEX_GLOBALS = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "TensorProperties",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"),
    ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
}


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a DCP index, building only the types in ``_INDEX_GLOBALS`` (and dtypes)."""

    def find_class(self, module: str, name: str) -> Any:
        dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _INDEX_GLOBALS or dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of a checkpoint index")


def safe_reader(ckpt: Path) -> Any:
    """DCP's ``FileSystemReader`` of ``ckpt`` whose index is read by ``_IndexUnpickler`` (DCP's
    own reads it with ``pickle.load``, which runs whatever the file names)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            with open(self._get_metadata_path(kwargs.get("rank")), "rb") as f:
                index = _IndexUnpickler(f).load()
            if getattr(index, "storage_meta", None) is None:
                index.storage_meta = StorageMeta()
            index.storage_meta.load_id = self.load_id
            return index

    return SafeReader(str(ckpt))


def safe_planner() -> Any:
    """DCP's ``DefaultLoadPlanner`` (a part the checkpoint lacks keeps its state) that loads the
    non-tensor values (counters, RNG states, optimizer settings) with ``weights_only=True``, as
    ``trainer_state.pt`` is loaded (DCP's own loads them with ``weights_only=False``)."""
    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class SafePlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: Any) -> None:
            loaded = torch.load(value, weights_only=True)
            fqn = read_item.dest_index.fqn
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return SafePlanner(allow_partial_load=True)


def open_sharded(ckpt: Path, dist_info: Dist) -> Checkpoint:
    """A sharded checkpoint to resume from, without its weights (they come from the shards):
    its configs, tokenizer and LoRA base; every file's checksum checked by rank 0 (a missing
    shard is one line)."""
    on_main(lambda: read_configs(ckpt, verify=True), dist_info)
    meta, model_config, train_config, tokenizer = read_configs(ckpt, verify=False)
    base = None
    if (ckpt / ADAPTERS).exists():
        base = read_json(ckpt / BASE, "LoRA base reference")
        checked_base(ckpt, base)
    return Checkpoint(ckpt, None, model_config, train_config, tokenizer, meta, None, base)  # type: ignore[arg-type]


def read_index(ckpt: Path) -> Any:
    """A sharded checkpoint's index (DCP's ``Metadata``), once every shard file it names is
    there: one line naming a missing one (a folder copied in part)."""
    try:
        index = safe_reader(ckpt).read_metadata()
    except (OSError, RuntimeError, ValueError, EOFError, AttributeError, pickle.UnpicklingError) as exc:
        raise LmcliError(f"cannot read the sharded checkpoint index {ckpt / SHARD_INDEX}: {exc}") from None
    named = sorted({item.relative_path for item in (index.storage_data or {}).values()})
    missing = [name for name in named if not (ckpt / name).is_file()]
    if missing:
        raise LmcliError(f"sharded checkpoint {ckpt} is missing its shard {missing[0]}")
    return index


def saved_optimizer(ckpt: Path) -> str:
    """``muon`` or ``adamw``: the optimizer whose state a sharded checkpoint holds."""
    keys = read_index(ckpt).state_dict_metadata
    return "muon" if any(key.endswith("momentum_buffer") for key in keys) else "adamw"


def restore_sharded(ckpt: Path, model: torch.nn.Module, states: StateRegistry) -> None:
    """Every registered part (and the model) from a sharded checkpoint's shards, resharded to
    this run's processes; a part the checkpoint lacks (``--ema`` added) keeps its fresh state,
    a rank it lacks keeps its seeded RNGs."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        with warnings.catch_warnings():  # one process without torchrun: DCP says it reads alone
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
            dcp.load(dcp_parts(model, states), storage_reader=safe_reader(ckpt), planner=safe_planner())
    except (CheckpointException, OSError, RuntimeError, ValueError, pickle.UnpicklingError) as exc:
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else type(exc).__name__
        raise LmcliError(f"cannot read the sharded checkpoint {ckpt / SHARD_INDEX}: {first}") from None


def restore_whole(saved: dict[str, Any], model: torch.nn.Module, states: StateRegistry) -> None:
    """Every registered part from an ordinary ``trainer_state.pt`` into a sharded run: the
    optimizer and weight averages take their rows of the whole tensors."""
    parts = {name: part for name, part in dcp_parts(model, states).items() if name != "model"}
    StateRegistry(parts).load_state_dict(saved)


def check_optimizer(was: str, cfg: Any) -> None:
    """One line when the saved optimizer (``adamw``/``muon``) is not this run's."""
    if was != cfg.optimizer_kind:
        raise LmcliError(
            f"cannot resume a run trained with --optimizer {was} with --optimizer {cfg.optimizer_kind}"
        )


def restore(states: StateRegistry, saved: dict[str, Any], cfg: Any) -> None:
    """A resumed run's state from ``trainer_state.pt``: every registered part (this rank's RNGs,
    its GPU's only), once the saved optimizer is known to be this run's."""
    check_optimizer("muon" if "muon" in saved["optimizer"] else "adamw", cfg)
    states.load_state_dict(saved)


def restore_run(resumed: Checkpoint, model: torch.nn.Module, states: StateRegistry, cfg: Any) -> None:
    """A resumed run's state, whatever wrote it and however this run's parameters are placed:
    a sharded checkpoint's shards (resharded), or ``trainer_state.pt`` (whole; into sharded
    parameters, each process its rows)."""
    if is_sharded(resumed.path):
        check_optimizer(saved_optimizer(resumed.path), cfg)
        restore_sharded(resumed.path, model, states)
    elif is_distributed(model):
        saved = resumed.state or {}
        check_optimizer("muon" if "muon" in saved["optimizer"] else "adamw", cfg)
        restore_whole(saved, model, states)
    else:
        restore(states, resumed.state or {}, cfg)
