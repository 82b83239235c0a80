"""The ``portable-llm`` command: ``report`` (accuracy against float64), ``bench`` (speed),
``generate`` and ``batch``; the flags they share, their errors, their line width."""

from __future__ import annotations

import dataclasses
import io
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import numpy_only, only_on
from portable_llm.backends import get_backend
from portable_llm.cli import bench, options, report
from portable_llm.cli.cli import main, parser
from portable_llm.cli.output import WIDTH
from portable_llm.core.dispatch import dispatcher
from portable_llm.testing import reference


def _tables(out: str) -> list[dict[str, str]]:
    """The rows of every table printed: a header line, a rule of dashes, rows up to a blank line."""
    lines = out.splitlines()
    rows: list[dict[str, str]] = []
    for i in range(1, len(lines)):
        if not lines[i] or set(lines[i]) - {"-", " "}:
            continue
        headers = re.split(r"\s{2,}", lines[i - 1].strip())
        for line in lines[i + 1 :]:
            if not line.strip():
                break
            cells = re.split(r"\s{2,}", line.strip())
            assert len(cells) == len(headers), f"misaligned row {line!r} under {headers}"
            rows.append(dict(zip(headers, cells, strict=True)))
    return rows


def _report(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, dict]:
    """The report with ``-v``: its rows by (op, dtype, impl)."""
    code = main(["report", "-v", *args])
    out = capsys.readouterr().out
    rows = {(r["op"], r["dtype"], r["impl"]): r for r in _tables(out)}
    return code, out, rows


def _native_ran(path: str) -> bool:
    """Whether a report's path column says a native kernel ran (``native``, ``native+portable``)."""
    return "native" in path.split("+")


def _kernels(out: str) -> dict[str, str]:
    """The "what auto ran" lines under the tables: ``case`` or ``case (dtypes)`` -> the path,
    its wrapped continuation lines joined."""
    found: dict[str, str] = {}
    key = None
    for line in out.splitlines():
        if line.startswith("         ") and key is not None:
            found[key] += " " + line.strip()
        elif line.startswith("     ") and not line.startswith("      ") and ": " in line:
            key, _, path = line.strip().partition(": ")
            found[key] = path
        else:
            key = None
    return found


def _check_width(out: str) -> None:
    wide = [line for line in out.splitlines() if len(line) > WIDTH]
    assert not wide, f"{len(wide)} line(s) wider than {WIDTH}: {wide[:3]}"


def _unwrap(text: str) -> str:
    """Wrapped output (continuation lines indented by 4) as one line per message."""
    return re.sub(r"\n {4}(?=\S)", " ", text)


@numpy_only
def test_report_is_the_default_command_and_covers_every_op_on_numpy(capsys):
    code = main(["--backend", "numpy", "-v"])
    out = capsys.readouterr().out
    rows = {(r["op"], r["dtype"], r["impl"]): r for r in _tables(out)}
    assert code == 0, out
    dtypes = get_backend("numpy").float_dtypes()
    # NumPy's one native kernel: quantized_linear's float32 blocks of codes + BLAS, for every
    # float dtype but float64 (there the portable path is the reference's own arithmetic). Where
    # a kernel exists the report adds the portable row beside auto's.
    # The bound rows (the kernels a loaded model binds) take the same kernel for a bound
    # quantized weight.
    quantized = ("quantized_linear", "bound quantized_linear")
    native = {(c, d) for c in quantized for d in dtypes if d != "float64"}
    want = {(c.name, d, "auto") for c in report.CASES for d in dtypes}
    assert want | {(*k, "portable") for k in native} == set(rows)
    _check_width(out)
    for (name, dtype, impl), row in rows.items():
        assert row["result"] == "ok", row
        assert _native_ran(row["path"]) == ((name, dtype) in native and impl == "auto"), row
        assert 0 <= float(row["err/tol"]) <= 1, row
        # auto's portable choice: tiled for the long attention case (L * S = 2**20), else direct
        if not _native_ran(row["path"]):
            assert row["path"] == ("tiled" if name == "sdpa long" else "portable")
        if dtype == "float64":  # NumPy float64 is the reference's own arithmetic
            assert float(row["max abs err"]) < 1e-13
    # only the native kernel is listed (every other path is portable_llm's own)
    assert _kernels(out) == {
        "quantized_linear (float16, bfloat16, float32)": "float32 blocks of codes + BLAS",
        "quantized_linear (float64)": "portable (float32 blocks of codes + BLAS not taken by auto)",
        "bound quantized_linear (float16, bfloat16, float32)": "float32 blocks of codes + BLAS",
        "bound quantized_linear (float64)": "portable (float32 blocks of codes + BLAS not taken "
        "by auto)",
    }
    # logprobs returns float32 for half inputs: its rows are checked at float32's tolerance.
    assert "   logprobs, logprobs+top_k (float16, bfloat16): 1e-05/1e-05, the tolerance" in out
    # Progress: a line when the backend starts and one when it ends, with its time.
    assert re.search(r"^== numpy \S+, default device cpu$", out, re.M)
    assert re.search(rf"^== numpy: {len(rows)} checks in \d+\.\d s, all ok$", out, re.M)
    assert out.rstrip().endswith("all within tolerance")


# JAX: 22 s of its env (every op compiled at each case's shapes); its ops are checked against
# the reference by the ops tests there, and `tox -e slow` runs this report test on JAX too.
@pytest.mark.slow_on("jax")
def test_report_on_backend(backend, capsys):
    # float32 only: every op on every backend, in seconds (JAX compiles per dtype).
    code, out, rows = _report(["--backend", backend, "--dtype", "float32"], capsys)
    assert code == 0, out
    _check_width(out)
    bk = get_backend(backend)
    kernels = _kernels(out)
    for case in report.CASES:
        auto = rows[(case.name, "float32", "auto")]
        assert auto["result"] == "ok"
        assert float(auto["max abs err"]) < 1e-4
        assert float(auto["err/tol"]) <= 1
        # Under the table, the kernels behind the path column (one dtype here: no dtype list),
        # listed wherever a native kernel ran or was passed over.
        listed = kernels.get(case.name, "")
        assert auto["path"] in ("portable", "tiled") or listed, (case.name, auto["path"])
        if _native_ran(auto["path"]):
            assert any(k in listed for k in (n.kernel for n in dispatcher(bk).native.values()))
        # Beside auto, the path it did not take: portable when a native kernel ran, native
        # when auto passed a kernel over ("portable (<kernel> not taken by auto)")
        # (or nothing when the kernel cannot express the arguments).
        extra = [impl for (name, _, impl) in rows if name == case.name and impl != "auto"]
        if _native_ran(auto["path"]):
            assert extra == ["portable"], auto["path"]
        else:
            assert extra in ([], ["native"]) and (extra == [] or case.op in dispatcher(bk).native)
        for impl in extra:
            assert rows[(case.name, "float32", impl)]["result"] == "ok"
        if case.op in dispatcher(bk).native:
            assert dispatcher(bk).native[case.op].kernel in listed


def test_report_prints_one_line_per_op_and_backend_by_default(capsys):
    """The default report folds each op's rows (dtypes x paths) into one line: its dtypes, the
    paths auto took, the worst err/tol and result of the -v rows; no kernel lines."""
    args = ["--backend", "numpy", "--op", "quantized_linear", "--op", "softmax"]
    code, verbose, rows = _report(args, capsys)
    assert code == 0 and main(["report", *args]) == 0
    out = capsys.readouterr().out
    _check_width(out)
    lines = _tables(out)
    assert [r["op"] for r in lines] == ["softmax", "quantized_linear", "bound quantized_linear"]
    short = {"float16": "f16", "bfloat16": "bf16", "float32": "f32", "float64": "f64"}
    for line in lines:
        mine = [r for (op, _, _), r in rows.items() if op == line["op"]]
        dtypes = dict.fromkeys(short[d] for (op, d, _) in rows if op == line["op"])
        assert line["dtypes"] == " ".join(dtypes)
        assert float(line["err/tol"]) == max(float(r["err/tol"]) for r in mine)
        auto = dict.fromkeys(r["path"] for (op, _, impl), r in rows.items()
                             if op == line["op"] and impl == "auto")  # fmt: skip
        assert line["auto ran"] == ", ".join(auto) and line["result"] == "ok"
    assert "native, portable" in {r["auto ran"] for r in lines}  # float64 takes the portable
    assert "what auto ran" in verbose and "what auto ran" not in out
    assert len(out.splitlines()) < len(verbose.splitlines())


def test_report_marks_a_wrong_reference_and_exits_1(monkeypatch, capsys):
    def wrong(x: np.ndarray) -> np.ndarray:
        return reference.relu(x) + 0.5  # relu is exact in every dtype: every error is 0.5

    cases = [
        dataclasses.replace(c, reference=wrong) if c.name == "relu" else c for c in report.CASES
    ]
    monkeypatch.setattr(report, "CASES", cases)
    code, out, rows = _report(["--backend", "numpy", "--op", "relu", "--op", "silu"], capsys)
    assert code == 1
    for dtype in get_backend("numpy").float_dtypes():
        assert rows[("relu", dtype, "auto")]["result"] == "FAIL"
        assert float(rows[("relu", dtype, "auto")]["max abs err"]) == 0.5
        assert float(rows[("relu", dtype, "auto")]["err/tol"]) > 1
        assert rows[("silu", dtype, "auto")]["result"] == "ok"
    _check_width(out)
    flat = re.sub(r"\n {4}", " ", out)  # the failure lines, unwrapped
    assert re.search(r"^FAIL: numpy relu float32 impl=auto: .*differ beyond", flat, re.M)
    assert out.rstrip().endswith("row(s) outside tolerance")
    # Without -v: one line per op, the worst result of its rows, the failures repeated below.
    assert main(["report", "--backend", "numpy", "--op", "relu", "--op", "silu"]) == 1
    summary = capsys.readouterr().out
    lines = {r["op"]: r for r in _tables(summary)}
    assert (lines["relu"]["result"], lines["silu"]["result"]) == ("FAIL", "ok")
    assert re.search(r"^FAIL: numpy relu float32 impl=auto: ", summary, re.M)


def test_report_marks_a_crash_as_error_and_exits_1(monkeypatch, capsys):
    def crash(x, **options):
        raise RuntimeError("kernel exploded")

    cases = [dataclasses.replace(c, call=crash) if c.name == "gelu" else c for c in report.CASES]
    monkeypatch.setattr(report, "CASES", cases)
    code, out, rows = _report(["--backend", "numpy", "--op", "gelu", "--dtype", "float64"], capsys)
    assert code == 1
    assert rows[("gelu", "float64", "auto")]["result"] == "ERROR"
    assert "RuntimeError: kernel exploded" in out
    _check_width(out)


def test_report_without_ml_dtypes_skips_bfloat16_with_a_note(monkeypatch, capsys):
    monkeypatch.setattr(report, "numpy_bfloat16", lambda: None)
    code, out, rows = _report(["--backend", "numpy", "--op", "rms_norm"], capsys)
    assert code == 0, out
    assert out.startswith("note: bfloat16 skipped on every backend: ml_dtypes is not installed")
    assert {d for _, d, _ in rows} == set(get_backend("numpy").float_dtypes()) - {"bfloat16"}


@pytest.mark.parametrize(
    "args", [["report", "--op", "nope"], ["report", "--backend", "nope"], ["bench", "--op", "x"]]
)
def test_unknown_names_are_usage_errors(args, capsys):
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2
    assert "unknown" in capsys.readouterr().err


def _usage_error(args: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """Run ``args``, which must be a usage error: exit 2, one message, no traceback."""
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert exc.value.code == 2, args
    captured = capsys.readouterr()
    assert captured.out == "" and "Traceback" not in captured.err, captured
    _check_width(captured.err)
    lines = _unwrap(captured.err).splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith(f"portable-llm {args[0]}: error: "), lines[0]
    return lines[0]


@pytest.fixture(scope="module")
def tiny_folder(tmp_path_factory):
    return _checkpoint(tmp_path_factory.mktemp("tiny"), eos=[])


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["generate", "{f}", "--ids", "1", "--max-new-tokens", "0"], "--max-new-tokens"),
        (["batch", "{f}", "--ids", "1", "--max-tokens", "-3"], "--max-tokens"),
        (["batch", "{f}", "--ids", "1", "--max-new-tokens", "x"], "--max-new-tokens"),
        (["generate", "{f}", "--ids", "1", "--backend", "nope"], "--backend"),
        (["batch", "{f}", "--ids", "1", "--backend", "nope"], "--backend"),
        (["generate", "{f}", "--ids", "1", "--threads", "0"], "--threads"),
        (["report", "--threads", "-1"], "--threads"),
        (["generate", "{f}", "--ids", "1", "--top-p", "2"], "--top-p"),
        (["batch", "{f}", "--ids", "1", "--temperature", "-1"], "--temperature"),
        (["batch", "{f}", "--ids", "1", "--chat"], "--chat"),
        (["batch", "{f}"], "--prompt"),
        (["generate", "{f}/nowhere", "--ids", "1"], "path: no such file or folder"),
        (["generate", "{f}", "--ids", "1", "--draft", "none.gguf"], "--draft: no such file"),
        (["bench", "--model", "nonexistent.gguf"], "--model: no such file or folder"),
        (["bench", "--model", "{f}/config.json"], "--model: {f}/config.json is a file but not"),
        (["bench", "--model", "{f}/fake.gguf"], "--model: {f}/fake.gguf is not a readable GGUF"),
        (["bench", "--repeat", "0"], "--repeat"),
        (["report", "--dtype", "float8"], "--dtype: unknown dtype(s) float8"),
    ],
)
def test_usage_errors_are_one_line_in_the_flags_words(args, words, tiny_folder, capsys):
    (tiny_folder / "fake.gguf").write_text("not a GGUF file\n")
    args = [a.format(f=tiny_folder) for a in args]
    assert words.format(f=tiny_folder) in _usage_error(args, capsys)


def test_subcommands_share_one_flag_vocabulary():
    subs = parser().subcommands

    def flags(name: str) -> set[str]:
        return {o for a in subs[name]._actions for o in a.option_strings}

    sampling = {"--max-new-tokens", "--temperature", "--top-k", "--top-p", "--min-p", "--seed",
                "--repetition-penalty", "--chat"}  # fmt: skip
    place = {"--backend", "--dtype", "--device", "--threads"}
    for name in ("generate", "batch"):
        assert sampling | place | {"--prompt", "--ids", "--max-tokens"} <= flags(name), name
    for name in ("report", "bench"):
        assert {"--backend", "--threads", "--op", "--dtype"} <= flags(name), name
    for name in ("generate", "batch"):  # --max-tokens: an alias that the help does not show
        assert "--max-tokens" not in subs[name].format_help()
    for name in subs:
        _check_width(subs[name].format_help())
    _check_width(parser().format_help())


def test_threads_default_follows_the_idle_cores(monkeypatch):
    monkeypatch.setattr(options.os, "cpu_count", lambda: 2)
    for load, want in ((0.1, 2), (0.7, 1), (1.2, 1), (9.0, 1)):
        monkeypatch.setattr(options.os, "getloadavg", lambda load=load: (load, 0.0, 0.0))
        assert options.default_threads() == want, load
    monkeypatch.setattr(options.os, "cpu_count", lambda: 8)
    assert options.default_threads() == 1  # load 9 on 8 cores
    monkeypatch.setattr(options.os, "getloadavg", lambda: (2.6, 0.0, 0.0))
    assert options.default_threads() == 5


def test_apply_threads_sets_torch_threads():
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    try:
        assert options.apply_threads(1, ["torch"]) == 1
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_apply_threads_on_torch_sets_numpys_blas_threads():
    """torch's one-row float32 products run on NumPy's BLAS (``native/torch.py``), so
    ``--threads`` on torch sets its threads too (a BLAS left at two threads decoded 5x slower on
    a busy machine)."""
    pytest.importorskip("torch")
    threadpoolctl = pytest.importorskip("threadpoolctl")
    import torch

    def blas_threads() -> set[int]:
        return {
            i["num_threads"] for i in threadpoolctl.threadpool_info() if i["user_api"] == "blas"
        }

    before = torch.get_num_threads()
    with threadpoolctl.threadpool_limits(2, user_api="blas"):  # restored on exit
        if not blas_threads():
            pytest.skip("NumPy's BLAS is not one threadpoolctl sees")
        assert blas_threads() == {2}
        try:
            options.apply_threads(1, ["torch"])
            assert blas_threads() == {1}
        finally:
            torch.set_num_threads(before)


def test_report_and_bench_print_each_row_as_it_is_ready(monkeypatch, capsys):
    # When the third case runs, the rows of the first two are already out.
    seen: list[str] = []
    check_case = report.check_case

    def spy(bk, case, dtype):
        seen.append(capsys.readouterr().out)
        return check_case(bk, case, dtype)

    monkeypatch.setattr(report, "check_case", spy)
    args = ["--backend", "numpy", "--op", "silu", "--op", "relu", "--dtype", "float32", "-v"]
    assert main(["report", *args]) == 0
    assert "silu" not in seen[0] and re.search(r"^silu +float32 +auto", seen[1], re.M)
    measure = bench.measure

    def timed(variants, sync, repeat, target, budget=0.0):
        seen.append(capsys.readouterr().out)
        return measure(variants, sync, 1, 0.0, 0.0)

    monkeypatch.setattr(bench, "measure", timed)
    assert main(["bench", "--quick", "--backend", "numpy", "--op", "rms_norm"]) == 0
    assert "(1, E) x (E,)" not in seen[-2] and "(1, E) x (E,) " in seen[-1]


def test_generate_says_what_runs_on_a_terminal(tiny_folder, monkeypatch, capsys):
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    err = Terminal()
    monkeypatch.setattr(sys, "stderr", err)
    args = [str(tiny_folder), "--ids", "1,2", "--max-new-tokens", "2", "--threads", "1"]
    assert main(["generate", *args]) == 0
    lines = [line for line in _unwrap(err.getvalue()).splitlines() if "threadpoolctl" not in line]
    assert lines[0] == f"loading {tiny_folder} on numpy (1 thread) ..."
    assert re.fullmatch(r"loaded in \d+\.\d\d s; prefill \.\.\.", lines[1])
    out = capsys.readouterr().out
    _check_width(out)
    assert "prefill: 2 tokens in" in out and "decode: 1 token in" in out  # one token, singular
    args = ["batch", str(tiny_folder), "--ids", "1,2", "--ids", "3", "--max-new-tokens", "2"]
    assert main(args) == 0
    assert err.getvalue().splitlines()[-1] == "2 requests; prefill and decode ..."
    _check_width(capsys.readouterr().out)


def test_batch_samples_with_the_shared_flags(tiny_folder, capsys):
    def run(*flags: str) -> list[str]:
        args = ["batch", str(tiny_folder), "--ids", "1,2", "--ids", "3", "--max-new-tokens", "6"]
        assert main([*args, *flags]) == 0
        out = capsys.readouterr().out.splitlines()
        return [out[i + 1] for i, line in enumerate(out) if line.startswith("--- [")]

    greedy = run()
    sampled = run("--temperature", "1.5", "--top-k", "50", "--seed", "3")
    assert sampled == run("--temperature", "1.5", "--top-k", "50", "--seed", "3")  # seeded
    assert sampled != greedy and sampled != run("--temperature", "1.5", "--seed", "4")


def test_python_dash_m_runs_the_report():
    proc = subprocess.run(
        [sys.executable, "-m", "portable_llm", "--backend", "numpy", "--op", "relu"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "relu" in proc.stdout and "all within tolerance" in proc.stdout


def test_bench_quick_prints_times_and_ratios(backend, capsys):
    code = main(["bench", "--quick", "--repeat", "2", "--backend", backend, "--op", "rms_norm"])
    out = capsys.readouterr().out
    rows = _tables(out)
    assert [r["shapes"] for r in rows] == [
        c.label() for c in bench.BENCH_CASES if c.op == "rms_norm"
    ]
    _check_width(out)
    assert re.search(rf"^== {backend} \S+, default device", out, re.M)  # one table per backend
    has_native = "rms_norm" in bench.DIRECT[backend]() if backend in bench.DIRECT else False
    for row in rows:
        assert row["op"] == "rms_norm"
        for col in ("auto", "portable") + (("native",) if has_native else ()):
            value, unit = row[col].split()
            assert float(value) > 0 and unit in ("ns", "us", "ms", "s")
        for col in ("auto/nat", "port/nat"):
            if has_native:
                assert float(row[col]) > 0
            else:
                assert row[col] == "-"
    kernels = _unwrap(out).split(f"   native kernels on {backend} (float32): ")[1].split("\n")[0]
    assert kernels == (
        f"rms_norm: {bench.DIRECT[backend]()['rms_norm'][0]}" if has_native else "none"
    )
    gate = _unwrap(out).splitlines()
    gate = [line for line in gate if line.startswith("gate rms_norm (1, E) x (E,)")]
    assert len(gate) == 1
    assert re.search(r"\d\.\d\d (PASS|FAIL)$" if has_native else r"n/a", gate[0])
    assert code == (1 if gate[0].endswith("FAIL") else 0), out  # the timing decides which


@pytest.mark.parametrize(("ratio", "code"), [(1.0, 0), (1.3, 0), (1.31, 1)])
def test_bench_exits_1_when_a_gate_fails(monkeypatch, capsys, ratio, code):
    # A fake native rms_norm on NumPy and a fake measurement: the exit status follows the gate.
    monkeypatch.setitem(bench.DIRECT, "numpy", lambda: {"rms_norm": ("fake", lambda x, w: x)})

    def measure(variants, sync, repeat, target, budget=0.0):
        assert set(variants) == {"auto", "portable", "native"}
        return bench.Timing(dict.fromkeys(variants, 1e-6), {"auto": ratio, "portable": ratio})

    monkeypatch.setattr(bench, "measure", measure)
    assert main(["bench", "--quick", "--backend", "numpy", "--op", "rms_norm"]) == code
    out = capsys.readouterr().out
    verdict = "FAIL" if code else "PASS"
    name = f"gate rms_norm {bench.BENCH_CASES[0].label()} on numpy"
    lines = _unwrap(out).splitlines()
    assert f"{name}: impl='auto' within 1.3x of native: {ratio:.2f} {verdict}" in lines
    last = lines[-1]
    if code:
        assert last.startswith(f"FAIL: {name}: auto/native 1.31 > 1.3. Timings are noisy")
        assert "rerun on an idle machine" in last
    else:
        assert last.startswith("gate ")  # no FAIL line after the gates


def test_bench_skips_a_backend_without_the_dtype(monkeypatch, capsys):
    numpy_bk = get_backend("numpy")
    monkeypatch.setattr(numpy_bk, "float_dtypes", lambda: ("float32", "float64"))
    code = main(
        ["bench", "--quick", "--backend", "numpy", "--op", "rms_norm", "--dtype", "float16"]
    )
    out = capsys.readouterr().out
    assert code == 0, out
    assert "skipped: no float16 on numpy (float32, float64)" in out
    assert _tables(out) == []


# -- generate -----------------------------------------------------------------------------------


def _checkpoint(folder, *, eos, tokenizer: bool = False):
    """A tiny random qwen2 checkpoint whose generation_config names ``eos`` (a list of ids)."""
    import json

    from portable_llm.testing.checkpoints import tiny_config, write_checkpoint, write_tokenizer

    cfg = tiny_config("qwen2")
    write_checkpoint(folder, cfg)
    if tokenizer:
        write_tokenizer(folder, vocab_size=cfg["vocab_size"])
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos}))
    return folder


def _greedy(folder, prompt, n):
    import portable_llm as pl

    return list(pl.generate(pl.load(folder), prompt, max_new_tokens=n, stop=()))


def test_generate_ids_without_a_tokenizer(tmp_path, capsys):
    folder = _checkpoint(tmp_path, eos=[])  # no stop token: runs to the limit
    want = _greedy(folder, [1, 2, 3], 5)
    assert main(["generate", str(folder), "--ids", "1, 2,3", "--max-new-tokens", "5"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ",".join(map(str, want))  # the new ids, as --ids takes them
    assert out[1] == "stopped: 5 new tokens, the --max-new-tokens limit (5)"
    assert re.fullmatch(r"prefill: 3 tokens in [\d.]+ s, [\d.]+ tokens/s", out[3])
    assert re.fullmatch(r"decode: 4 tokens in [\d.]+ s, [\d.]+ tokens/s", out[4])


@only_on("torch")
@pytest.mark.parametrize(
    ("flags", "calls"),
    [
        ([], [2, 1, 2]),  # chosen 2; one thread once the prompt is read; 2 again at the end
        (["--threads", "2"], [2]),  # asked for: kept
        (["--dtype", "bfloat16"], [2]),  # not float32: NumPy's BLAS has no bfloat16
    ],
)
def test_generate_decodes_torch_float32_on_one_thread(tmp_path, monkeypatch, capsys, flags, calls):
    """Without --threads, torch float32 decodes on one torch thread (its one-row products then
    run on NumPy's BLAS; options.one_thread_decode) after reading the prompt on those chosen;
    the same tokens as a run that stays on two threads."""
    import torch

    folder = _checkpoint(tmp_path, eos=[])
    base = [
        "generate",
        str(folder),
        "--backend",
        "torch",
        "--ids",
        "1,2,3",
        "--max-new-tokens",
        "5",
    ]
    dtype = [f for f in flags if f != "--threads" and f != "2"]
    before = torch.get_num_threads()
    seen: list[int] = []
    real = torch.set_num_threads
    monkeypatch.setattr(options, "default_threads", lambda: 2)
    try:
        with monkeypatch.context() as m:
            m.setattr(torch, "set_num_threads", lambda n: (seen.append(n), real(n))[1])
            assert main([*base, *flags]) == 0
        assert seen == calls and torch.get_num_threads() == 2
        out = capsys.readouterr().out.splitlines()
        assert out[4].endswith("tokens/s (1 torch thread)") == (len(calls) == 3)
        got = out[0]
        assert main([*base, *dtype, "--threads", "2"]) == 0
        assert got == capsys.readouterr().out.splitlines()[0]
    finally:
        real(before)


def test_generate_says_which_stop_token_ended_it(tmp_path, capsys):
    folder = _checkpoint(tmp_path, eos=[])
    runs = ((p, _greedy(folder, p, 2)) for p in ([4, 5], [6, 7], [8, 9], [10, 11]))
    prompt, (first, second) = next((p, ids) for p, ids in runs if ids[0] != ids[1])
    arg = ",".join(map(str, prompt))
    # The second new token is the stop token: one id printed, then why it stopped.
    _checkpoint(tmp_path, eos=[second])
    assert main(["generate", str(folder), "--ids", arg]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[:2] == [str(first), f"stopped at stop token {second} after 1 new token"]
    # The first new token is a stop token: nothing to print, and the output says so.
    _checkpoint(tmp_path, eos=[first])
    assert main(["generate", str(folder), "--ids", arg]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ""
    assert out[1] == (
        f"stopped at stop token {first} after 0 new tokens (the first new token: no output)"
    )
    assert re.fullmatch(r"decode: 0 tokens in [\d.]+ s, [\d.]+ tokens/s", out[4])


def test_generate_text_prompt_names_the_stop_tokens_text(tmp_path, capsys):
    import portable_llm as pl

    folder = _checkpoint(tmp_path, eos=[], tokenizer=True)
    tok = pl.load(folder).tokenizer
    first = _greedy(folder, tok.encode("The keys"), 1)[0]
    _checkpoint(tmp_path, eos=[first], tokenizer=True)
    assert main(["generate", str(folder), "--prompt", "The keys"]) == 0
    out = capsys.readouterr().out.splitlines()
    text = tok.decode([first], skip_special_tokens=False)
    assert out[0] == ""
    assert out[1] == (
        f"stopped at stop token {first} {text!r} after 0 new tokens "
        "(the first new token: no output)"
    )


def test_generate_argument_errors(tmp_path, capsys):
    folder = _checkpoint(tmp_path, eos=[2])
    for args in (["--ids", "1,x"], ["--ids", ","], ["--ids", "1", "--prompt", "hi"], []):
        with pytest.raises(SystemExit) as exc:
            main(["generate", str(folder), *args])
        assert exc.value.code == 2, args
        err = capsys.readouterr().err
        assert "--ids" in err or "--prompt" in err, err
    assert main(["generate", str(folder), "--prompt", "hi"]) == 1  # no tokenizer.json
    err = _unwrap(capsys.readouterr().err)
    assert "has no tokenizer.json" in err and "--ids 1,2,3" in err
    with pytest.raises(SystemExit) as exc:
        main(["generate", str(folder), "--ids", "1,2", "--chat"])
    assert exc.value.code == 2
    assert "--chat needs a text --prompt" in capsys.readouterr().err
    assert main(["generate", str(folder), "--ids", "1,300"]) == 1  # V = 300
    assert "token ids must lie in [0, 300)" in _unwrap(capsys.readouterr().err)


@numpy_only
def test_bench_model_says_each_phase_and_each_comparison_it_skips(tmp_path, monkeypatch, capsys):
    """``bench --model`` is never silent: a line per phase (the checkpoint, then each engine's
    load, warm-up and timed run) on stderr; the comparison it promises next to a backend is a
    row, or a "skipped: <reason>" line that says how to install it."""
    from portable_llm.cli import model_bench

    def peer(folder, dtype):
        return 0.0, lambda ids, n: (0.5, (n - 1) / 4.0)  # a stand-in engine: 4 tokens/s

    cfg = {**model_bench.TINY, "vocab_size": 300}
    peers = (("here", "numpy", peer), ("gone", "no_such_module_q7", peer))
    monkeypatch.setattr(model_bench, "PEERS", {"numpy": peers})
    out = io.StringIO()
    assert model_bench.run_model_bench(["numpy"], quick=True, cache_dir=tmp_path, config=cfg,
                                       file=out) == 0  # fmt: skip
    text, err = out.getvalue(), capsys.readouterr().err
    engines = [r["engine"] for r in _tables(text)]
    assert engines == ["portable_llm", "here"]
    skipped = "gone skipped: no_such_module_q7 is not installed (pip install -c constraints.txt"
    assert skipped in _unwrap(text) and skipped in _unwrap(err)
    assert "here ran on the same checkpoint" in text
    phases = [line for line in err.splitlines() if line.startswith("bench: ")]
    assert phases[0].startswith("bench: the random checkpoint")
    for engine in ("portable_llm", "here"):
        for phase in ("loading", "warm-up run", "timed run"):
            assert any(line.startswith(f"bench: {engine} on numpy float32: {phase}")
                       for line in phases), (engine, phase)  # fmt: skip


def test_phases_say_every_few_seconds_that_a_phase_still_runs():
    import time

    from portable_llm.cli.output import Phases

    err = io.StringIO()
    with Phases("bench", file=err, every=0.05)("loading"):
        time.sleep(0.3)
    lines = err.getvalue().splitlines()
    assert lines[0] == "bench: loading ..."
    assert len(lines) >= 3 and all(re.fullmatch(r"bench: \.\.\. still loading \(\d+ s\)", x)
                                   for x in lines[1:])  # fmt: skip
    time.sleep(0.15)
    assert err.getvalue().splitlines() == lines  # nothing after the phase ends


def test_a_long_step_is_never_silent(tiny_folder, monkeypatch, capsys):
    """report, generate and batch say every HEARTBEAT seconds that a long step still runs:
    report on stderr always (a case that takes long), generate and batch on a terminal only
    (loading, generate's prefill)."""
    import time

    from portable_llm.cli import generate, output

    monkeypatch.setattr(output, "HEARTBEAT", 0.05)
    check_case = report.check_case

    def slow_case(bk, case, dtype):
        time.sleep(0.2)
        return check_case(bk, case, dtype)

    monkeypatch.setattr(report, "check_case", slow_case)
    assert main(["report", "--backend", "numpy", "--op", "relu", "--dtype", "float32"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err and all(re.fullmatch(r"report: \.\.\. still checking relu on numpy \(\d s\)", x)
                       for x in err), err  # fmt: skip
    measure = bench.measure

    def slow_measure(variants, sync, repeat, target, budget=0.0):
        time.sleep(0.2)
        return measure(variants, sync, 1, 0.0, 0.0)

    monkeypatch.setattr(bench, "measure", slow_measure)
    assert main(["bench", "--quick", "--backend", "numpy", "--op", "rms_norm"]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err and all(re.fullmatch(r"bench: \.\.\. still timing rms_norm .* on numpy \(\d s\)", x)
                       for x in err), err  # fmt: skip
    load = generate._load

    def slow_load(*args):
        time.sleep(0.2)
        return load(*args)

    monkeypatch.setattr(generate, "_load", slow_load)
    args = ["generate", str(tiny_folder), "--ids", "1,2", "--max-new-tokens", "2", "--threads", "1"]
    assert main(args) == 0
    assert "still" not in capsys.readouterr().err  # not a terminal: the result alone

    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.setattr(sys, "stderr", Terminal())
    assert main(args) == 0
    text = _unwrap(sys.stderr.getvalue())
    lines = [line for line in text.splitlines() if "threadpoolctl" not in line]
    assert lines[0].startswith("loading ") and lines[-1].startswith("loaded in "), lines
    assert re.fullmatch(r"\.\.\. still loading \(\d s\)", lines[1]), lines
