"""Chat templates: rendered in a sandbox (no code runs, work is bounded, errors name the file),
read from where transformers 5 saves them, and equal to transformers' own rendering."""

from __future__ import annotations

import functools
import json
import re
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

import portable_llm as pl
from portable_llm.checkpoint.tokenizer import read_tokenizer
from portable_llm.cli.cli import main
from portable_llm.models import Tokenizer, load
from portable_llm.testing.checkpoints import (
    CHAT_TEMPLATES,
    save_hf_tokenizer,
    tiny_config,
    write_checkpoint,
    write_tokenizer,
)
from portable_llm.text.chat_template import MAX_LOOP_STEPS

pytest.importorskip("jinja2")

HI = [{"role": "user", "content": "hi"}]


def _with_template(folder: Path, template: object) -> Path:
    """``folder``'s tokenizer_config.json with ``chat_template`` set to ``template``."""
    file = folder / "tokenizer_config.json"
    config = json.loads(file.read_text())
    config["chat_template"] = template
    file.write_text(json.dumps(config))
    return file


@pytest.fixture
def model_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "ckpt"
    cfg = tiny_config("qwen2")
    write_checkpoint(folder, cfg)
    write_tokenizer(folder, vocab_size=cfg["vocab_size"])
    return folder


@functools.cache
def _tokenizer_json() -> str:
    with tempfile.TemporaryDirectory() as folder:
        write_tokenizer(folder, vocab_size=300)
        return (Path(folder) / "tokenizer.json").read_text()


def _tokenizer(template: str, origin: str = "tokenizer_config.json") -> Tokenizer:
    from tokenizers import Tokenizer as HFTokenizer

    tok = HFTokenizer.from_str(_tokenizer_json())
    return Tokenizer(tok, {"eos_token": "<|endoftext|>"}, chat_template=template, origin=origin)


# -- security: no code runs ----------------------------------------------------------------------

ESCAPES = [
    "{{ cycler.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ joiner.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ namespace.__init__.__globals__.os.system('touch MARKER') }}",
    "{{ lipsum.__globals__['os'].system('touch MARKER') }}",
    "{{ raise_exception.__globals__['os'].system('touch MARKER') }}",
    "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "{{ messages.__class__.__base__.__subclasses__() }}",
    "{{ dict.__call__.__globals__ }}",
    "{% set ns = namespace() %}{% set ns.__class__ = 1 %}",
    "{{ messages.append({'role': 'x'}) }}{{ messages.clear() }}",
    "{{ (messages|first).update({'content': 'changed'}) }}",
]


@pytest.mark.parametrize("template", ESCAPES)
def test_template_cannot_run_code_or_change_its_inputs(template: str, tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    tok = _tokenizer(template.replace("MARKER", str(marker)), origin="ckpt/chat_template.jinja")
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match=r"^chat template in ckpt/chat_template\.jinja: ") as info:
        tok.apply_chat_template(messages)
    assert "sandbox" in str(info.value) or "undefined" in str(info.value)
    assert not marker.exists()
    assert messages == [{"role": "user", "content": "hi"}]


def test_exploit_in_a_checkpoint_runs_nothing_through_the_api(model_folder: Path) -> None:
    marker = model_folder.parent / "marker"
    file = _with_template(model_folder, ESCAPES[0].replace("MARKER", str(marker)))
    model = load(model_folder)
    with pytest.raises(ValueError, match=f"chat template in {file}: refused by the sandbox"):
        model.tokenizer.apply_chat_template(HI)
    assert not marker.exists()


def test_exploit_in_a_checkpoint_runs_nothing_through_the_cli(
    model_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    marker = model_folder.parent / "marker"
    file = _with_template(model_folder, ESCAPES[0].replace("MARKER", str(marker)))
    code = main(["generate", str(model_folder), "--prompt", "hi", "--chat"])
    captured = capsys.readouterr()
    assert code == 1
    assert not marker.exists()
    err = re.sub(r"\n {4}", " ", captured.err).splitlines()  # wrapped at 100 columns
    assert len(err) == 1, captured.err  # one message, no traceback
    assert err[0].startswith(f"portable-llm generate: error: chat template in {file}: refused")
    assert captured.out == ""


# -- bounded work --------------------------------------------------------------------------------

BOMBS = [
    ("{% for i in range(10**9) %}x{% endfor %}", "Range too big"),
    ("{{ range(10**12)|list|length }}", "Range too big"),
    (
        "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}",
        f"more than {MAX_LOOP_STEPS} loop iterations",
    ),
    (
        "{% set s = 'x' * 100000 %}{% for a in s %}{% for b in s %}{% endfor %}{% endfor %}",
        f"more than {MAX_LOOP_STEPS} loop iterations",
    ),
    ("{{ 'a' * 10**10 }}", "'\\*' would build a sequence longer than"),
    ("{{ [0] * 10**10 }}", "'\\*' would build a sequence longer than"),
    ("{{ 2 ** (10**9) }}", "'\\*\\*' would build an integer of more than"),
    ("{{ 7 ** (10**8) }}", "'\\*\\*' would build an integer of more than"),
]


@pytest.mark.parametrize(("template", "message"), BOMBS)
def test_template_work_is_bounded(template: str, message: str) -> None:
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"chat template in tokenizer_config.json: .*{message}"):
        _tokenizer(template).apply_chat_template(HI)
    assert time.perf_counter() - start < 5.0  # a range(10**9) loop would take minutes


def test_budget_is_per_render_and_fits_real_loops() -> None:
    """Many renders of a template that loops a lot each: the budget never carries over."""
    tok = _tokenizer("{% for i in range(600000) %}{% endfor %}{{ 3 * 4 }}{{ 'ab' * 2 }}")
    with pytest.raises(ValueError, match="Range too big"):  # the sandbox's own range bound
        tok.apply_chat_template(HI)
    tok = _tokenizer("{% for i in range(100000) %}{% endfor %}{{ 3 * 4 }}{{ 'ab' * 2 }}")
    for _ in range(12):  # 12 x 100000 > MAX_LOOP_STEPS: would fail if the budget carried over
        assert tok.apply_chat_template(HI) == "12abab"


def test_variables_reach_the_template_as_plain_data() -> None:
    """NumPy scalars become Python numbers (np.bool_(False) stays falsy); other objects a
    placeholder naming their type, so a template never calls their methods (as transformers)."""
    tok = _tokenizer("{{ n + 1 }} {{ 'yes' if flag else 'no' }} {{ obj }} {{ messages[0].x }}")
    messages = [{"role": "user", "content": "hi", "x": np.float32(0.5)}]
    out = tok.apply_chat_template(messages, n=np.int64(2), flag=np.bool_(False), obj=Path("/"))
    assert out == f"3 no <{type(Path('/')).__name__}> 0.5"


# -- errors name the file ------------------------------------------------------------------------


def test_syntax_error_names_the_file_and_line(model_folder: Path) -> None:
    file = model_folder / "chat_template.jinja"
    file.write_text("{% for m in messages %}\n{{ m.content }\n{% endfor %}")
    tok = read_tokenizer(model_folder)
    assert tok is not None
    with pytest.raises(ValueError, match=f"^chat template in {file}: syntax error on line 2: "):
        tok.apply_chat_template(HI)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ nothing.here }}", "undefined: 'nothing' is undefined"),
        ("{{ raise_exception('roles must alternate') }}", "roles must alternate$"),
        ("{{ 1 / 0 }}", "ZeroDivisionError: division by zero"),
        ("{% for x in 5 %}{% endfor %}", "TypeError: 'int' object is not iterable"),
    ],
)
def test_template_errors_are_value_errors(template: str, message: str) -> None:
    with pytest.raises(ValueError, match=f"^chat template in tokenizer_config.json: {message}"):
        _tokenizer(template).apply_chat_template(HI)


def test_template_that_is_not_a_string(model_folder: Path) -> None:
    file = _with_template(model_folder, 42)
    tok = read_tokenizer(model_folder)
    assert tok is not None
    with pytest.raises(ValueError, match=f"chat template in {file}: expected a string, got int"):
        tok.apply_chat_template(HI)


# -- where the template is read from -------------------------------------------------------------


def test_template_files_in_transformers_order(model_folder: Path) -> None:
    """chat_template.jinja (transformers 5), else tokenizer_config.json, else
    chat_template.json (older processors); none: a clear error."""
    _with_template(model_folder, None)
    tok = read_tokenizer(model_folder)
    assert tok is not None and tok.chat_template is None
    with pytest.raises(ValueError, match=r"has no chat template .*chat_template\.jinja"):
        tok.apply_chat_template(HI)
    (model_folder / "chat_template.json").write_text(json.dumps({"chat_template": "json"}))
    assert read_tokenizer(model_folder).apply_chat_template(HI) == "json"  # type: ignore[union-attr]
    _with_template(model_folder, [{"name": "default", "template": "config"}])
    assert read_tokenizer(model_folder).apply_chat_template(HI) == "config"  # type: ignore[union-attr]
    (model_folder / "chat_template.jinja").write_text("jinja {{ eos_token }}")
    assert read_tokenizer(model_folder).apply_chat_template(HI) == "jinja <|endoftext|>"  # type: ignore[union-attr]


def test_chat_command_with_the_template_in_chat_template_jinja(
    model_folder: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The layout transformers 5 writes (no chat_template in tokenizer_config.json), through
    the command line: the continuation of the rendered prompt."""
    template = json.loads((model_folder / "tokenizer_config.json").read_text())["chat_template"]
    _with_template(model_folder, None)
    (model_folder / "chat_template.jinja").write_text(template)
    code = main(["generate", str(model_folder), "--prompt", "The keys", "--chat",
                 "--max-new-tokens", "4"])  # fmt: skip
    out = capsys.readouterr().out
    model = load(model_folder)
    prompt = "<s>user: The keys\n<s>assistant:"
    assert model.tokenizer.apply_chat_template([{"role": "user", "content": "The keys"}]) == prompt
    want = "".join(pl.generate(model, prompt, max_new_tokens=4))
    assert code == 0
    assert out.startswith(want + "\n")
    n = len(model.tokenizer.encode(prompt))
    assert f"prefill: {n} tokens in " in out


# -- oracle: transformers' own apply_chat_template and save_pretrained ---------------------------


@pytest.mark.oracle
@pytest.mark.parametrize("name", sorted(CHAT_TEMPLATES))
@pytest.mark.parametrize("with_tools", [False, True])
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_templates_render_as_transformers(
    name: str, with_tools: bool, add_generation_prompt: bool, tmp_path: Path
) -> None:
    pytest.importorskip("transformers")
    hf = save_hf_tokenizer(tmp_path, vocab_size=300, chat_template=CHAT_TEMPLATES[name])
    tok = read_tokenizer(tmp_path)
    assert tok is not None and tok.chat_template == CHAT_TEMPLATES[name]
    messages = [
        {"role": "system", "content": "  Be brief.  "},
        {"role": "user", "content": "Ünïcödé 注意力 ✓", "name": None},
        {"role": "assistant", "content": " RMSNorm. "},
        {"role": "user", "content": "And RoPE?"},
    ]
    extra = {}
    if with_tools:
        extra["tools"] = [
            {"type": "function", "function": {"name": "rope", "parameters": {"theta": 1e6}}}
        ]
    want = hf.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )
    got = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
    assert got == want
    assert tok.encode(got) == hf(want)["input_ids"]


@pytest.mark.oracle
def test_template_errors_as_transformers(tmp_path: Path) -> None:
    """Where transformers' template raises (raise_exception, a sandbox refusal), so does ours."""
    jinja2 = pytest.importorskip("jinja2")
    pytest.importorskip("transformers")
    hf = save_hf_tokenizer(tmp_path, vocab_size=300, chat_template=CHAT_TEMPLATES["llama3"])
    tok = read_tokenizer(tmp_path)
    assert tok is not None
    bad = [{"role": "assistant", "content": "first"}]
    with pytest.raises(jinja2.TemplateError, match="roles must alternate"):
        hf.apply_chat_template(bad, tokenize=False)
    with pytest.raises(ValueError, match="roles must alternate"):
        tok.apply_chat_template(bad)
    with pytest.raises(jinja2.exceptions.SecurityError):
        hf.apply_chat_template(HI, tokenize=False, chat_template=ESCAPES[0])
    with pytest.raises(ValueError, match="refused by the sandbox"):
        _tokenizer(ESCAPES[0]).apply_chat_template(HI)


@pytest.mark.oracle
def test_chat_command_on_a_tokenizer_saved_by_transformers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """issue 13: --chat on a folder whose tokenizer transformers' save_pretrained wrote."""
    pytest.importorskip("transformers")
    cfg = tiny_config("qwen2")
    write_checkpoint(tmp_path, cfg)
    hf = save_hf_tokenizer(tmp_path, vocab_size=cfg["vocab_size"])
    assert (tmp_path / "chat_template.jinja").is_file()
    assert "chat_template" not in json.loads((tmp_path / "tokenizer_config.json").read_text())
    code = main(["generate", str(tmp_path), "--prompt", "The keys", "--chat",
                 "--max-new-tokens", "4"])  # fmt: skip
    out = capsys.readouterr().out
    assert code == 0, out
    chat = [{"role": "user", "content": "The keys"}]
    prompt = hf.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
    ids = hf.apply_chat_template(chat, add_generation_prompt=True)["input_ids"]
    want = "".join(pl.generate(load(tmp_path), prompt, max_new_tokens=4))
    assert out.startswith(want + "\n")
    assert f"prefill: {len(ids)} tokens in " in out
