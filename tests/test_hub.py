"""Hub names: ``pl.load("org/name")`` resolves in a local Hugging Face cache laid out as
huggingface_hub lays it out (``models--org--name/snapshots/<commit>``, ``refs/<branch>``,
files symlinked into ``blobs/``), built by the test; ``revision=``, ``gguf_file=``; nothing is
downloaded; a name not in the cache is one clear error; the containment rule holds there."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.models import CheckpointError
from portable_llm.testing.checkpoints import tiny_config, write_checkpoint, write_tokenizer

pytest.importorskip("huggingface_hub", reason="Hub names need huggingface_hub (extra: hub)")

MAIN = "a" * 40
OLD = "b" * 40
IDS = [[5, 9, 200, 17]]


def _cache_repo(cache: Path, repo_id: str, commit: str, files: dict[str, bytes]) -> Path:
    """``files`` stored as huggingface_hub stores them: content-addressed blobs, the snapshot
    of ``commit`` made of relative symlinks into ``blobs/``. Returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = repo / "snapshots" / commit
    (repo / "blobs").mkdir(parents=True, exist_ok=True)
    snapshot.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        link = snapshot / name
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(os.path.relpath(blob, link.parent))
    return snapshot


def _set_ref(cache: Path, repo_id: str, ref: str, commit: str) -> None:
    file = cache / ("models--" + repo_id.replace("/", "--")) / "refs" / ref
    file.parent.mkdir(parents=True, exist_ok=True)
    file.write_text(commit)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    hub = tmp_path / "hf" / "hub"
    hub.mkdir(parents=True)
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hub


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Two tiny checkpoints with different weights (two revisions of one repository)."""
    base = tmp_path_factory.mktemp("hub_src")
    cfg = tiny_config("qwen2")
    for rev, seed in (("main", 0), ("old", 1)):
        write_checkpoint(base / rev, cfg, seed=seed)
        write_tokenizer(base / rev, vocab_size=cfg["vocab_size"])
    return {rev: base / rev for rev in ("main", "old")}


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}


def _logits(model: pl.Model) -> np.ndarray:
    return pl.to_numpy(model(IDS))


def test_repo_id_loads_from_the_cache(cache: Path, folders: dict[str, Path]) -> None:
    _cache_repo(cache, "org/tiny", MAIN, _files(folders["main"]))
    _set_ref(cache, "org/tiny", "main", MAIN)
    np.testing.assert_array_equal(_logits(pl.load("org/tiny")), _logits(pl.load(folders["main"])))


def test_revision_picks_a_branch_or_a_commit(cache: Path, folders: dict[str, Path]) -> None:
    _cache_repo(cache, "org/tiny", MAIN, _files(folders["main"]))
    _cache_repo(cache, "org/tiny", OLD, _files(folders["old"]))
    _set_ref(cache, "org/tiny", "main", MAIN)
    _set_ref(cache, "org/tiny", "v1", OLD)
    old = _logits(pl.load(folders["old"]))
    np.testing.assert_array_equal(_logits(pl.load("org/tiny", revision="v1")), old)
    np.testing.assert_array_equal(_logits(pl.load("org/tiny", revision=OLD)), old)
    assert not np.array_equal(_logits(pl.load("org/tiny")), old)
    with pytest.raises(FileNotFoundError, match="at revision 'v2'"):
        pl.load("org/tiny", revision="v2")


def test_gguf_repository_with_gguf_file(cache: Path, tmp_path: Path) -> None:
    from test_gguf import family_config, random_weights, write_gguf

    cfg = family_config("qwen2", num_hidden_layers=1)
    file = tmp_path / "m.Q8_0.gguf"
    write_gguf(file, "qwen2", cfg, random_weights(cfg))
    _cache_repo(cache, "org/tiny-GGUF", MAIN, {"m.Q8_0.gguf": file.read_bytes(), "README.md": b""})
    _set_ref(cache, "org/tiny-GGUF", "main", MAIN)
    got = _logits(pl.load("org/tiny-GGUF", gguf_file="m.Q8_0.gguf"))
    np.testing.assert_array_equal(got, _logits(pl.load(file)))
    with pytest.raises(FileNotFoundError, match=r"pass gguf_file= one of m\.Q8_0\.gguf"):
        pl.load("org/tiny-GGUF")
    with pytest.raises(FileNotFoundError, match=r"no 'other\.gguf'.*its GGUF files: m\.Q8_0"):
        pl.load("org/tiny-GGUF", gguf_file="other.gguf")
    with pytest.raises(CheckpointError, match="not a file name inside"):
        pl.load("org/tiny-GGUF", gguf_file="../../../m.gguf")


def test_name_not_in_the_cache_is_one_clear_error(cache: Path) -> None:
    with pytest.raises(FileNotFoundError) as info:
        pl.load("org/absent")
    message = str(info.value)
    assert "'org/absent' is neither a local path nor a Hub repository in the cache" in message
    assert "HF_HUB_OFFLINE is set, and pl.load never downloads" in message
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_online_never_downloads(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without HF_HUB_OFFLINE nothing is fetched either: the error says how to fetch."""
    monkeypatch.delenv("HF_HUB_OFFLINE")

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError("pl.load opened a connection")

    import socket

    monkeypatch.setattr(socket, "create_connection", no_network)
    with pytest.raises(FileNotFoundError, match=r"fetch it first \(hf download org/absent\)"):
        pl.load("org/absent")


def test_local_paths_win_and_revision_is_for_hub_ids(
    cache: Path, folders: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An existing folder named like a repository id is the folder, not the cache's."""
    monkeypatch.chdir(folders["main"].parent)
    _cache_repo(cache, "x/y", MAIN, _files(folders["old"]))
    _set_ref(cache, "x/y", "main", MAIN)
    local = folders["main"].parent / "x" / "y"
    local.parent.mkdir(exist_ok=True)
    if not local.exists():
        local.symlink_to(folders["main"])
    np.testing.assert_array_equal(_logits(pl.load("x/y")), _logits(pl.load(folders["main"])))
    with pytest.raises(ValueError, match="revision='v1' applies to Hub repository ids"):
        pl.load(folders["main"], revision="v1")


def test_hostile_cache_layouts_are_contained(cache: Path, folders: dict[str, Path]) -> None:
    """A ``blobs`` that is a symlink to ``/`` lets nothing out (issue 22: a template linked
    through it to any file was rendered); nor does a snapshot file linked out of ``blobs/``,
    nor a ref naming a folder outside ``snapshots/``."""
    files = _files(folders["main"])
    snapshot = _cache_repo(cache, "org/evil", MAIN, files)
    _set_ref(cache, "org/evil", "main", MAIN)
    pl.load("org/evil")  # the layout itself is fine
    repo = snapshot.parent.parent
    secret = cache.parent / "secret.jinja"
    secret.write_text("{{ 'SECRET' }}")
    # a snapshot file linked straight out of blobs/
    (snapshot / "chat_template.jinja").symlink_to(os.path.relpath(secret, snapshot))
    with pytest.raises(CheckpointError, match=r"chat_template\.jinja' leads out of the checkpoint"):
        pl.load("org/evil")
    # blobs -> "/", every file linked through it
    store = repo / "store"
    (repo / "blobs").rename(store)
    (repo / "blobs").symlink_to("/")
    for name in [*files, "chat_template.jinja"]:
        (snapshot / name).unlink()
        target = secret if name == "chat_template.jinja" else store / _blob(files[name])
        (snapshot / name).symlink_to("../../blobs" + str(target))
    assert (snapshot / "chat_template.jinja").read_text() == "{{ 'SECRET' }}"  # it does lead out
    with pytest.raises(CheckpointError, match="leads out of the checkpoint folder"):
        pl.load("org/evil")
    # a ref naming a folder outside snapshots/
    _set_ref(cache, "org/evil", "main", "../../../../hf")
    with pytest.raises((CheckpointError, FileNotFoundError, ValueError)):
        pl.load("org/evil")


@pytest.mark.parametrize(
    ("revision", "why"),
    [
        ("/dev/zero", "an absolute path"),  # was read until memory ran out
        ("..", "holds '..'"),  # was opened as refs/.. (the repository folder): a raw error
        ("v1/../../main", "holds '..'"),
        ("a\\b", "holds '\\\\'"),
        ("", "it is empty"),
        ("x" * 300, "300 characters"),
        ("main.lock", "ends with '.lock'"),
        ("x\ud800", "not printable"),
    ],
)
def test_revision_is_a_ref_name_or_a_commit(
    cache: Path, folders: dict[str, Path], revision: str, why: str
) -> None:
    """Issue 33: a revision is a branch or tag name (git's ref-name rules) or a 40-hex commit;
    anything else is a ValueError naming ``revision``, before the cache is read."""
    _cache_repo(cache, "org/tiny", MAIN, _files(folders["main"]))
    _set_ref(cache, "org/tiny", "main", MAIN)
    with pytest.raises(
        ValueError, match=r"revision=.* is not a branch or tag name \(.*" + re.escape(why)
    ):
        pl.load("org/tiny", revision=revision)


def test_a_huge_revision_is_a_short_message(cache: Path, folders: dict[str, Path]) -> None:
    for path in ("org/tiny", folders["main"]):  # a Hub id, and a local path (no revision there)
        with pytest.raises(ValueError, match="revision='vvv") as info:
            pl.load(path, revision="v" * 1_000_000)
        assert len(str(info.value)) < 400


def test_revision_as_an_absolute_path_reads_nothing_outside(
    cache: Path, folders: dict[str, Path]
) -> None:
    """A revision naming a file outside the cache that holds a commit was read as the ref (and
    the snapshot it named loaded)."""
    _cache_repo(cache, "org/tiny", MAIN, _files(folders["main"]))
    outside = cache.parent.parent / "ref"
    outside.write_text(MAIN)
    with pytest.raises(ValueError, match="an absolute path"):
        pl.load("org/tiny", revision=str(outside))


def test_branch_names_with_slashes_resolve(cache: Path, folders: dict[str, Path]) -> None:
    _cache_repo(cache, "org/tiny", OLD, _files(folders["old"]))
    want = _logits(pl.load(folders["old"]))
    for ref in ("feature/x", "refs/pr/1"):
        _set_ref(cache, "org/tiny", ref, OLD)
        np.testing.assert_array_equal(_logits(pl.load("org/tiny", revision=ref)), want)


def test_refs_are_bounded_files_of_the_cache(cache: Path, folders: dict[str, Path]) -> None:
    """A ref that is a folder, a ref too long or not a commit, a ref linked out of the cache:
    each a CheckpointError naming the revision (a folder was a raw IsADirectoryError)."""
    _cache_repo(cache, "org/tiny", MAIN, _files(folders["main"]))
    refs = cache / "models--org--tiny" / "refs"
    (refs / "main").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"revision='main': .*refs/main' is not a file"):
        pl.load("org/tiny")
    (refs / "main").rmdir()
    _set_ref(cache, "org/tiny", "main", MAIN + " " * 200)
    with pytest.raises(CheckpointError, match=r"revision='main': .* not a 40-hex commit"):
        pl.load("org/tiny")
    _set_ref(cache, "org/tiny", "main", MAIN[:-1] + "g")
    with pytest.raises(CheckpointError, match="not a 40-hex commit"):
        pl.load("org/tiny")
    outside = cache.parent.parent / "ref"
    outside.write_text(MAIN)
    (refs / "main").unlink()
    (refs / "main").symlink_to(outside)
    with pytest.raises(
        CheckpointError, match=r"ref of revision='main' .* leads out of the Hub cache"
    ):
        pl.load("org/tiny")
    (refs / "main").unlink()
    _set_ref(cache, "org/tiny", "main", MAIN + "\n")  # a trailing newline is fine
    pl.load("org/tiny")


@pytest.mark.parametrize("link", ["snapshots", "repository"])
def test_snapshots_linked_out_of_the_cache_are_refused(
    cache: Path, folders: dict[str, Path], tmp_path: Path, link: str
) -> None:
    """Issue 33: a repository whose ``snapshots/`` (or the repository folder itself) is a
    symlink out of the cache loaded from there; every resolved path now stays in the cache
    (the sibling of the ``blobs/`` case of issue 22)."""
    outside = tmp_path / "elsewhere"
    snapshot = _cache_repo(outside, "org/tiny", MAIN, _files(folders["main"]))
    repo = cache / "models--org--tiny"
    if link == "snapshots":
        repo.mkdir()
        (repo / "blobs").mkdir()
        (repo / "snapshots").symlink_to(snapshot.parent)
    else:
        repo.symlink_to(snapshot.parent.parent)
    _set_ref(outside if link == "repository" else cache, "org/tiny", "main", MAIN)
    assert (repo / "snapshots" / MAIN / "config.json").is_file()  # it does lead out
    with pytest.raises(CheckpointError, match="leads out of the Hub cache"):
        pl.load("org/tiny")


def test_nothing_outside_the_cache_is_read(cache: Path, folders: dict[str, Path]) -> None:
    """huggingface_hub's offline lookup also reads ``trees/<commit>.json`` wherever its
    symlink leads (to its end: ``/dev/zero`` ran out of memory there too); the lookup is ours,
    and reads only the ref. Here the file outside lists a file the snapshot lacks, which
    huggingface_hub refuses as an incomplete snapshot."""
    _cache_repo(cache, "org/tiny", MAIN, _files(folders["main"]))
    _set_ref(cache, "org/tiny", "main", MAIN)
    outside = cache.parent.parent / "tree.json"
    files = {"absent.bin": {"size": 1, "blob_id": "0" * 40}}
    outside.write_text(json.dumps({"format_version": 1, "files": files}))
    trees = cache / "models--org--tiny" / "trees"
    trees.mkdir()
    (trees / f"{MAIN}.json").symlink_to(outside)
    np.testing.assert_array_equal(_logits(pl.load("org/tiny")), _logits(pl.load(folders["main"])))


def test_an_id_with_the_cache_separator_is_refused(cache: Path) -> None:
    with pytest.raises(ValueError, match="'a--b/c' is not a Hub repository id: it holds '--'"):
        pl.load("a--b/c")


def _blob(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_cli_generate_takes_a_repo_id(
    cache: Path, folders: dict[str, Path], capsys: pytest.CaptureFixture[str]
) -> None:
    """``portable-llm generate org/name``: the id reaches ``pl.load`` (not refused as a missing
    path) and prints what the folder prints; an id not in the cache is one error, exit 1."""
    from portable_llm.cli.cli import main

    _cache_repo(cache, "org/tiny", MAIN, _files(folders["main"]))
    _set_ref(cache, "org/tiny", "main", MAIN)
    args = ["--ids", "5,9,200", "--max-new-tokens", "3", "--backend", "numpy"]
    assert main(["generate", str(folders["main"]), *args]) == 0
    want = capsys.readouterr().out.splitlines()[0]
    assert main(["generate", "org/tiny", *args]) == 0
    assert capsys.readouterr().out.splitlines()[0] == want
    assert main(["generate", "org/absent", *args]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    one_line = " ".join(err.split())  # the CLI wraps its message at 100 columns
    assert "'org/absent' is neither a local path nor a Hub repository in the cache" in one_line
