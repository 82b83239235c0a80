"""Every ```python block of README.md and docs/**/*.md runs as written.

The blocks of one page run in order, in one namespace, in a temporary directory, with
``HF_HUB_OFFLINE=1``. A block that defines ``test_*`` functions has them called too. An HTML
comment right before a block (invisible on the rendered page) says what the block needs:

``<!-- docs-test: needs torch -->``
    runs where every named backend is selected (``PORTABLE_LLM_BACKENDS``) and installed; other
    names (``transformers``, ``mlx_lm``) are modules that must be importable. ``strict`` means
    ``array_api_strict``. Blocks that need two libraries besides NumPy, or the oracle extra,
    carry the ``multi_backend`` mark and run in the oracle env, where everything is installed.
``<!-- docs-test: raises TypeError -->``
    the block must raise that built-in exception (combine with ``needs``: one comment each).
``<!-- docs-test: skip <reason> -->``
    not run (a signature, a sketch that needs a real checkpoint); the reason is reported.
``<!-- docs-test: vary BACKEND numpy torch -->``
    the whole page runs once per value: the block's line ``BACKEND = "numpy"`` becomes
    ``BACKEND = "torch"`` in the second run, whose blocks all need torch.

A block without a ``needs`` comment is NumPy-only and runs where ``numpy`` is selected. A block
that imports a backend library (or names one with ``backend=``) that its comment does not list
fails here, so no block is skipped silently.
"""

from __future__ import annotations

import builtins
import importlib.util
import re
import textwrap
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from conftest import skip_reason

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
BACKENDS = ("numpy", "torch", "mlx", "jax", "array_api_strict")
ALIASES = {"strict": "array_api_strict", "array-api-strict": "array_api_strict"}

_FENCE = re.compile(r"^(\s*)```(\w*)\s*$")
_MARKER = re.compile(r"^\s*<!--\s*docs-test:\s*(\w+)\s*(.*?)\s*-->\s*$")
_IMPORT = re.compile(r"^\s*(?:import|from)\s+(torch|mlx|jax|array_api_strict)\b", re.M)
_BACKEND_ARG = re.compile(
    r"(?:backend\s*=\s*|get_backend\(\s*)[\"'](torch|mlx|jax|strict|array_api_strict)[\"']"
)


@dataclass
class Block:
    page: str
    index: int
    line: int
    code: str
    needs: list[str] = field(default_factory=list)
    raises: str | None = None
    skip: str | None = None
    vary: tuple[str, list[str]] | None = None
    variant: str = ""
    errors: list[str] = field(default_factory=list)

    @property
    def key(self) -> str:
        return f"{self.page}[{self.variant}]" if self.variant else self.page


def _name(n: str) -> str:
    return ALIASES.get(n, n)


def parse(path: Path) -> list[Block]:
    """The ```python blocks of a markdown page with their ``docs-test`` markers."""
    lines = path.read_text(encoding="utf-8").splitlines()
    page = str(path.relative_to(ROOT))
    blocks: list[Block] = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        end = i + 1
        while end < len(lines) and lines[end].strip() != "```":
            end += 1
        if lang == "python":
            body = [ln[len(indent) :] if ln.startswith(indent) else ln for ln in lines[i + 1 : end]]
            block = Block(page, len(blocks), i + 1, textwrap.dedent("\n".join(body)) + "\n")
            j = i - 1
            while j >= 0 and not lines[j].strip():
                j -= 1
            while j >= 0 and (mm := _MARKER.match(lines[j])):
                kind, arg = mm.group(1), mm.group(2)
                if kind == "needs":
                    block.needs += [_name(n) for n in re.split(r"[,\s]+", arg) if n]
                elif kind == "raises" and arg:
                    block.raises = arg
                elif kind == "skip" and arg:
                    block.skip = arg
                elif kind == "vary" and len(arg.split()) >= 2:
                    name, *values = arg.split()
                    block.vary = (name, values)
                else:
                    block.errors.append(f"bad marker {lines[j].strip()!r}")
                j -= 1
            blocks.append(block)
        i = end + 1
    return blocks


def _check_needs(block: Block) -> None:
    used = {_name(n) for n in _IMPORT.findall(block.code) + _BACKEND_ARG.findall(block.code)}
    missing = sorted(used - set(block.needs))
    if missing and block.skip is None:
        block.errors.append(
            f"uses {', '.join(missing)} but has no <!-- docs-test: needs {' '.join(missing)} -->"
        )


def variants(blocks: list[Block]) -> list[Block]:
    """The blocks of a page, repeated for each value of its ``vary`` marker (if any)."""
    vary = [b for b in blocks if b.vary is not None]
    if not vary:
        return blocks
    (name, values), out = vary[0].vary, []
    first = re.compile(rf"^{name} = [\"']{re.escape(values[0])}[\"']", re.M)
    if len(vary) > 1 or not first.search(vary[0].code):
        vary[0].errors.append(f"vary: one block must assign {name} = {values[0]!r}")
        return blocks
    for value in values:
        for b in blocks:
            code = first.sub(f'{name} = "{value}"', b.code) if b is vary[0] else b.code
            needs = [*b.needs, _name(value)] if _name(value) in BACKENDS else list(b.needs)
            out.append(
                Block(
                    b.page,
                    b.index,
                    b.line,
                    code,
                    needs,
                    b.raises,
                    b.skip,
                    b.vary,
                    value,
                    list(b.errors),
                )
            )
    return out


def _params() -> list[Any]:
    params = []
    for path in PAGES:
        for b in variants(parse(path)):
            _check_needs(b)
            others = [n for n in b.needs if n != "numpy"]
            extras = [n for n in others if n not in BACKENDS]
            multi = len(others) > 1 or bool(extras)
            marks = [pytest.mark.multi_backend] if multi else []
            params.append(pytest.param(b, id=f"{b.key}:{b.line}", marks=marks))
    return params


_NAMESPACES: dict[str, dict[str, Any]] = {}


def _why_not(block: Block) -> str | None:
    if block.skip is not None:
        return f"marked skip: {block.skip}"
    backends = [n for n in block.needs if n in BACKENDS and n != "numpy"] or ["numpy"]
    for n in backends:
        reason = skip_reason(n)
        if reason is not None:
            return f"needs {n}: {reason}"
    for n in block.needs:
        if n not in BACKENDS and importlib.util.find_spec(n) is None:
            return f"needs {n}, which is not installed"
    return None


@pytest.mark.parametrize("block", _params())
def test_doc_block(
    block: Block, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert not block.errors, f"{block.page}:{block.line}: " + "; ".join(block.errors)
    reason = _why_not(block)
    if reason is not None:
        pytest.skip(reason)
    if block.key not in _NAMESPACES:
        workdir = tmp_path_factory.mktemp(Path(block.page).stem)
        _NAMESPACES[block.key] = {"__name__": "__docs__", "__workdir__": workdir}
    ns = _NAMESPACES[block.key]
    monkeypatch.chdir(ns["__workdir__"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    code = compile(block.code, f"{block.page}:{block.line}", "exec")
    before = set(ns)
    if block.raises is not None:
        expected = getattr(builtins, block.raises)
        with pytest.raises(expected):
            exec(code, ns)
        return
    exec(code, ns)
    for name in sorted(set(ns) - before):
        if name.startswith("test_") and callable(ns[name]):
            ns[name]()


def test_markers_parse() -> None:
    """The parser reads fences, indentation and markers (a check of the checker itself)."""
    import tempfile

    text = (
        "Intro\n\n<!-- docs-test: needs torch, strict -->\n<!-- docs-test: raises TypeError -->\n"
        "```python\nimport torch\n```\n\n- item\n\n  ```python\n  x = 1\n  ```\n"
        "<!-- docs-test: skip a signature -->\n```python\nf(x, /, *, y)\n```\n"
        "```bash\nls\n```\n<!-- docs-test: nonsense -->\n```python\npass\n```\n"
    )
    with tempfile.TemporaryDirectory(dir=ROOT) as d:
        p = Path(d) / "page.md"
        p.write_text(text, encoding="utf-8")
        blocks = parse(p)
    assert [b.code for b in blocks] == ["import torch\n", "x = 1\n", "f(x, /, *, y)\n", "pass\n"]
    assert blocks[0].needs == ["torch", "array_api_strict"]
    assert blocks[0].raises == "TypeError"
    assert blocks[1].needs == [] and blocks[1].skip is None
    assert blocks[2].skip == "a signature"
    assert blocks[3].errors
    unmarked = Block("p", 0, 1, "import jax\ny = f(x, backend='mlx')\n")
    _check_needs(unmarked)
    assert unmarked.errors == ["uses jax, mlx but has no <!-- docs-test: needs jax mlx -->"]


# -- the docs name only flags and keyword arguments that exist ---------------------------------

_COMMAND = re.compile(r"portable-llm((?:[ \t]+[^\s`|)]+)*)")
_FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _command_lines(text: str) -> list[str]:
    """Each ``portable-llm ...`` command in a page (code blocks, synopses and inline code), its
    backslash-continued lines joined; what follows it up to the end of its code span or line."""
    text = re.sub(r"\\\n\s*", " ", text)
    found = []
    for line in text.splitlines():
        for span in re.findall(r"`([^`]*)`", line) or [line]:
            found += ["portable-llm" + m.group(1) for m in _COMMAND.finditer(span)]
    return found


def _flag_errors(page: str, text: str) -> list[str]:
    from portable_llm.cli.cli import parser

    top = parser()
    errors = []
    for command in _command_lines(text):
        words = command.split()[1:]
        first = words[0].rstrip(":") if words else ""  # "portable-llm generate: error: ..."
        sub = first if first in top.subcommands else "report"
        known = {o for a in top.subcommands[sub]._actions for o in a.option_strings}
        known |= {"--version", "--help"}
        errors += [
            f"{page}: `{command}` names {flag}, which `portable-llm {sub}` does not take"
            for flag in _FLAG.findall(" ".join(words))
            if flag not in known
        ]
    return errors


def _keyword_errors(page: str, block: Block) -> list[str]:
    """``pl.f(..., kw=...)`` calls in a block whose ``f`` takes no such keyword."""
    import ast
    import inspect

    import portable_llm as pl

    try:
        tree = ast.parse(block.code)
    except SyntaxError:  # a signature written with / and *, not a call
        return []
    errors = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
            continue
        chain, f = [], node.func
        while isinstance(f, ast.Attribute):
            chain.insert(0, f.attr)
            f = f.value
        if not (isinstance(f, ast.Name) and f.id == "pl"):
            continue
        obj: Any = pl
        for name in chain:
            obj = getattr(obj, name, None)
        if obj is None:
            errors.append(f"{page}:{block.line}: pl.{'.'.join(chain)} does not exist")
            continue
        try:
            params = inspect.signature(obj).parameters
        except (TypeError, ValueError):
            continue
        if any(p.kind is p.VAR_KEYWORD for p in params.values()):
            continue
        named = {n for n, p in params.items() if p.kind is not p.POSITIONAL_ONLY}
        errors += [
            f"{page}:{block.line}: pl.{'.'.join(chain)}(..., {kw.arg}=...): no such argument"
            for kw in node.keywords
            if kw.arg is not None and kw.arg not in named
        ]
    return errors


@pytest.mark.parametrize("path", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_docs_name_existing_flags_and_arguments(path: Path) -> None:
    page = str(path.relative_to(ROOT))
    errors = _flag_errors(page, path.read_text(encoding="utf-8"))
    for block in parse(path):
        errors += _keyword_errors(page, block)
    assert not errors, "\n".join(errors)


def test_the_docs_checker_finds_a_wrong_flag_and_keyword() -> None:
    text = (
        "Run `portable-llm batch m --max-tokens 4 --nope` or\n```bash\nportable-llm generate m "
        "\\\n  --temperature 0.5 --wrong\nportable-llm --version\n```\n"
    )
    assert [e.split(" names ")[1].split(",")[0] for e in _flag_errors("p", text)] == [
        "--nope",
        "--wrong",
    ]
    block = Block("p", 0, 1, "y = pl.rms_norm(x, w, eps=1e-6, epsilon=2)\npl.nothing_here(1)\n")
    assert _keyword_errors("p", block) == [
        "p:1: pl.rms_norm(..., epsilon=...): no such argument",
        "p:1: pl.nothing_here does not exist",
    ]
