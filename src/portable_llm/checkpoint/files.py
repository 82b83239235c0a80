"""The files of a checkpoint folder: found inside it, read with errors that name them.

Every file :func:`portable_llm.load` reads goes through :func:`checkpoint_file`: a name from the
folder (or from its shard index) must be a plain relative path, and must resolve, symlinks
followed, inside the folder. The one exception is a Hugging Face cache snapshot
(``models--org--name/snapshots/<rev>/``), whose files are symlinks into the repository's own
``blobs/`` folder. A malformed JSON file is a :class:`CheckpointError` naming the file.
"""

from __future__ import annotations

import json
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

__all__ = ["LIST_AT_MOST", "CheckpointError", "checkpoint_file", "listed", "read_json"]

#: How many names an error message lists before it says how many more there are.
LIST_AT_MOST = 12


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be read: a malformed file, tensors that disagree with
    ``config.json``, or a path that leads out of the folder. The message names the file."""


def _roots(folder: Path) -> list[Path]:
    """Where the files of ``folder`` may live: the folder, and for a Hub cache snapshot the
    ``blobs/`` folder of its repository."""
    root = folder.resolve()
    roots = [root]
    if root.parent.name == "snapshots" and (root.parent.parent / "blobs").is_dir():
        roots.append((root.parent.parent / "blobs").resolve())
    return roots


def checkpoint_file(folder: str | Path, name: str, *, named_by: str | None = None) -> Path:
    """The path of file ``name`` of ``folder``, refused when it leads out of the folder.

    ``name`` must be relative, without ``..``; the file it names (symlinks followed) must lie
    inside ``folder``. The path is returned whether or not the file exists. ``named_by``: the
    file that named it (the shard index), for the message.

    Raises
    ------
    CheckpointError
        An absolute name, a ``..`` part, or a symlink that points out of the folder.
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
    path = folder / name
    if path.exists() or path.is_symlink():
        target = path.resolve()
        if not any(target.is_relative_to(root) for root in _roots(folder)):
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
    except OSError as exc:
        raise CheckpointError(f"load: cannot read {str(file)!r}: {exc}") from None
    if not isinstance(value, kind):
        want = {"dict": "an object ({...})", "list": "a list"}.get(kind.__name__, kind.__name__)
        raise CheckpointError(f"load: {str(file)!r} must hold {want}, got {type(value).__name__}")
    return value
