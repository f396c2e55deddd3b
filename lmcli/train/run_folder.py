"""A run's folder and its configs: choosing it, holding it, and resolving what a run trains with.

Options resolve as: dataclass defaults < the resumed run's config < a ``--config`` file < flags.
The run folder holds ``config.json`` (the resolved configs), ``last/``, ``best/`` and optional
``step-N/`` checkpoints (``lmcli.formats.checkpoint``), ``metrics.jsonl`` and ``loss.png``.

One writer at a time: a new run creates its folder exclusively (a default name never collides),
and every writer holds an exclusive ``flock`` on the folder's ``.lock`` file, which holds its pid,
for as long as it lives (and removes it when done); a second writer gets one line naming that pid.
"""

from __future__ import annotations

import errno
import glob
import json
import os
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from lmcli.config.fields import flag_name, option_fields
from lmcli.config.files import from_dict, option_items, replace_options, split_options, stored_fields, to_dict
from lmcli.config.model import ModelConfig
from lmcli.config.train import TOKENIZER_KINDS, TrainConfig
from lmcli.errors import LmcliError
from lmcli.formats.checkpoint import META, last_checkpoint, read_json, recover_checkpoints
from lmcli.safe_io import atomic_write, pid_alive, refuse_symlinks, remove_stale_temps
from lmcli.tasks import TASKS

LOCK = ".lock"
# temporary names of lmcli 0.2 (before lmcli.safe_io): removed at start when their writer is gone
_OLD_TEMP = re.compile(r"\.tmp-.+-(\d+)")
_OLD_TEMP_FILES = (".config.json.tmp", "metrics.jsonl.tmp", "loss.tmp.png")


def default_run_dir() -> Path:
    return Path("checkpoints") / datetime.now().strftime("run-%Y%m%d-%H%M%S")


def check_writable(path: Path) -> None:
    """Fail early, before any work, if the run folder cannot be created and written."""
    parent = path
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        raise LmcliError(f"cannot create output folder {path}: {parent} is not a folder")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".lmcli-write-test-"):
            pass
    except OSError as exc:
        raise LmcliError(f"cannot write to output folder {path}: {exc.strerror}") from None


@dataclass
class RunFolder:
    """A run folder this process writes, locked until ``release``."""

    path: Path
    lock_fd: int
    created: list[Path] = field(default_factory=list)  # folders this process made, innermost first

    def release(self) -> None:
        """Remove the lock file (if it is still ours) and unlock."""
        if self.lock_fd < 0:
            return
        try:
            mine = os.fstat(self.lock_fd)
            now = os.lstat(self.path / LOCK)
            if (now.st_ino, now.st_dev) == (mine.st_ino, mine.st_dev):
                os.unlink(self.path / LOCK)  # while still locked: a waiting writer checks the inode
        except OSError:
            pass
        os.close(self.lock_fd)
        self.lock_fd = -1

    def has_checkpoint(self) -> bool:
        return any((self.path / name / META).exists() for name in ("last", "last.old"))

    def discard(self) -> bool:
        """Remove the folder if this process made it and it holds no checkpoint (nothing a
        failed or interrupted run could resume from); True if removed."""
        if not self.created or self.has_checkpoint():
            return False
        shutil.rmtree(self.path, ignore_errors=True)
        for parent in self.created[1:]:  # parents made for it (``checkpoints/``), if now empty
            try:
                parent.rmdir()
            except OSError:
                break
        return True


def lock_run_dir(run_dir: Path) -> int:
    """An exclusive lock on ``run_dir`` for this process (the fd to keep open), or one line naming
    the process that holds it."""
    import fcntl

    path = Path(run_dir) / LOCK
    for _ in range(10):
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
        except OSError as exc:
            if exc.errno == errno.ELOOP or path.is_symlink():
                raise LmcliError(f"{path} is a symbolic link: a run folder must not contain links") from None
            raise
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise LmcliError(
                f"{run_dir} is in use by another lmcli (pid {holder}): wait for it to finish, "
                "or train into another --out"
            ) from None
        mine = os.fstat(fd)
        try:
            now = os.lstat(path)
        except FileNotFoundError:
            now = None
        if now is not None and (now.st_ino, now.st_dev) == (mine.st_ino, mine.st_dev):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
            return fd
        os.close(fd)  # the holder removed this lock file as it finished: lock the new one
    raise LmcliError(f"cannot lock {run_dir}: its lock file keeps changing")


def _make_dir(path: Path) -> list[Path]:
    """Create ``path`` exclusively (FileExistsError if it exists) and any missing parents; the
    folders made, innermost first."""
    made = []
    parent = path.parent
    while not parent.exists():
        made.append(parent)
        parent = parent.parent
    for folder in reversed(made):
        folder.mkdir(exist_ok=True)
    path.mkdir()
    return [path, *made]


def _entries(run_dir: Path) -> list[str]:
    return [p.name for p in run_dir.iterdir() if p.name != LOCK]


def create_run_dir(out: str | Path | None) -> RunFolder:
    """The folder a new run writes to, created (or, given as ``--out``, found empty) and locked:
    ``--out`` or ``checkpoints/run-<time>``, with ``-2``, ``-3``... for runs started together."""
    base = Path(out) if out else default_run_dir()
    check_writable(base)
    for n in range(1, 1000):
        run_dir = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            made = _make_dir(run_dir)
        except FileExistsError:
            if not out:
                continue  # another run took this name this second
            made = []
        except OSError as exc:
            raise LmcliError(f"cannot create output folder {run_dir}: {exc.strerror}") from None
        if not made:
            if run_dir.is_symlink():
                raise LmcliError(f"{run_dir} is a symbolic link: a run folder must not be a link")
            if not run_dir.is_dir():
                raise LmcliError(f"cannot create output folder {run_dir}: it is a file")
        folder = RunFolder(run_dir, lock_run_dir(run_dir), made)
        if not made:
            remove_stale_temps(run_dir)
            if _entries(run_dir):
                folder.release()
                raise LmcliError(
                    f"{run_dir} already holds files: resume with --resume {run_dir} or pick another --out"
                )
        return folder
    raise LmcliError(f"cannot find a free run folder name beside {base}")


def open_run_dir(run_dir: Path) -> RunFolder:
    """An existing run folder, to resume in place: no links in it, locked, cleaned of what dead
    writers left (temporary files, a swap a crash interrupted)."""
    run_dir = Path(run_dir)
    refuse_symlinks(run_dir)
    folder = RunFolder(run_dir, lock_run_dir(run_dir))
    try:
        remove_stale_temps(run_dir)
        _remove_old_temps(run_dir)
        recover_checkpoints(run_dir)
    except BaseException:
        folder.release()
        raise
    return folder


def _remove_old_temps(run_dir: Path) -> None:
    """The temporary files and folders of lmcli 0.2 whose writer is gone."""
    for path in run_dir.iterdir():
        match = _OLD_TEMP.fullmatch(path.name)
        if match and not pid_alive(int(match.group(1))) and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        elif path.name in _OLD_TEMP_FILES and path.is_file() and not path.is_symlink():
            path.unlink()


def absolute_paths(cfg: TrainConfig) -> TrainConfig:
    """Local paths (the fields declared ``path=True``) made absolute, so the stored config works
    from any folder (resume, eval). Names that are not local paths (a hub dataset) stay."""

    def fix(p: str) -> str:
        if os.path.isabs(p) or not (Path(p).exists() or glob.has_magic(p)):
            return p
        return str(Path.cwd() / p)

    changes: dict[str, Any] = {}
    for f, value in option_items(cfg):
        if not f.metadata.get("path") or value is None:
            continue
        if f.name == "tokenizer" and value in TOKENIZER_KINDS:
            continue
        changes[f.name] = tuple(fix(v) for v in value) if isinstance(value, tuple) else fix(value)
    return replace_options(cfg, **changes)


def check_resumable(saved: ModelConfig, requested: ModelConfig) -> None:
    """Resuming may change run length and the like, never what the weights compute."""
    changed = [f for f in ModelConfig.on_resume("fixed") if getattr(saved, f) != getattr(requested, f)]
    if requested.vocab_multiple == 0:  # auto asks for no padding of its own: the run keeps its rows
        changed = [f for f in changed if f != "vocab_multiple"]
    if changed:
        what = ", ".join(
            f"{f.replace('_', '-')} {getattr(saved, f)} -> {getattr(requested, f)}" for f in changed
        )
        raise LmcliError(f"cannot resume with a different model shape ({what})")


def _same_value(field: Any, given: Any, saved: Any) -> bool:
    """Whether an option given now (a flag's or a config file's value) is what the run stored:
    paths compared as the files they name, lists as tuples."""

    def norm(value: Any) -> Any:
        if isinstance(value, list | tuple):
            return tuple(norm(v) for v in value)
        if isinstance(value, str) and field.metadata.get("path") and value not in TOKENIZER_KINDS:
            local = Path(value).exists() or glob.has_magic(value)  # as absolute_paths stores it
            return os.path.realpath(value) if local else value
        return value

    return norm(given) == norm(saved)


def _shown(value: Any) -> str:
    return ", ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def check_same_run(
    run: str | Path, saved: dict[str, Any], file_options: dict[str, Any], cli_options: dict[str, Any]
) -> None:
    """A resume trains the run it resumes: one line naming the flag (or config file key) that
    would change its task, base (``--init-from``) or tokenizer, or, without
    ``--allow-new-data``, what it trains on (``TrainConfig.on_resume``)."""
    declared = {f.name: f for _, f, _ in option_fields(TrainConfig)}
    allow = cli_options.get("allow_new_data", file_options.get("allow_new_data")) or False
    fixed, data = TrainConfig.on_resume("fixed"), TrainConfig.on_resume("data")
    for source, options in (("flag", cli_options), ("config file", file_options)):
        for name, value in options.items():
            if name not in fixed and (allow or name not in data):
                continue
            f = declared[name]
            was = saved.get(name, f.default)
            if value is None or _same_value(f, value, was):
                continue
            flag = "the corpus" if f.metadata["argument"] else f"--{flag_name(name)}"
            what = f"{flag} {_shown(value)}" if source == "flag" else f"{name} = {value!r} (config file)"
            if name == "task":
                raise LmcliError(
                    f"{what}: {run} is a --task {was} run, and a resume keeps its task "
                    f"(to train it as {value}: a new run with --init-from {run})"
                )
            if name == "init_from":
                base = f"was started from {was}" if was else "was trained from scratch"
                raise LmcliError(
                    f"{what}: {run} {base}, and a resume keeps its base (to start from {value}: a new run)"
                )
            if name in fixed:
                raise LmcliError(f"{what}: {run} has its own tokenizer, and a resume keeps it: drop {flag}")
            stored = f"{flag} {_shown(was)}" if was or was == 0 else f"no {flag}"
            if name == "corpus" and not was:
                stored = "the built-in corpus"
            raise LmcliError(
                f"{what}: {run} trained with {stored}; "
                "give --allow-new-data to resume on other (or moved) data"
            )


def resolve_configs(
    file_options: dict[str, Any], cli_options: dict[str, Any], *, resume: str | Path | None = None
) -> tuple[ModelConfig, TrainConfig]:
    """Configs from dataclass defaults < the resumed run's config < a config file < CLI flags. A
    run ``--init-from`` a model takes that model's context unless ``--block-size`` is given
    (``train.init_from.open_init`` cuts the model to a shorter one)."""
    model: dict[str, Any] = {}
    train: dict[str, Any] = {}
    if resume is None and cli_options.get("allow_new_data"):
        raise LmcliError("--allow-new-data is for --resume: a new run trains on the data it is given")
    if resume is not None:
        saved = read_json(last_checkpoint(resume) / "config.json", "run config")
        model = stored_fields(ModelConfig, dict(saved.get("model", {})))
        train = stored_fields(TrainConfig, dict(saved.get("train", {})))
        train.pop("out", None)  # a resumed run writes to its own folder unless --out says otherwise
        check_same_run(resume, train, file_options, cli_options)
    for source, options in (("config file", file_options), ("options", cli_options)):
        m, t = split_options(options, source=source)
        model.update(m)
        train.update(t)
    task = TASKS.get(train.get("task", TrainConfig.task))
    for name, value in (task.defaults if task else {}).items():
        train.setdefault(name, value)
    init = train.get("init_from")
    if init and resume is None and "block_size" not in model and Path(init).exists():
        from lmcli.formats.sources import read_model_config

        model["block_size"] = read_model_config(init).block_size  # the import's own
    return from_dict(ModelConfig, model, source="model config"), from_dict(
        TrainConfig, train, source="train config"
    )


def write_run_config(run_dir: Path, model_config: ModelConfig, cfg: TrainConfig) -> None:
    """``config.json`` of the run folder: the configs the run trains with."""
    text = json.dumps({"model": to_dict(model_config), "train": to_dict(cfg)}, indent=2) + "\n"
    atomic_write(run_dir / "config.json", text)
