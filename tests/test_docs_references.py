"""Every repository path, module and public name that the docs mention exists.

Docs drift when code moves: a page that names ``models/steps.py`` after the file became
``generation/steps.py`` misleads the reader who opens it. This reads README.md, docs/**/*.md and
benchmarks/README.md and checks, outside fenced code blocks:

- a backticked path with a ``/`` (``decoder/model.py``, ``tests/test_docs.py``): a file or folder
  of the repository, from its root, ``src`` or ``src/portable_llm``;
- a backticked bare file name (``batch.py``): some file of that name in the repository;
- a backticked dotted module or attribute (``portable_llm.decoder.model``,
  ``portable_llm.testing.assert_close``): importable;
- a backticked ``pl.name`` (``pl.KVCache.make_mask``), also at the head of a backticked call
  (``pl.load(folder, backend="mlx")``): an attribute chain of the ``portable_llm`` package;
- a backticked folder (``ops/quant/``): a folder of the repository, from its root, ``src`` or
  ``src/portable_llm``; a bare one (``quant/``): some folder of that name;
- a Markdown link to a local file (``[cli](docs/cli.md#threads)``): that file, from the page;

and inside fenced code blocks:

- ``from portable_llm.x import a, b`` and ``import portable_llm.x`` (in any block, run or
  skipped by ``tests/test_docs.py``): importable, each name imported;
- a repository path in a shell block (``python benchmarks/serve.py``): that file.

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
_PL = re.compile(r"^pl((?:\.[A-Za-z_]\w*)+)$")
_DIR = re.compile(r"^[A-Za-z0-9_\-][A-Za-z0-9_.\-/]*/$")
#: The head of a backticked call or expression: ``pl.load(`` -> ``pl.load``.
_HEAD = re.compile(r"^((?:pl|portable_llm)(?:\.[A-Za-z_]\w*)+)[(\[ ]")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_IMPORT = re.compile(
    r"^\s*(?:from\s+(portable_llm(?:\.\w+)*)\s+import\s+\(?([\w\s,]+?)\)?\s*(?:#.*)?$"
    r"|import\s+(portable_llm(?:\.\w+)+))"
)
_SHELL_PATH = re.compile(r"(?<![\w/.~$-])((?:benchmarks|tests|src|docs|\.ci)/[\w./\-]+\.\w+)")
#: Folders a page names that a fresh clone lacks until a command makes them, and those of the
#: Hugging Face cache.
MADE = {".tox/", ".venv/", "site/", "tiny-qwen2/", "tiny/", "snapshots/", "blobs/"}
#: Names a page writes as a pattern, not as a name: ``pl.models.X``.
PLACEHOLDERS = {"pl.models.X"}


def _prose(page: Path) -> list[tuple[int, str]]:
    """The lines of ``page`` outside fenced code blocks, numbered from 1."""
    return [(n, line) for n, line, lang in _lines(page) if lang is None]


def _lines(page: Path) -> list[tuple[int, str, str | None]]:
    """Each line of ``page`` (numbered from 1) with the language of the fenced block it is in
    (``""`` for a block without one), or ``None`` outside fenced blocks; fences left out."""
    out: list[tuple[int, str, str | None]] = []
    lang: str | None = None
    for n, line in enumerate(page.read_text(encoding="utf-8").splitlines(), 1):
        if _FENCE.match(line):
            lang = line.strip().strip("`").strip() if lang is None else None
        else:
            out.append((n, line, lang))
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
    if _DIR.match(token):
        if token in MADE:
            return False
        return not _exists(token) if "/" in token[:-1] else token[:-1] not in files
    if token in PLACEHOLDERS:
        return False
    m = _PL.match(token)
    return m is not None and not _has_chain(pl, m.group(1))


def _has_chain(obj: object, chain: str) -> bool:
    """Whether ``obj`` has the attribute chain ``.a.b.c``."""
    for name in chain.strip(".").split("."):
        if not hasattr(obj, name):
            return False
        obj = getattr(obj, name)
    return True


def _missing_span(span: str, files: set[str]) -> bool:
    """A backticked span: one token (:func:`_missing`), or the ``pl.``/``portable_llm.`` head
    of a call or expression with spaces or brackets in it."""
    token = span.rstrip(".,:;()")
    if not any(c in span for c in " ([") and _missing(token, files):
        return True
    m = _HEAD.match(span)
    return m is not None and _missing(m.group(1), files)


def _missing_link(page: Path, target: str) -> bool:
    """A Markdown link's target that is a local file of the repository and does not exist."""
    if re.match(r"^[a-z]+:", target) or target.startswith(("#", "/")):
        return False  # a URL, an anchor of the page, a site-absolute path
    path = target.split("#", 1)[0]
    return bool(path) and not (page.parent / path).exists()


_SPAN = re.compile(r"`([^`]+)`")


def _broken(page: Path, files: set[str]) -> list[str]:
    where = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
    bad = []
    for n, line, lang in _lines(page):
        if lang is None:
            bad += [f"{where}:{n}: {t}" for t in _SPAN.findall(line) if _missing_span(t, files)]
            bad += [f"{where}:{n}: link {t}" for t in _LINK.findall(line) if _missing_link(page, t)]
        elif lang in ("python", "py", "pycon"):
            bad += [f"{where}:{n}: {name}" for name in _imported(line) if not _importable(name)]
        elif lang in ("bash", "sh", "console", "shell"):
            bad += [f"{where}:{n}: {p}" for p in _SHELL_PATH.findall(line) if not _exists(p)]
    return bad


def _imported(line: str) -> list[str]:
    """The dotted names a line of Python imports from portable_llm (``from m import a, b``:
    ``m.a`` and ``m.b``; ``import m``: ``m``)."""
    m = _IMPORT.match(line)
    if m is None:
        return []
    if m.group(3):
        return [m.group(3)]
    names = [part.split(" as ")[0].strip() for part in m.group(2).split(",")]
    return [f"{m.group(1)}.{name}" for name in names if name]


_DOTTED = re.compile(r"``(portable_llm(?:\.[A-Za-z_]\w*)+)``")
SCRIPTS = sorted((ROOT / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_every_name_a_benchmark_script_mentions_exists(script: Path) -> None:
    """The benchmark scripts' docstrings and comments name what they measure
    (``portable_llm.ops.quant.KEEP_CODES_FROM``), and they import from portable_llm: those
    names exist."""
    text = script.read_text(encoding="utf-8")
    bad = [name for name in _DOTTED.findall(text) if not _importable(name)]
    # The scripts run by hand, not in the suite: what they import of ours must still be there.
    bad += [name for line in text.splitlines() for name in _imported(line)]
    bad = [name for name in bad if not _importable(name)]
    assert not bad, f"{script.name} names what does not exist: {bad}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_path_and_name_a_page_mentions_exists(page: Path) -> None:
    bad = _broken(page, _files())
    assert not bad, "names that do not exist:\n" + "\n".join(bad)


def test_the_checks_catch_what_moved(tmp_path: Path) -> None:
    """Each kind of reference the page test checks is reported when it names nothing, and only
    then (a page written here: every line below but the first of each pair is broken)."""
    (tmp_path / "other.md").write_text("", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "\n".join(
            [
                "`pl.KVCache.make_mask` and `pl.KVCache.no_such_method`",
                "`pl.load(folder, backend='mlx')` and `pl.no_such_op(x, y)`",
                "`ops/quant/` and `ops/no_such_folder/`, `quant/` and `no_such_folder/`",
                "[fine](other.md#a) and [gone](gone.md) and [web](https://example.org/x.md)",
                "```python",
                "from portable_llm.ops.quant import keeps_codes, fastest_form",
                "from portable_llm.ops.quant import no_such_name",
                "import portable_llm.no_such_module",
                "```",
                "```bash",
                "python benchmarks/quant_rule.py && python benchmarks/no_such_script.py",
                "```",
            ]
        ),
        encoding="utf-8",
    )
    bad = _broken(page, _files())
    assert bad == [
        "page.md:1: pl.KVCache.no_such_method",
        "page.md:2: pl.no_such_op(x, y)",
        "page.md:3: ops/no_such_folder/",
        "page.md:3: no_such_folder/",
        "page.md:4: link gone.md",
        "page.md:7: portable_llm.ops.quant.no_such_name",
        "page.md:8: portable_llm.no_such_module",
        "page.md:11: benchmarks/no_such_script.py",
    ]
