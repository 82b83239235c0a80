"""Text: the tokenizer, streaming detokenization and sandboxed chat templates."""

from portable_llm.text.chat_template import TemplateError
from portable_llm.text.tokenizer import TextStream, Tokenizer

__all__ = ["TemplateError", "TextStream", "Tokenizer"]
