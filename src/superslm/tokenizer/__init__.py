"""Tokenizers (Hugging Face folders and GGUF vocabularies), streaming detokenizer, chat templates."""

from superslm.tokenizer.chat import ChatTemplate
from superslm.tokenizer.detokenizer import StreamDecoder
from superslm.tokenizer.gguf_vocab import KNOWN_PRE_TYPES
from superslm.tokenizer.tokenizer import Tokenizer

__all__ = ["ChatTemplate", "KNOWN_PRE_TYPES", "StreamDecoder", "Tokenizer"]
