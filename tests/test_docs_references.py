"""Every repository path, module and public name that the docs mention exists.

Docs drift when code moves: a page that names ``models/steps.py`` after the file became
``generation/steps.py`` misleads the reader who opens it. This reads README.md, docs/**/*.md and
benchmarks/README.md and checks, outside fenced code blocks:

- a backticked path with a ``/`` (``decoder/model.py``, ``tests/test_docs.py``): a file or folder
  of the repository, from its root, ``src`` or ``src/portable_llm``;
- a backticked bare file name (``batch.py``): some file of that name in the repository;
- a backticked dotted module or attribute (``portable_llm.decoder.model``,
  ``portable_llm.testing.assert_close``): importable;
- a backticked ``pl.name``: an attribute of the ``portable_llm`` package.

Names a page uses as examples of the reader's own code (``mylib.py``) are listed below.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import portable_llm as pl

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    ROOT / "benchmarks" / "README.md",
    *sorted((ROOT / "docs").rglob("*.md")),
]
#: Files a page asks the reader to write (their own backend, their own script).
EXAMPLES = {"mylib.py", "run.py", "my_model.py", "app.py", "client.py", "train.py"}

_FENCE = re.compile(r"^\s*```")
_TICKED = re.compile(r"`([^`\s]+)`")
# (``.json`` names are a checkpoint's files, ``config.json``, not the repository's.)
_PATH = re.compile(r"^[A-Za-z0-9_.\-/]+\.(?:py|md|toml|ini|txt|yml|yaml|html|sh)$")
_MODULE = re.compile(r"^portable_llm(?:\.[A-Za-z_]\w*)+$")
_PL = re.compile(r"^pl\.([A-Za-z_]\w*)")


def _prose(page: Path) -> list[tuple[int, str]]:
    """The lines of ``page`` outside fenced code blocks, numbered from 1."""
    out, fenced = [], False
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((n, line))
    return out


def _files() -> set[str]:
    skip = {".git", ".tox", ".venv", "site", "__pycache__", ".ci"}
    names = set()
    for p in ROOT.rglob("*"):
        if not any(part in skip for part in p.relative_to(ROOT).parts):
            names.add(p.name)
    return names


def _exists(path: str) -> bool:
    path = path.lstrip("./")
    bases = (ROOT, ROOT / "src", ROOT / "src" / "portable_llm")
    return any((base / path).exists() for base in bases)


def _importable(dotted: str) -> bool:
    """Whether ``dotted`` names a module or an attribute of one. A module that needs an
    optional library this env lacks (the server's starlette) cannot be looked into here: it
    counts as existing, and the env that installs the extra checks it."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError as exc:
            if exc.name is not None and exc.name.split(".")[0] != "portable_llm":
                return True  # a missing optional dependency, not a missing name of ours
            continue
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


def _missing(token: str, files: set[str]) -> bool:
    """Whether a backticked ``token`` names a path, module or ``pl`` name that does not exist
    (a token of none of those kinds is not checked)."""
    if _PATH.match(token):
        name = token.rsplit("/", 1)[-1]
        if name in EXAMPLES:
            return False
        return not _exists(token) if "/" in token else name not in files
    if _MODULE.match(token):
        return not _importable(token)
    m = _PL.match(token)
    return m is not None and not hasattr(pl, m.group(1))


def _broken(page: Path, files: set[str]) -> list[str]:
    return [
        f"{page.relative_to(ROOT)}:{n}: {token}"
        for n, line in _prose(page)
        for token in (t.rstrip(".,:;()") for t in _TICKED.findall(line))
        if _missing(token, files)
    ]


_DOTTED = re.compile(r"``(portable_llm(?:\.[A-Za-z_]\w*)+)``")
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_name_a_benchmark_script_mentions_exists(script: Path) -> None:
    """The benchmark scripts' docstrings and comments name what they measure
    (``portable_llm.ops.quant.KEEP_CODES_FROM``): those names exist."""
    text = script.read_text(encoding="utf-8")
    bad = [name for name in _DOTTED.findall(text) if not _importable(name)]
    assert not bad, f"{script.name} names what does not exist: {bad}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_and_name_a_page_mentions_exists(page: Path) -> None:
    bad = _broken(page, _files())
    assert not bad, "names that do not exist:\n" + "\n".join(bad)
