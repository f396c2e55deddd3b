"""Writing into folders that may hold planted files: run folders are shared, so they are input.

Every file lmcli writes in a run folder or a cache goes through a temporary name that is
*created* (``O_EXCL``: an existing file or a planted symlink at that name makes it fail instead
of being followed), then renamed over the destination (a rename replaces a symlink at the
destination itself, never what it points to). Temporary names carry the writer's pid, so a
later start can remove the leftovers of writers that died (``remove_stale_temps``).
"""

from __future__ import annotations

import errno
import json
import os
import re
import resource
import shutil
import stat
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from lmcli.errors import LmcliError

TEMP_MARK = ".lmtmp"  # every temporary name ends with .<pid>.<random>.lmtmp
_TEMP = re.compile(r"\.(\d+)\.[A-Za-z0-9_]+\.lmtmp$")


def _prefix(dest: Path) -> str:
    return f".{dest.name}.{os.getpid()}."


def _mkstemp(dest: Path) -> tuple[int, str]:
    """``tempfile.mkstemp`` beside ``dest``; a folder that refuses it is one line naming ``dest``
    and its folder, never the temporary name."""
    try:
        return tempfile.mkstemp(dir=dest.parent, prefix=_prefix(dest), suffix=TEMP_MARK)
    except OSError as exc:
        raise LmcliError(cannot_create(dest, exc)) from None


def cannot_create(dest: Path, exc: OSError) -> str:
    """Why nothing could be created beside ``dest``: its folder refuses it, or the OS's reason."""
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return f"cannot write {dest}: its folder {dest.parent} is read-only or immutable ({exc.strerror})"
    return f"cannot write {dest}: {exc.strerror or exc}"


def temp_file(dest: Path) -> Path:
    """A new, empty temporary file beside ``dest``, created exclusively (never a followed link)."""
    fd, name = _mkstemp(dest)
    os.close(fd)
    return Path(name)


def temp_dir(dest: Path) -> Path:
    """A new, private temporary folder beside ``dest``."""
    try:
        return Path(tempfile.mkdtemp(dir=dest.parent, prefix=_prefix(dest), suffix=TEMP_MARK))
    except OSError as exc:
        raise LmcliError(cannot_create(dest, exc)) from None


def file_mode() -> int:
    """The mode ``open()`` would give a new file (0o666 less the umask), not mkstemp's 0o600."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def atomic_write(dest: Path, data: bytes | str) -> None:
    """Write ``dest`` whole or not at all, through an exclusive temporary file and a rename."""
    dest = Path(dest)
    fd, name = _mkstemp(dest)
    try:
        os.fchmod(fd, file_mode())
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(name, dest)
    except BaseException:
        Path(name).unlink(missing_ok=True)
        raise


@contextmanager
def published(out: Path) -> Iterator[Path]:
    """A temporary file beside ``out`` to write a file to share into (a GGUF file, an importance
    matrix): renamed over ``out`` with ``open()``'s mode when the block ends, removed when it
    fails; a write that fails (a full disk, the file-size limit) is one line naming ``out``."""
    tmp = temp_file(out)
    try:
        yield tmp
        os.chmod(tmp, file_mode())  # a file to share, not the private temporary it was written as
        os.replace(tmp, out)
    except OSError as exc:
        reason = write_error(exc, tmp)
        tmp.unlink(missing_ok=True)
        raise LmcliError(f"cannot write {out}: {reason}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def refuse_special(path: Path) -> Path:
    """``path`` if it is new or a regular file; one line if it is anything else (a device such as
    ``/dev/null``, a FIFO, a folder, a link), which writing by rename would replace."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    except OSError as exc:
        raise LmcliError(f"cannot write {path}: {exc.strerror}") from None
    if not stat.S_ISREG(st.st_mode):
        kind = (
            "a symbolic link"
            if stat.S_ISLNK(st.st_mode)
            else "a folder"
            if stat.S_ISDIR(st.st_mode)
            else ("a device or a FIFO")
        )
        raise LmcliError(f"cannot write {path}: it is {kind}, not a regular file (give a new file name)")
    return path


def new_folder(out: str | Path) -> Path:
    """``out`` if it is a new or an empty folder to write into; one line naming what it is else
    (a file, a link, a folder with files)."""
    out = Path(out)
    if out.is_symlink():
        raise LmcliError(f"{out} is a symbolic link: choose a new folder name")
    if out.exists() and not out.is_dir():
        raise LmcliError(f"{out} is a file, not a folder: choose a new or empty folder")
    if out.exists() and any(out.iterdir()):
        raise LmcliError(f"{out} already holds files: choose an empty or new folder")
    return out


def write_error(exc: OSError, written: Path | None = None) -> str:
    """Why a write failed, for a message: the OS's reason, or for a short write that gives none
    (numpy's ``N requested and M written``) what explains it: a full disk, or the file-size limit
    (``ulimit -f``) that ``written`` (the file being written) reached."""
    if exc.errno is not None:
        return exc.strerror or str(exc)
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if written is not None and limit != resource.RLIM_INFINITY:
        try:
            if os.stat(written).st_size >= limit:
                return f"File too large: the file-size limit (ulimit -f) is {limit:,} bytes ({exc})"
        except OSError:
            pass
    try:
        st = os.statvfs(written.parent if written is not None else ".")
        if st.f_bavail * st.f_frsize < 1 << 20:
            return f"No space left on device ({exc})"
    except OSError:
        pass
    return str(exc)


def open_append(path: Path):  # noqa: ANN201 - a text file object
    """``path`` opened for appending, never through a symlink (a link there is an error)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError:
        if Path(path).is_symlink():
            raise LmcliError(f"{path} is a symbolic link: refusing to write through it") from None
        raise
    return os.fdopen(fd, "a", encoding="utf-8")


def refuse_symlinks(folder: Path) -> None:
    """One line naming the first symbolic link found in ``folder`` (or the folder itself)."""
    folder = Path(folder)
    if folder.is_symlink():
        raise LmcliError(f"{folder} is a symbolic link: a run folder must not contain links")
    for root, dirs, files in os.walk(folder, followlinks=False):
        for name in dirs + files:
            path = Path(root) / name
            if path.is_symlink():
                raise LmcliError(f"{path} is a symbolic link: a run folder must not contain links")


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid runs (perhaps under another user). A zombie does not: it
    has died and holds no file and no lock, waiting only to be reaped (its parent killed too, it
    may wait a while)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # Linux: the state after the command name, 'Z' for a zombie
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def remove_stale_temps(folder: Path) -> int:
    """Remove the temporary files and folders that writers which died left in ``folder``
    (their pid no longer runs); return how many were removed."""
    removed = 0
    try:
        entries = list(Path(folder).iterdir())
    except OSError:
        return 0
    for path in entries:
        match = _TEMP.search(path.name)
        if match is None or int(match.group(1)) == os.getpid() or pid_alive(int(match.group(1))):
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)
        removed += 1
    return removed


def read_json_object(path: Path, limit: int) -> dict[str, Any]:
    """A JSON object file of a model folder (at most ``limit`` bytes); {} when it does not exist;
    one line when it is too large, not JSON, nested too deeply or not an object."""
    if not path.is_file():
        return {}
    try:
        if path.stat().st_size > limit:
            raise LmcliError(f"cannot read {path}: larger than {limit >> 20} MiB")
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:
        raise LmcliError(f"cannot read {path}: {str(exc)[:200]}") from None
    if not isinstance(data, dict):
        raise LmcliError(f"{path} does not hold a JSON object")
    return data


def checked_file(path: Path) -> Path:
    """``path`` if it is a regular file, not a link: a run folder is input, and a link or a
    device there (``/dev/zero``) would make a reader hang or read outside the folder."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise LmcliError(f"{path.parent} is missing {path.name}") from None
    except OSError as exc:
        raise LmcliError(f"cannot read {path}: {exc.strerror}") from None
    if stat.S_ISLNK(st.st_mode):
        raise LmcliError(f"{path} is a symbolic link: a run folder must not contain links")
    if not stat.S_ISREG(st.st_mode):
        raise LmcliError(f"{path} is not a regular file")
    return path


# ----------------------------------------------------------------------------- reading input
#
# Every file lmcli reads goes through ``open_input`` (streamed: corpora, prompt files, GGUF) or
# ``read_input`` (whole, with a byte cap: schemas, grammars, task files, configs, index.json).
# A device (``/dev/zero``), a FIFO or a socket is refused before a byte is read (a FIFO opened
# without O_NONBLOCK would wait for a writer forever), and the cap counts the bytes actually
# read, never what ``stat`` says (a device's size is 0).


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a folder"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a device"


def open_input(path: str | Path, what: str = "") -> Any:
    """``path`` opened for reading bytes (a link is followed to its file), or one line when it
    is missing, unreadable, or not a regular file (a device, a FIFO, a folder). ``what`` names
    it in the message (``"the JSON schema"``)."""
    label = f"{what} {path}" if what else str(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO opens at once instead of waiting
    except OSError as exc:  # "No such file or directory", "Permission denied", ...
        raise LmcliError(f"cannot read {label}: {exc.strerror or exc}") from None
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise LmcliError(f"cannot read {label}: it is {_kind(mode)}, not a regular file")
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_input(path: str | Path, limit: int, what: str = "") -> bytes:
    """The bytes of the regular file ``path`` (``open_input``), at most ``limit`` of them: one
    line when it holds more (the bytes read are counted, not ``stat``'s size)."""
    label = f"{what} {path}" if what else str(path)
    with open_input(path, what) as f:
        try:
            data = f.read(limit + 1)
        except OSError as exc:
            raise LmcliError(f"cannot read {label}: {exc.strerror or exc}") from None
    if len(data) > limit:
        size = f"{limit >> 20} MiB" if limit >= 1 << 20 else f"{limit >> 10} KiB"
        raise LmcliError(f"cannot read {label}: larger than {size}")
    return data


def parse_json(text: str | bytes, where: str) -> Any:
    """Untrusted JSON parsed (a corpus row, a task row, a record of a folder), or one line
    ``WHERE: not a JSON object (why)``: not JSON, not UTF-8, or nested too deeply (``json``
    recurses once per level: ``'[' * 100000`` raises ``RecursionError``)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise LmcliError(f"{where}: not a JSON object (nested too deeply)") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise LmcliError(f"{where}: not a JSON object ({str(exc)[:200]})") from None


def check_text(text: str, where: str) -> str:
    """``text`` if Unicode can encode it; one line naming ``where`` if it holds a lone surrogate
    (JSON's ``"\\ud800"`` decodes to one: no tokenizer can read it, UTF-8 cannot hold it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        code = ord(text[exc.start])
        raise LmcliError(f"{where} holds a lone surrogate (U+{code:04X}): not text") from None
    return text


def new_file(out: str | Path) -> Path:
    """``out`` if a new file can be written there: it does not exist yet and its folder takes a
    file (tried with a temporary, removed at once); one line naming why not, before any work."""
    out = Path(out)
    if out.exists() or out.is_symlink():
        raise LmcliError(f"{out} already exists: choose a new file name")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise LmcliError(cannot_create(out, exc)) from None
    temp_file(out).unlink()
    return out
