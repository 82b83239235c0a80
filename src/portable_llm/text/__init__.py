"""Text: the tokenizer, streaming detokenization and sandboxed chat templates."""

from portable_llm.text.tokenizer import TextStream, Tokenizer

__all__ = ["TextStream", "Tokenizer"]
