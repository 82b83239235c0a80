"""``portable-llm generate PATH --prompt ...`` (or ``--ids 1,2,3``): stream a checkpoint's
continuation of a prompt, then say why it stopped and how fast it ran."""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import time
from typing import Any, TextIO

from portable_llm.cli.options import (
    PREFILL_STEP_SIZE,
    add_engine_arguments,
    add_model_arguments,
    add_partition_arguments,
    add_sampling_arguments,
    add_speculative_arguments,
    apply_threads,
    one_thread_decode,
    sampling_options,
    token_ids,
)
from portable_llm.cli.output import (
    Progress,
    activations_note,
    check_usage,
    compile_note,
    error,
    path_errors,
    plural,
    wrap,
)

__all__ = ["add_generate_parser", "run_generate"]


def add_generate_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``generate`` subcommand to the ``portable-llm`` subparsers; return its parser."""
    p: argparse.ArgumentParser = sub.add_parser(
        "generate",
        help="stream the continuation of a prompt by a checkpoint (folder or .gguf); prints "
        "prefill and decode tokens/s at the end",
    )
    add_model_arguments(p)
    p.add_argument(
        "--compile",
        action="store_true",
        help="also where the compiled decode step is opt-in (torch's CPU: make_fx and inductor, "
        "which needs a C++ compiler and 1.5-3.5 minutes in the first decoded token; "
        "docs/models.md); the decode line says why when it cannot run",
    )
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text (needs the checkpoint's tokenizer)")
    prompt.add_argument(
        "--ids",
        type=token_ids,
        metavar="1,2,3",
        help="the prompt as token ids, comma-separated; the new ids are printed (no tokenizer "
        "needed)",
    )
    add_sampling_arguments(p)
    add_engine_arguments(p, batch=False)
    add_speculative_arguments(p)
    add_partition_arguments(p)
    return p


def run_generate(
    args: argparse.Namespace,
    out: TextIO | None = None,
    *,
    usage: argparse.ArgumentParser | None = None,
) -> int:
    """Load, stream the tokens to ``out`` (stdout), then print why generation stopped and the
    speeds; return the exit code.

    With ``--prompt`` the text pieces are streamed; with ``--ids`` the new token ids, separated
    by commas. On a terminal, stderr says what runs before the first token (loading, prefill).
    A usage error goes to ``usage.error`` (exit 2), or raises :class:`UsageError` without one.
    """
    from portable_llm.generation.generate import generate
    from portable_llm.generation.speculative import speculative_generate

    out = out if out is not None else sys.stdout
    ids = getattr(args, "ids", None)
    draft_path = getattr(args, "draft", None)
    penalty = getattr(args, "repetition_penalty", None)
    check_usage(usage, [
        (ids is not None and args.chat, "--chat needs a text --prompt, not --ids"),
        (draft_path is not None and penalty is not None,
         "--repetition-penalty does not combine with --draft"),
        *path_errors([("path", args.path), ("--draft", draft_path)]),
    ])  # fmt: skip
    threads = apply_threads(getattr(args, "threads", None), [args.backend])
    progress = Progress("generate")
    one = False  # decoding on one torch thread (one_thread_decode)
    try:
        progress(f"loading {args.path} on {args.backend} ({plural(threads, 'thread')}) ...")
        start = time.perf_counter()
        with progress.still("loading"):
            groups, main, model, draft = _load(args, draft_path)
        if not main:  # every rank generates; rank 0 prints
            out = open(os.devnull, "w")  # noqa: SIM115
        loaded = time.perf_counter() - start
        prompt = ids if ids is not None else _text_prompt(args, model)
        options = {
            "max_new_tokens": args.max_new_tokens, **sampling_options(args),
            "prefill_step_size": getattr(args, "prefill_step_size", PREFILL_STEP_SIZE),
        }  # fmt: skip
        if draft is None:
            gen = generate(model, prompt, **options, repetition_penalty=penalty)
        else:
            k = args.num_draft_tokens
            gen = speculative_generate(model, draft, prompt, num_draft_tokens=k, **options)
        progress(f"loaded in {loaded:.2f} s; prefill ...")
        one = draft is None and not groups and one_thread_decode(args.threads, model)
        pieces = iter(model.tokenizer.stream(gen) if args.chat else gen)  # chat prompt: ids
        with progress.still("prefill"):  # until the first token
            first = [*itertools.islice(pieces, 1)]
        for i, piece in enumerate(itertools.chain(first, pieces)):
            if i == 0 and one:  # the prompt is read: decode on one torch thread (see there)
                _torch_threads(1)
            text = piece if ids is None else f"{',' if i else ''}{piece}"
            print(text, end="", file=out, flush=True)
    except (OSError, ValueError, ImportError) as exc:
        error("generate", exc)
        return 1
    finally:
        if one:
            _torch_threads(threads)
    print(file=out)
    for line in _summary(model, draft, gen.stats, args.max_new_tokens, loaded, one):
        print(wrap(line), file=out)
    return 0


def _text_prompt(args: argparse.Namespace, model: Any) -> Any:
    """``--prompt``'s text, or with ``--chat`` the ids of the chat template applied to it."""
    if model.tokenizer is None:
        raise ValueError(
            f"{args.path} has no tokenizer.json: a text --prompt needs one; pass token "
            "ids instead (--ids 1,2,3)"
        )
    if not args.chat:
        return args.prompt
    # transformers' chat ids: the template writes its own BOS
    messages = [{"role": "user", "content": args.prompt}]
    return model.tokenizer.apply_chat_template(messages, tokenize=True)


def _summary(
    model: Any, draft: Any, s: Any, max_new_tokens: int, loaded: float, one: bool
) -> list[str]:
    """The lines after the text: why generation stopped, the load time, the speeds (and the
    draft's acceptance with ``--draft``)."""
    from portable_llm.generation.speculative import SpeculativeStats

    lines = [
        _why_stopped(model, s, max_new_tokens),
        f"load {loaded:.2f} s ({model!r})",
        f"prefill: {plural(s.prompt_tokens, 'token')} in {s.prefill_seconds:.3f} s, "
        f"{s.prefill_tokens_per_second:.1f} tokens/s",
        f"decode: {plural(s.decode_steps, 'token')} in {s.decode_seconds:.3f} s, "
        f"{s.decode_tokens_per_second:.1f} tokens/s{activations_note(model)}"
        + (" (1 torch thread)" if one else "")
        + compile_note(model),
    ]
    if isinstance(s, SpeculativeStats):
        lines += [
            f"draft {draft!r}",
            f"speculative: {s.accepted_tokens} of {s.draft_tokens} proposed tokens accepted "
            f"(acceptance rate {s.acceptance_rate:.2f}), {s.rounds} verifying forwards",
        ]
    return lines


def _load(args: argparse.Namespace, draft_path: str | None) -> tuple[dict, bool, Any, Any]:
    """The partition groups, whether this rank prints, the model and the ``--draft`` (or
    ``None``), as ``--tensor-parallel``/``--pipeline-parallel`` and the checkpoint flags say."""
    from portable_llm.checkpoint.loader import load
    from portable_llm.partition.engine import launch_groups

    groups, main = launch_groups(
        args.backend,
        tensor_parallel=getattr(args, "tensor_parallel", 1),
        pipeline_parallel=getattr(args, "pipeline_parallel", 1),
    )
    model = load(
        args.path, backend=args.backend, dtype=args.dtype, device=args.device,
        dequantize=getattr(args, "dequantize", "auto"),
        activations=getattr(args, "activations", "auto"),
        compile=True if getattr(args, "compile", False) else "auto", **groups,
    )  # fmt: skip
    draft = None
    if draft_path is not None:
        draft = load(draft_path, backend=args.backend, dtype=args.dtype, device=args.device)
    return groups, main, model, draft


def _why_stopped(model: Any, stats: Any, max_new_tokens: int) -> str:
    """One line: the stop token that ended generation (with its text), or the token limit."""
    n = stats.generated_tokens
    new = f"{n} new {'token' if n == 1 else 'tokens'}"
    if stats.stop_token is None:
        return f"stopped: {new}, the --max-new-tokens limit ({max_new_tokens})"
    token = str(stats.stop_token)
    if model.tokenizer is not None:
        text = model.tokenizer.decode([stats.stop_token], skip_special_tokens=False)
        token += f" {text!r}"
    first = " (the first new token: no output)" if n == 0 else ""
    return f"stopped at stop token {token} after {new}{first}"


def _torch_threads(n: int) -> None:
    import torch

    torch.set_num_threads(n)
