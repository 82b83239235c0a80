"""``portable-llm generate PATH --prompt ...`` (or ``--ids 1,2,3``): stream a checkpoint's
continuation of a prompt, then say why it stopped and how fast it ran."""

from __future__ import annotations

import argparse
import sys
import time
from typing import Any, TextIO

__all__ = ["add_generate_parser", "run_generate"]


def add_generate_parser(sub: Any) -> None:
    """Add the ``generate`` subcommand to the ``portable-llm`` subparsers."""
    p = sub.add_parser(
        "generate",
        help="stream the continuation of a prompt by a checkpoint folder; prints prefill and "
        "decode tokens/s at the end",
    )
    p.add_argument("path", help="checkpoint folder (config.json, model.safetensors, tokenizer)")
    prompt = p.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--prompt", help="the prompt text (needs the checkpoint's tokenizer.json)")
    prompt.add_argument(
        "--ids",
        type=_ids,
        metavar="1,2,3",
        help="the prompt as token ids, comma-separated; the new ids are printed (no tokenizer "
        "needed)",
    )
    p.add_argument("--backend", default="numpy", help="array library to run on (default numpy)")
    p.add_argument("--dtype", default=None, help="weights dtype (default: the checkpoint's)")
    p.add_argument(
        "--device", default=None, help="cpu, gpu, cuda:0, mps, ... (default: the backend's)"
    )
    p.add_argument("--max-new-tokens", type=int, default=50, metavar="N", help="default 50")
    p.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    p.add_argument("--top-k", type=int, default=None, metavar="K")
    p.add_argument("--top-p", type=float, default=None, metavar="P")
    p.add_argument("--min-p", type=float, default=None, metavar="P")
    p.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        metavar="R",
        help="divide the positive logits (multiply the negative) of the last 20 ids by R",
    )
    p.add_argument(
        "--chat", action="store_true", help="wrap the prompt in the tokenizer's chat template"
    )
    p.add_argument(
        "--prefill-step-size",
        type=int,
        default=2048,
        metavar="N",
        help="the prompt goes through the model in chunks of N tokens (default 2048)",
    )
    p.add_argument(
        "--draft",
        default=None,
        metavar="PATH",
        help="speculative decoding: a smaller checkpoint (folder or .gguf, kept quantized) with "
        "the same tokenizer proposes tokens that the model verifies; prints the acceptance rate",
    )
    p.add_argument(
        "--num-draft-tokens",
        type=int,
        default=4,
        metavar="K",
        help="tokens the --draft proposes per round (default 4)",
    )


def _ids(text: str) -> list[int]:
    """``--ids 1,2,3`` as a list of ints (argparse turns the ValueError into a usage error)."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    try:
        ids = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids such as 1,2,3, got {text!r}"
        ) from None
    if not ids:
        raise argparse.ArgumentTypeError("expected at least one token id, got none")
    return ids


def run_generate(args: argparse.Namespace, out: TextIO | None = None) -> int:
    """Load, stream the tokens to ``out`` (stdout), then print why generation stopped and the
    speeds; return the exit code.

    With ``--prompt`` the text pieces are streamed; with ``--ids`` the new token ids, separated
    by commas.
    """
    from portable_llm.checkpoint.loader import load
    from portable_llm.generation.generate import generate
    from portable_llm.generation.speculative import SpeculativeStats, speculative_generate

    out = out if out is not None else sys.stdout
    err = sys.stderr
    ids = getattr(args, "ids", None)
    try:
        if ids is not None and args.chat:
            raise ValueError("--chat needs a text --prompt, not --ids")
        start = time.perf_counter()
        model = load(args.path, backend=args.backend, dtype=args.dtype, device=args.device)
        draft_path = getattr(args, "draft", None)
        draft = None
        if draft_path is not None:
            draft = load(draft_path, backend=args.backend, dtype=args.dtype, device=args.device)
        loaded = time.perf_counter() - start
        prompt: Any = ids
        if ids is None:
            prompt = args.prompt
            if model.tokenizer is None:
                raise ValueError(
                    f"{args.path} has no tokenizer.json: a text --prompt needs one; pass token "
                    "ids instead (--ids 1,2,3)"
                )
            if args.chat:  # transformers' chat ids: the template writes its own BOS
                messages = [{"role": "user", "content": prompt}]
                prompt = model.tokenizer.apply_chat_template(messages, tokenize=True)
        options = {
            "max_new_tokens": args.max_new_tokens, "temperature": args.temperature,
            "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p, "seed": args.seed,
            "prefill_step_size": getattr(args, "prefill_step_size", 2048),
        }  # fmt: skip
        if draft is None:
            penalty = getattr(args, "repetition_penalty", None)
            gen = generate(model, prompt, **options, repetition_penalty=penalty)
        elif getattr(args, "repetition_penalty", None) is not None:
            raise ValueError("--repetition-penalty is not supported with --draft")
        else:
            k = args.num_draft_tokens
            gen = speculative_generate(model, draft, prompt, num_draft_tokens=k, **options)
        pieces = model.tokenizer.stream(gen) if args.chat else gen  # the chat prompt is ids
        for i, piece in enumerate(pieces):
            text = piece if ids is None else f"{',' if i else ''}{piece}"
            print(text, end="", file=out, flush=True)
    except (FileNotFoundError, ValueError, ImportError) as exc:
        print(f"portable-llm generate: error: {exc}", file=err)
        return 1
    s = gen.stats
    print(file=out)
    print(_why_stopped(model, s, args.max_new_tokens), file=out)
    print(
        f"load {loaded:.2f} s ({model!r})\n"
        f"prefill: {s.prompt_tokens} tokens in {s.prefill_seconds:.3f} s, "
        f"{s.prefill_tokens_per_second:.1f} tokens/s\n"
        f"decode: {s.decode_steps} tokens in {s.decode_seconds:.3f} s, "
        f"{s.decode_tokens_per_second:.1f} tokens/s",
        file=out,
    )
    if isinstance(s, SpeculativeStats):
        print(
            f"draft {draft!r}: {s.accepted_tokens} of {s.draft_tokens} proposed tokens accepted "
            f"(acceptance rate {s.acceptance_rate:.2f}), {s.rounds} verifying forwards",
            file=out,
        )
    return 0


def _why_stopped(model: Any, stats: Any, max_new_tokens: int) -> str:
    """One line: the stop token that ended generation (with its text), or the token limit."""
    n = stats.generated_tokens
    new = f"{n} new token{'' if n == 1 else 's'}"
    if stats.stop_token is None:
        return f"stopped: {new}, the --max-new-tokens limit ({max_new_tokens})"
    token = str(stats.stop_token)
    if model.tokenizer is not None:
        text = model.tokenizer.decode([stats.stop_token], skip_special_tokens=False)
        token += f" {text!r}"
    first = " (the first new token: no output)" if n == 0 else ""
    return f"stopped at stop token {token} after {new}{first}"
