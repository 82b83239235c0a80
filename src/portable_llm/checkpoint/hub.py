"""Hub repository ids (``"org/name"``) resolved to a checkpoint in the local Hugging Face cache.

:func:`resolve_checkpoint` turns what :func:`portable_llm.load` was given into a local path: an
existing path stays as it is; a name shaped like a Hub repository id is looked up in the cache
that ``huggingface_hub`` keeps (``$HF_HUB_CACHE``, else ``$HF_HOME/hub``, else
``~/.cache/huggingface/hub``), laid out as ``models--org--name/snapshots/<commit>/...`` with
``refs/<branch>`` naming the commit and the files symlinked into ``blobs/``. ``revision`` picks
a branch, tag or commit (default ``main``); ``gguf_file`` picks the ``.gguf`` file of a GGUF
repository. Nothing is ever downloaded, whether or not ``HF_HUB_OFFLINE`` is set: a name that
is not in the cache is one ``FileNotFoundError`` that says how to fetch it. The snapshot must
lie inside its repository's ``snapshots/`` folder (a ``refs/main`` naming ``../..`` is
refused), and every file of it passes the containment rule of
:func:`~portable_llm.checkpoint.files.checkpoint_file`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from portable_llm.checkpoint.files import CheckpointError, brief, checkpoint_file
from portable_llm.extras import install_hint

__all__ = ["hub_cache", "is_repo_id", "resolve_checkpoint"]

_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,95}/[A-Za-z0-9][A-Za-z0-9._-]{0,95}$")


def is_repo_id(name: str, /) -> bool:
    """Whether ``name`` is shaped like a Hub repository id (``org/name``, one slash)."""
    return bool(_REPO_ID.match(name)) and ".." not in name


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
                f"load: revision={revision!r} applies to Hub repository ids ('org/name'), but "
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
    """The cached snapshot folder of ``repo_id`` at ``revision`` (never downloaded)."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError as exc:
        raise ValueError(
            f"load: {repo_id!r} is not a local path; Hub names need huggingface_hub: "
            f"{install_hint('hub')}"
        ) from exc
    cache = hub_cache()
    at = f" at revision {revision!r}" if revision else ""
    try:
        found = Path(
            snapshot_download(repo_id, revision=revision, cache_dir=cache, local_files_only=True)
        )
    except FileNotFoundError:  # huggingface_hub's LocalEntryNotFoundError
        how = (
            "HF_HUB_OFFLINE is set, and pl.load never downloads"
            if _offline()
            else f"pl.load never downloads: fetch it first (hf download {repo_id})"
        )
        raise FileNotFoundError(
            f"load: {repo_id!r} is neither a local path nor a Hub repository in the cache "
            f"{str(cache)!r}{at} ({how})"
        ) from None
    except ValueError as exc:  # HFValidationError: a malformed id or revision
        raise ValueError(f"load: {repo_id!r}{at}: {exc}") from None
    snapshots = cache / ("models--" + repo_id.replace("/", "--")) / "snapshots"
    try:
        inside = found.resolve().parent == snapshots.resolve()
    except (OSError, RuntimeError):
        inside = False
    if not inside:
        raise CheckpointError(
            f"load: the cache names {str(found)!r} for {repo_id!r}{at}, which is not a snapshot "
            f"of the repository (in {str(snapshots)!r}); refused"
        )
    return found
