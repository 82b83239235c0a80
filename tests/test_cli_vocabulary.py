"""One flag vocabulary across ``portable-llm``'s subcommands: every flag has help text; one
option has one name, and one name has one meaning and one default, whichever command takes it
(``cli/options.py``: the flags defined once, the old spellings as hidden aliases that say their
new name once, the few flags whose form differs by command in ``FORMS`` with why); ``[all]``
installs what every command needs, and each install hint is a command that works from a clone.
"""

from __future__ import annotations

import argparse
import re
import time
from pathlib import Path

import pytest

from portable_llm.cli import options
from portable_llm.cli.cli import main, parser
from portable_llm.extras import install_hint


def _flags(subs: dict[str, argparse.ArgumentParser]) -> list[tuple[str, argparse.Action]]:
    """(command, action) for every optional flag of every subcommand, ``-h`` aside."""
    return [
        (name, a)
        for name, p in subs.items()
        for a in p._actions
        if a.option_strings and not isinstance(a, argparse._HelpAction)
    ]


def _meaning(a: argparse.Action) -> tuple[object, ...]:
    """What a flag is: where it stores, what its values are."""
    return (a.dest, getattr(a.type, "__name__", a.type), tuple(a.choices or ()))


def _form(a: argparse.Action) -> tuple[object, ...]:
    """A flag's whole definition as a user sees it: its meaning, how many values it takes
    (once, repeatable, optional), its default and help."""
    return (*_meaning(a), type(a).__name__, a.nargs, a.const, repr(a.default), a.help, a.metavar)


def vocabulary_errors(subs: dict[str, argparse.ArgumentParser]) -> list[str]:
    """Every breach of the one-vocabulary rules among the subcommands' parsers ``subs``."""
    errors: list[str] = []
    forms: dict[tuple[str, str], dict[tuple[object, ...], list[str]]] = {}
    meanings: dict[str, dict[tuple[object, ...], list[str]]] = {}
    names: dict[str, set[str]] = {}  # dest -> the visible names that store into it
    for command, a in _flags(subs):
        name = a.option_strings[-1]  # the long form: -v, --verbose is one flag
        where = f"{command} {name}"
        hidden = a.help == argparse.SUPPRESS
        if not a.help:
            errors.append(f"{where} has no help text")
        if isinstance(a, options.DeprecatedAlias):
            new = options.DEPRECATED.get(name)
            visible = {o for b in subs[command]._actions if b.dest == a.dest
                       and b.help != argparse.SUPPRESS for o in b.option_strings}  # fmt: skip
            if new not in visible:
                errors.append(f"{where} is an alias of {new}, which {command} lacks")
            continue
        if hidden:
            errors.append(f"{where} is hidden but not an old spelling of a flag")
        elif name in options.DEPRECATED:
            errors.append(f"{where}: the old spelling of {options.DEPRECATED[name]} is shown")
        meanings.setdefault(name, {}).setdefault(_meaning(a), []).append(command)
        form = (name, options.FORMS.get((command, name), ""))
        forms.setdefault(form, {}).setdefault(_form(a), []).append(command)
        names.setdefault(a.dest, set()).add(name)
        said = re.search(r"\(default (\S+?)\)", a.help or "")
        if said and a.default is not None and said.group(1) != str(a.default):
            errors.append(f"{where}: its help says default {said.group(1)}, not {a.default}")
    for name, by in meanings.items():
        if len(by) > 1:
            errors.append(f"{name} means different things: {sorted(by.values())}")
    for (name, form), by in forms.items():
        if len(by) > 1 and len(meanings[name]) == 1:
            errors.append(f"{name} ({form or 'shared'}) differs between {sorted(by.values())}")
    errors += [f"one option, several names: {sorted(n)}" for n in names.values() if len(n) > 1]
    return errors


def test_every_subcommand_speaks_one_flag_vocabulary():
    subs = parser().subcommands
    assert {"report", "bench", "generate", "batch", "serve"} <= set(subs)
    assert vocabulary_errors(subs) == []


def test_the_model_commands_share_their_flags():
    """The flags of a model and its requests are the same flags in generate, batch and serve."""
    subs = parser().subcommands
    shared = {"--backend", "--dtype", "--device", "--dequantize", "--threads",
              "--max-new-tokens", "--prefill-step-size"}  # fmt: skip
    for name in ("generate", "batch", "serve"):
        flags = {o for a in subs[name]._actions for o in a.option_strings}
        assert shared <= flags, name
    batch = {a.dest: a.default for a in subs["batch"]._actions}
    serve = {a.dest: a.default for a in subs["serve"]._actions}
    assert batch["max_batch"] == serve["max_batch"] == options.MAX_BATCH


def _sub(*flags: tuple[str, dict[str, object]]) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    for name, kwargs in flags:
        p.add_argument(name, **kwargs)  # type: ignore[arg-type]
    return p


def test_the_vocabulary_check_finds_each_kind_of_breach():
    """The check itself, on parsers that make the mistakes the old CLI made."""
    old = {
        # the same thing under two names and two defaults (2048 against 512)
        "generate": _sub(("--prefill-step-size", {"type": int, "default": 2048, "help": "x"}),
                         ("--max-tokens", {"dest": "max_new_tokens", "help": argparse.SUPPRESS})),
        "batch": _sub(("--prefill-chunk", {"type": int, "default": 512, "help": "y"})),
        # one name, two meanings; a flag without help; a help that misstates its default
        "serve": _sub(("--max-tokens", {"type": int, "default": 512, "help": "z (default 5)"}),
                      ("--log-level", {"default": "info"})),
    }  # fmt: skip
    errors = "\n".join(vocabulary_errors(old))
    assert "generate --max-tokens is hidden but not an old spelling" in errors
    assert "serve --log-level has no help text" in errors
    assert "serve --max-tokens: its help says default 5, not 512" in errors
    assert "batch --prefill-chunk: the old spelling of --prefill-step-size is shown" in errors
    assert "--max-tokens means different things" in errors
    same = {"a": _sub(("--x", {"default": 1, "help": "h"})),
            "b": _sub(("--x", {"default": 2, "help": "h"}))}  # fmt: skip
    assert vocabulary_errors(same) == ["--x (shared) differs between [['a'], ['b']]"]
    two = {"a": _sub(("--x", {"dest": "v", "help": "h"})),
           "b": _sub(("--y", {"dest": "v", "help": "h"}))}  # fmt: skip
    assert vocabulary_errors(two) == ["one option, several names: ['--x', '--y']"]


@pytest.mark.parametrize(
    ("old", "new", "value"),
    [("--max-tokens", "max_new_tokens", 7), ("--prefill-chunk", "prefill_step_size", 9)],
)
def test_an_old_spelling_still_works_and_says_its_new_name_once(old, new, value, capsys):
    options._noted.discard(old)
    p = parser().subcommands["batch"]
    args = p.parse_args(["m", "--ids", "1", old, str(value), old, str(value)])
    assert getattr(args, new) == value
    err = capsys.readouterr().err
    assert err.count(f"note: {old} is now {options.DEPRECATED[old]}") == 1
    p.parse_args(["m", "--ids", "1", old, str(value)])
    assert capsys.readouterr().err == ""  # once per process
    with pytest.raises(SystemExit):  # checked as the new flag is
        p.parse_args(["m", old, "0"])
    assert f"argument {old}: expected an integer >= 1" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("given", "want"), [([], "auto"), (["--dequantize"], True), (["--dequantize", "no"], False)]
)
def test_dequantize_means_what_load_takes(given, want):
    for name in ("generate", "batch", "serve"):
        p = parser().subcommands[name]
        extra = ["--ids", "1"] if name == "generate" else []
        assert p.parse_args(["m", *extra, *given]).dequantize == want, name


def test_dequantize_rejects_other_words(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "m", "--dequantize", "maybe"])
    assert exc.value.code == 2
    assert "--dequantize: expected auto, yes or no, got 'maybe'" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # a bare --dequantize before the path takes the path
        main(["serve", "--dequantize", __file__])
    err = " ".join(capsys.readouterr().err.split())  # unwrapped
    assert "(the checkpoint? put it first, or write --dequantize=yes)" in err


def _extras() -> dict[str, set[str]]:
    """Each extra of ``pyproject.toml`` -> the names of its requirements."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    with (Path(__file__).parents[1] / "pyproject.toml").open("rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    return {k: {re.split(r"[\s<>=!~\[;]", r)[0].lower() for r in v} for k, v in extras.items()}


def test_all_installs_what_every_command_needs():
    extras = _extras()
    assert extras["serve"] and extras["serve"] <= extras["all"]


def test_install_hints_work_from_a_clone():
    assert install_hint("serve") == (
        "pip install -c constraints.txt -e '.[serve]' (in a clone of portable_llm)"
    )
    assert install_hint() == "pip install -c constraints.txt -e . (in a clone of portable_llm)"


def test_no_install_hint_names_a_package_index_install():
    """``pip install 'portable-llm[...]'`` cannot work (the package is not on an index): every
    hint in the package comes from install_hint."""
    src = Path(__file__).parents[1] / "src" / "portable_llm"
    found = [f"{p.relative_to(src)}:{i}" for p in sorted(src.rglob("*.py"))
             for i, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if "portable-llm[" in line]  # fmt: skip
    assert found == []


def test_serve_hands_the_shared_flags_to_load_and_the_app(monkeypatch, capsys):
    """serve's --max-new-tokens, --prefill-step-size, --max-batch and --dequantize reach the
    same places as batch's: the request default, the batch generator, pl.load."""
    uvicorn = pytest.importorskip("uvicorn")
    pytest.importorskip("starlette")
    import portable_llm.checkpoint.loader as loader
    import portable_llm.serve as serve_package
    from portable_llm.cli import output

    seen: dict[str, dict[str, object]] = {}

    class Server:
        started = True

        def __init__(self, config: object) -> None:
            pass

        def run(self, sockets: object) -> None:
            pass

    def load(path: object, **kw: object) -> object:
        time.sleep(0.2)  # a slow load says every HEARTBEAT seconds that it still runs
        seen["load"] = kw
        return object()

    monkeypatch.setattr(output, "HEARTBEAT", 0.05)
    monkeypatch.setattr(loader, "load", load)
    monkeypatch.setattr(serve_package, "create_app", lambda m, **kw: seen.update(app=kw))
    monkeypatch.setattr(uvicorn, "Config", lambda app, **kw: None)
    monkeypatch.setattr(uvicorn, "Server", Server)
    flags = ["--max-new-tokens", "7", "--prefill-step-size", "3", "--max-batch", "2"]
    assert main(["serve", "m", "--host", "127.0.0.1", "--port", "0", *flags,
                 "--dequantize", "no"]) == 0  # fmt: skip
    assert seen["load"]["dequantize"] is False
    assert "portable-llm serve: ... still loading (0 s)" in capsys.readouterr().err
    app = seen["app"]
    assert (app["default_max_tokens"], app["prefill_chunk"], app["max_batch"]) == (7, 3, 2)
    assert main(["serve", "m", "--port", "0"]) == 0  # the shared defaults
    assert seen["load"]["dequantize"] == "auto"
    app = seen["app"]
    want = (options.MAX_NEW_TOKENS, options.PREFILL_STEP_SIZE, options.MAX_BATCH)
    assert (app["default_max_tokens"], app["prefill_chunk"], app["max_batch"]) == want


@pytest.mark.parametrize("command", ["generate", "batch"])
def test_dequantize_reaches_load(command, tmp_path, monkeypatch, capsys):
    import portable_llm.checkpoint.loader as loader

    seen: list[object] = []

    def load(path: object, **kw: object) -> object:
        seen.append(kw["dequantize"])
        raise ValueError("stop here")

    monkeypatch.setattr(loader, "load", load)
    for given, want in ([], "auto"), (["--dequantize"], True), (["--dequantize=no"], False):
        assert main([command, str(tmp_path), "--ids", "1", *given]) == 1
        assert seen[-1] == want
    assert "stop here" in capsys.readouterr().err
