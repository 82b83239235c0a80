"""The files of a checkpoint: found inside it, read with errors that name them.

Every file :func:`portable_llm.load` reads goes through :func:`checkpoint_file`, one containment
rule for all of them: a name from the folder (or from its shard index) must be a plain relative
path, and must resolve, symlinks followed, to a file inside the folder. The one exception is a
Hugging Face cache snapshot (``models--org--name/snapshots/<rev>/``), whose files are symlinks
into the repository's own ``blobs/`` folder: such a file may resolve to a file directly inside
that ``blobs/`` folder, and only when ``blobs/`` is a real folder of the repository (a
``blobs`` that is itself a symlink, to ``/`` say, lets nothing through). A symlink loop, a
malformed or too deeply nested JSON file, a failure of the ``tokenizers`` library (a Rust panic
included) are each a :class:`CheckpointError` naming the file; every message is at most
:data:`MAX_MESSAGE` characters.
"""

from __future__ import annotations

import json
from contextlib import AbstractContextManager
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

from portable_llm.text.failures import MAX_MESSAGE, foreign_errors, shorten

__all__ = [
    "LIST_AT_MOST",
    "MAX_MESSAGE",
    "CheckpointError",
    "brief",
    "checkpoint_file",
    "library_errors",
    "listed",
    "read_json",
]


#: How many names an error message lists before it says how many more there are.
LIST_AT_MOST = 12


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: a malformed file, tensors that disagree with
    ``config.json``, or a path that leads out of the folder. The message names the file; it
    is at most :data:`MAX_MESSAGE` characters long."""

    def __init__(self, message: object = "", *args: object) -> None:
        super().__init__(shorten(str(message)), *args)


def brief(value: object, /, limit: int = 80) -> str:
    """``repr(value)`` cut to about ``limit`` characters, for messages that quote a file's
    value (a 1 MB string stays a short message)."""
    if isinstance(value, list | tuple) and len(value) > limit:
        value = [*value[:limit], "..."]  # repr of a huge list would be built in full first
    text = repr(value)
    return text if len(text) <= limit else f"{text[: limit - 5]}...{text[-2:]}"


def _resolve(path: Path, where: str) -> Path:
    try:
        return path.resolve(strict=False)
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise CheckpointError(f"load: {where} {str(path)!r} cannot be resolved: {exc}") from None


def _blobs(root: Path) -> Path | None:
    """The ``blobs/`` folder of a Hub cache snapshot ``root`` (resolved), or ``None`` when
    ``root`` is not a snapshot or its repository's ``blobs`` is not a real folder of it."""
    if root.parent.name != "snapshots":
        return None
    blobs = root.parent.parent / "blobs"
    return blobs if blobs.is_dir() and not blobs.is_symlink() else None


def checkpoint_file(folder: str | Path, name: str, *, named_by: str | None = None) -> Path:
    """The path of file ``name`` of ``folder``, refused when it leads out of the folder.

    ``name`` must be relative, without ``..``; the file it names (symlinks followed) must lie
    inside ``folder``, or for a Hub cache snapshot directly inside its repository's real
    ``blobs/`` folder. The path is returned whether or not the file exists. ``named_by``: the
    file that named it (the shard index), for the message.

    Raises
    ------
    CheckpointError
        An absolute name, a ``..`` part, a NUL character, a symlink that points out of the
        folder, or a symlink loop.
    """
    folder = Path(folder)
    where = f"{named_by} names" if named_by else "the checkpoint needs"
    parts = PurePosixPath(name.replace("\\", "/")).parts
    if (
        not name
        or PurePosixPath(name).is_absolute()
        or PureWindowsPath(name).is_absolute()
        or PureWindowsPath(name).drive
        or ".." in parts
    ):
        raise CheckpointError(
            f"load: {where} {name!r}, which is not a file name inside {str(folder)!r} "
            "(absolute paths and '..' are refused)"
        )
    if "\x00" in name:
        raise CheckpointError(f"load: {where} {brief(name)}, which holds a NUL character")
    path = folder / name
    if path.is_symlink() or path.exists():
        root = _resolve(folder, "the checkpoint folder")
        target = _resolve(path, "the file")
        blobs = _blobs(root)
        inside = target.is_relative_to(root) or (blobs is not None and target.parent == blobs)
        if not inside:
            raise CheckpointError(
                f"load: {str(path)!r} leads out of the checkpoint folder (to {str(target)!r}); "
                "refused"
            )
    return path


def listed(names: list[str], /, *, sep: str = ", ") -> str:
    """The first :data:`LIST_AT_MOST` of ``names`` joined by ``sep``, then how many more (an
    error message stays short however many tensors a file gets wrong)."""
    shown = sep.join(names[:LIST_AT_MOST])
    more = len(names) - LIST_AT_MOST
    return shown + (f"{sep}... ({more} more)" if more > 0 else "")


def read_json(file: Path, *, kind: type = dict) -> Any:
    """The JSON value of ``file``; a :class:`CheckpointError` naming the file when it is not
    valid JSON (UTF-8) or its value is not a ``kind``."""
    try:
        value = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"load: {str(file)!r} is not valid JSON: {exc}") from None
    except RecursionError:
        raise CheckpointError(f"load: {str(file)!r}: JSON nested too deeply") from None
    except OSError as exc:
        raise CheckpointError(f"load: cannot read {str(file)!r}: {exc}") from None
    if not isinstance(value, kind):
        want = {"dict": "an object ({...})", "list": "a list"}.get(kind.__name__, kind.__name__)
        raise CheckpointError(f"load: {str(file)!r} must hold {want}, got {type(value).__name__}")
    return value


def library_errors(where: str) -> AbstractContextManager[None]:
    """Turn any failure of a library reading a checkpoint's file (``tokenizers`` raises bare
    ``Exception``s, and a Rust panic as ``PanicException``, which derives from
    ``BaseException``) into a :class:`CheckpointError` naming ``where``; an interrupt still
    interrupts."""
    return foreign_errors(f"load: {where}", CheckpointError)
