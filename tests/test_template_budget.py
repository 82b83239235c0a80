"""The chat-template budget: recursion depth, output size, the size of each value built and
total work, at render and at compile time (jinja2 folds constant expressions while compiling).
Each hostile template is refused with a ValueError naming its file, quickly, and without
allocating more than a few megabytes (traced with tracemalloc)."""

from __future__ import annotations

import time
import tracemalloc

import pytest

pytest.importorskip("jinja2", reason="chat templates need jinja2 (extra: chat)")

from portable_llm.text.chat_template import (
    MAX_DEPTH,
    MAX_LOOP_STEPS,
    MAX_SOURCE,
    compile_chat_template,
    render_chat_template,
)

HI = {"messages": [{"role": "user", "content": "hi"}], "add_generation_prompt": True}
BIG = "{% set s = 'x' * 1000000 %}"
BOMBS = {
    "recursive macro, twice per level": (
        "{% macro f(n) %}{% if n > 0 %}{{ f(n-1) }}{{ f(n-1) }}{% endif %}{% endmacro %}"
        "{{ f(40) }}",
        f"more than {MAX_LOOP_STEPS} loop iterations and calls",
    ),
    "unbounded recursion": (
        "{% macro f(n) %}{{ f(n+1) }}{% endmacro %}{{ f(0) }}",
        f"calls nested more than {MAX_DEPTH} deep",
    ),
    "lipsum": ("{{ lipsum(10**6, max=10**6) }}", "lipsum would build"),
    "loop output": (
        BIG + "{% for i in range(1500) %}{{ s }}{% endfor %}",
        "the output would be longer than",
    ),
    "loop output in a macro": (
        "{% macro m() %}" + BIG + "{% for i in range(1500) %}{{ s }}{% endfor %}{% endmacro %}"
        "{{ m() }}",
        "the output would be longer than",
    ),
    "~ doubling": (
        "{% set ns = namespace(s='x') %}{% for i in range(60) %}{% set ns.s = ns.s ~ ns.s %}"
        "{% endfor %}{{ ns.s|length }}",
        "'~' would be longer than",
    ),
    "+ doubling": (
        "{% set ns = namespace(s=['x']) %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
        "{% endfor %}{{ ns.s|length }}",
        "'\\+' would build",
    ),
    "center filter": ("{{ 'a'|center(10**9) }}", "center would build"),
    "center method": ("{{ 'a'.center(10**9) }}", "center would build"),
    "ljust method": ("{{ 'a'.ljust(10**9) }}", "ljust would build"),
    "zfill method": ("{{ 'a'.zfill(10**9) }}", "zfill would build"),
    "% padding": ("{{ '%1000000000s' % 'a' }}", "'%' would pad to 1000000000"),
    "% star width": ("{{ '%*s' % (10**9, 'a') }}", "'\\*'\\) is refused"),
    "format filter padding": ("{{ '%1000000000d'|format(1) }}", "'%' would pad"),
    "str.format padding": ("{{ '{:>1000000000}'.format('a') }}", "format would pad"),
    "batch": ("{{ [1]|batch(10**9, 0)|list|length }}", "batch would build"),
    "slice": ("{{ [1]|slice(10**9)|list|length }}", "slice would build"),
    "indent": ("{{ ('a\n' * 100000)|indent(100000) }}", "indent would build"),
    "replace filter": ("{{ ('a' * 100000)|replace('a', 'b' * 100000) }}", "replace would build"),
    "replace method, empty old": (
        "{{ ('a' * 100000).replace('', 'b' * 10000) }}",
        "replace would build",
    ),
    "join method": ("{{ ('x' * 100000).join(['a'] * 100000) }}", "join would build"),
    "expandtabs": ("{{ ('\t' * 100000).expandtabs(100000) }}", "expandtabs would build"),
    "wordwrap": ("{{ ('a ' * 100000)|wordwrap(1, wrapstring='x' * 100000) }}", "wordwrap"),
    "tojson indent": ("{{ [[[1]]]|tojson(indent=10**8) }}", "tojson: indent"),
    "string of list, repeated": (
        "{% set ns = namespace(s='ab') %}{% for i in range(30) %}"
        "{% set ns.s = ns.s|list|string %}{% endfor %}",
        "filter string built",
    ),
    "* of a sequence": ("{{ 'a' * 10**10 }}", "'\\*' would build a sequence longer than"),
    "** of an integer": ("{{ 2 ** (10**9) }}", "'\\*\\*' would build an integer"),
    "nested parentheses": ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "nested too deeply"),
}
# Constant filters: jinja2 would evaluate these while compiling, before any render.
CONSTANT = {
    "center of a literal": "{{ 'a'|center(1000000000) }}",
    "indent of a literal": "{{ 'a\nb'|indent(1000000000) }}",
    "format of a literal": "{{ '%1000000000s'|format('a') }}",
    "batch of a literal": "{{ [1]|batch(1000000000, 0)|list }}",
    "replace of a literal": "{{ 'aaaa'|replace('a', 'bbbb', 3) * 1 }}",
}


def _render(source: str) -> str:
    return render_chat_template(compile_chat_template(source, "t.jinja"), "t.jinja", HI)


@pytest.mark.parametrize("name", list(BOMBS))
def test_hostile_template_is_refused_quickly_and_small(name: str) -> None:
    source, message = BOMBS[name]
    start = time.perf_counter()
    with pytest.raises(ValueError, match=f"^chat template in t.jinja: .*{message}"):
        _render(source)
    assert time.perf_counter() - start < 10.0  # ~1 s for the slowest (the recursive macro)
    if "recursive" in name:
        return  # a million calls: slow under tracemalloc, and they allocate nothing
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=message):
            _render(source)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 2**20, f"{name}: {peak / 2**20:.0f} MiB traced"


@pytest.mark.parametrize("name", list(CONSTANT))
def test_compile_time_folding_allocates_nothing_large(name: str) -> None:
    """Compiling (where jinja2 folds constant filters) stays small; the render refuses."""
    tracemalloc.start()
    try:
        template = compile_chat_template(CONSTANT[name], f"{name}.jinja")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 16 * 2**20, f"{name}: {peak / 2**20:.0f} MiB traced while compiling"
    if "replace" in name:
        assert render_chat_template(template, "t", HI) == "bbbbbbbbbbbba"
        return
    with pytest.raises(ValueError, match=r"would (build|pad)"):
        render_chat_template(template, "t", HI)


def test_source_size_is_bounded() -> None:
    with pytest.raises(ValueError, match=f"^chat template in t.jinja: .*at most {MAX_SOURCE}"):
        compile_chat_template("x" * (MAX_SOURCE + 1), "t.jinja")


def test_real_template_work_fits() -> None:
    """What real chat templates do stays inside the budget: a long conversation (its size
    widens the limits), macros, padding, tojson with indent, format, joins."""
    source = (
        "{% macro turn(m) %}<|{{ m.role }}|>{{ m.content|trim }}{% endmacro %}"
        "{% for m in messages %}{{ turn(m) }}\n{% endfor %}"
        "{{ tools|tojson(indent=4) }}{{ '%-8s|'|format('ok') }}{{ 'x'.center(9, '-') }}"
        "{{ ', '.join(['a', 'b']) }}{{ '{:>4}'.format(7) }}"
    )
    long = "word " * 400_000  # 2 MB of conversation, more than MAX_SIZE
    variables = {
        "messages": [{"role": "user", "content": long}, {"role": "assistant", "content": "ok"}],
        "tools": [{"name": "f", "parameters": {"type": "object"}}],
    }
    out = render_chat_template(compile_chat_template(source, "t"), "t", variables)
    assert out.startswith("<|user|>word word") and out.endswith("ok      |----x----a, b   7")


def test_error_messages_are_bounded() -> None:
    """A template's own raise_exception of a megabyte string stays a short message."""
    from portable_llm.text.failures import MAX_MESSAGE

    with pytest.raises(ValueError, match=r"^chat template in t\.jinja: xxx.*cut: ") as info:
        _render("{{ raise_exception('x' * 1000000) }}")
    assert len(str(info.value)) <= MAX_MESSAGE
