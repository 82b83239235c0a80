"""Hub repository ids (``"org/name"``) resolved to a checkpoint in the local Hugging Face cache.

:func:`resolve_checkpoint` turns what :func:`portable_llm.load` was given into a local path: an
existing path stays as it is; a name shaped like a Hub repository id is looked up in the cache
that ``huggingface_hub`` keeps (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``), laid out as ``models--org--name/snapshots/<commit>/...`` with
``refs/<branch>`` naming the commit and the files symlinked into ``blobs/``. ``revision`` picks
a branch, tag or commit (default ``main``); ``gguf_file`` picks the ``.gguf`` file of a GGUF
repository. Nothing is ever downloaded, whether or not ``HF_HUB_OFFLINE`` is set: a name that
is not in the cache is one ``FileNotFoundError`` that says how to fetch it.

What a Hub id may reach (docs/security.md, "Hub ids"): ``revision`` is a branch or tag name
under git's ref-name rules (:func:`check_revision`: no ``..``, no absolute path, no backslash,
at most :data:`MAX_REVISION` characters) or a 40-hex commit; a ref file is a regular file read
to at most :data:`MAX_REF_BYTES` bytes and must hold a 40-hex commit; the ref and the snapshot,
symlinks resolved, lie inside the cache folder, the snapshot directly in its repository's
``snapshots/`` folder; and every file of the snapshot passes the containment rule of
:func:`~portable_llm.checkpoint.files.checkpoint_file`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from portable_llm.checkpoint.files import CheckpointError, brief, checkpoint_file
from portable_llm.extras import install_hint

__all__ = [
    "MAX_REF_BYTES", "MAX_REVISION", "check_revision", "hub_cache", "is_repo_id",
    "resolve_checkpoint",
]  # fmt: skip

#: The longest ``revision`` taken (git has no limit; a file name has 255 bytes).
MAX_REVISION = 255
#: The most bytes read of a ref file (huggingface_hub writes the 40-hex commit, nothing else).
MAX_REF_BYTES = 128
_COMMIT = re.compile(r"[0-9a-f]{40}")
#: What git's ``check-ref-format`` refuses anywhere in a ref name (and a backslash).
_REF_REFUSED = re.compile(r"[\x00-\x20\x7f~^:?*\[\\]|\.\.|@\{|//")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def is_repo_id(name: str, /) -> bool:
    """Whether ``name`` is shaped like a Hub repository id (``org/name``, one slash)."""
    return bool(_REPO_ID.match(name)) and ".." not in name


def check_revision(revision: str, /) -> str:
    """``revision`` when it is a branch or tag name or a 40-hex commit, else a ``ValueError``.

    A name follows git's ref-name rules (``git check-ref-format --allow-onelevel``): no ``..``,
    no ``@{``, no control character, space, ``~ ^ : ? * [`` or backslash, no leading, trailing or
    doubled ``/``, no part that starts with ``.`` or ends with ``.lock``, no trailing ``.``, not
    ``@``; and at most :data:`MAX_REVISION` characters. So an absolute path (``/dev/zero``) or a
    ``..`` never reaches the file system.
    """
    if not isinstance(revision, str):
        raise TypeError(f"load: revision must be a str or None, got {type(revision).__name__}")
    if _COMMIT.fullmatch(revision):
        return revision
    problem = _ref_problem(revision)
    if problem:
        raise ValueError(
            f"load: revision={brief(revision)} is not a branch or tag name ({problem}) nor a "
            "40-hex commit"
        )
    return revision


def _ref_problem(name: str) -> str | None:
    """Why ``name`` is not a git ref name, or ``None``."""
    bad = _REF_REFUSED.search(name)
    if not name:
        return "it is empty"
    if len(name) > MAX_REVISION:
        return f"{len(name)} characters, more than {MAX_REVISION}"
    if name.startswith("/"):
        return "an absolute path"
    if bad:
        return f"it holds {bad.group()!r}"
    if not name.isprintable():  # format characters, lone surrogates
        return "it holds a character that is not printable"
    if name == "@":
        return "it is '@'"
    if name.endswith(("/", ".")):
        return f"it ends with {name[-1]!r}"
    if any(part.startswith(".") or part.endswith(".lock") for part in name.split("/")):
        return "a part starts with '.' or ends with '.lock'"
    return None


def hub_cache() -> Path:
    """The Hugging Face cache folder, read when asked: ``$HF_HUB_CACHE``, else
    ``$HF_HOME/hub``, else huggingface_hub's default."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]) / "hub"
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "on", "yes", "true")


def resolve_checkpoint(
    path: str | Path, /, *, revision: str | None = None, gguf_file: str | None = None
) -> Path:
    """The local path of a checkpoint: ``path`` itself when it exists (a folder, or a ``.gguf``
    file), else the cached snapshot of the Hub repository ``path`` names; with ``gguf_file``,
    that file of the folder or snapshot.

    Raises
    ------
    FileNotFoundError
        ``path`` neither exists nor is a Hub repository id in the cache (at ``revision``), or
        ``gguf_file`` is not in it (the ``.gguf`` files it holds are listed).
    ValueError
        ``revision`` given for a local path; ``huggingface_hub`` missing for a Hub id.
    CheckpointError
        A snapshot outside its repository's ``snapshots/`` folder, or a ``gguf_file`` that
        leads out of the folder.
    """
    local = Path(path)
    if local.exists() or not isinstance(path, str) or not is_repo_id(path):
        if revision is not None:
            raise ValueError(
                f"load: revision={brief(revision)} applies to Hub repository ids ('org/name'), but "
                f"{str(path)!r} is a local path"
            )
        folder = local
    else:
        folder = _snapshot(path, revision)
    if gguf_file is None:
        if folder.is_dir() and not (folder / "config.json").exists():
            ggufs = sorted(p.name for p in folder.glob("*.gguf"))
            if ggufs:
                raise FileNotFoundError(
                    f"load: {str(path)!r} holds GGUF files and no config.json: pass "
                    f"gguf_file= one of {', '.join(ggufs[:12])}"
                )
        return folder
    if not folder.is_dir():
        raise ValueError(f"load: gguf_file= names a file of a folder, but {str(path)!r} is not one")
    file = checkpoint_file(folder, gguf_file)
    if not file.is_file():
        ggufs = sorted(p.name for p in folder.glob("*.gguf"))
        raise FileNotFoundError(
            f"load: no {brief(gguf_file)} in {str(path)!r}; its GGUF files: "
            f"{', '.join(ggufs[:12]) or 'none'}"
        )
    return file


def _snapshot(repo_id: str, revision: str | None) -> Path:
    """The cached snapshot folder of ``repo_id`` at ``revision`` (never downloaded).

    The lookup is huggingface_hub's offline one (``refs/<revision>`` names the commit, the
    snapshot is ``snapshots/<commit>``), done here under the rules of this module:
    ``snapshot_download(local_files_only=True)`` reads a ref, and its ``trees/<commit>.json``,
    wherever their symlinks lead and to their end."""
    if revision is not None:
        check_revision(revision)
    if "--" in repo_id:  # the cache's separator: 'a--b/c' and 'a/b--c' share a folder
        raise ValueError(f"load: {repo_id!r} is not a Hub repository id: it holds '--'")
    try:
        import huggingface_hub  # noqa: F401  (hub_cache: where the cache is)
    except ImportError as exc:
        raise ValueError(
            f"load: {repo_id!r} is not a local path; Hub names need huggingface_hub: "
            f"{install_hint('hub')}"
        ) from exc
    cache = hub_cache()
    at = f" at revision {revision!r}" if revision else ""
    root = _resolved(cache, "the Hub cache", None)
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    commit = _commit(repo, revision or "main", root)
    found = repo / "snapshots" / (commit or "")
    if commit is None or not found.is_dir():
        how = (
            "HF_HUB_OFFLINE is set, and pl.load never downloads"
            if _offline()
            else f"pl.load never downloads: fetch it first (hf download {repo_id})"
        )
        raise FileNotFoundError(
            f"load: {repo_id!r} is neither a local path nor a Hub repository in the cache "
            f"{str(cache)!r}{at} ({how})"
        ) from None
    snapshots = _resolved(repo / "snapshots", "the snapshots folder", root)
    if _resolved(found, "the snapshot", root).parent != snapshots:
        raise CheckpointError(
            f"load: the cache names {str(found)!r} for {repo_id!r}{at}, which is not a snapshot "
            f"of the repository (in {str(snapshots)!r}); refused"
        )
    return found


def _commit(repo: Path, revision: str, root: Path) -> str | None:
    """The commit ``revision`` names: itself when 40-hex, else what ``refs/<revision>`` of the
    cached ``repo`` holds; ``None`` when there is no such ref."""
    if _COMMIT.fullmatch(revision):
        return revision
    ref = repo / "refs" / revision
    if not (ref.is_symlink() or ref.exists()):
        return None
    target = _resolved(ref, f"the ref of revision={revision!r}", root)
    if not target.is_file():  # a folder, a device, a FIFO
        raise CheckpointError(
            f"load: revision={revision!r}: {str(ref)!r} is not a file (a ref holds a commit)"
        )
    try:
        with target.open("rb") as f:
            data = f.read(MAX_REF_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(
            f"load: revision={revision!r}: cannot read {str(ref)!r}: {exc}"
        ) from None
    commit = data.decode("ascii", errors="replace").strip()
    if len(data) > MAX_REF_BYTES or not _COMMIT.fullmatch(commit):
        raise CheckpointError(
            f"load: revision={revision!r}: {str(ref)!r} holds {brief(data[:60])}, not a 40-hex "
            "commit"
        )
    return commit


def _resolved(path: Path, what: str, root: Path | None) -> Path:
    """``path`` with its symlinks resolved, refused unless it lies inside ``root`` (the
    resolved cache folder; ``None``: anywhere)."""
    try:
        target = path.resolve(strict=False)
    except (OSError, RuntimeError) as exc:  # a symlink loop (RuntimeError before Python 3.13)
        raise CheckpointError(f"load: {what} {str(path)!r} cannot be resolved: {exc}") from None
    if root is not None and not target.is_relative_to(root):
        raise CheckpointError(
            f"load: {what} {str(path)!r} leads out of the Hub cache {str(root)!r} (to "
            f"{str(target)!r}); refused"
        )
    return target
