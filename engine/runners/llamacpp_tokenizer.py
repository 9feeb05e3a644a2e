"""A GGUF model's tokenizer as llama.cpp already holds it, behind the slice of Hugging Face's API the engine uses.

Building a Hugging Face tokenizer from a GGUF takes ~17 s for Qwen2.5's 151,646 tokens on two
cores and holds ~130 MB of Python objects; llama.cpp loaded the same vocabulary with the weights.
Encoding and decoding go through llama.cpp (its "qwen2" pre-tokenizer matches Hugging Face's);
the chat template is the GGUF's own, rendered in the Jinja environment transformers uses, without
importing transformers (~30 MB): the llama.cpp runtime needs none of it.
"""
from __future__ import annotations

import ctypes
from collections.abc import Iterable, Sequence
from typing import Any

from engine.runners.llamacpp import LlamaCppRunner


class LlamaCppTokenizer:
    """encode / decode / apply_chat_template over a loaded LlamaCppRunner's vocabulary."""

    def __init__(self, runner: LlamaCppRunner) -> None:
        self._runner = runner  # keeps the model (and its vocabulary) alive
        self._lib = runner._lib
        self._vocab = runner.vocab_handle
        self._pieces: dict[tuple[int, bool], bytes] = {}  # (id, special) -> bytes; filled as ids appear
        self._template = None  # the compiled chat template, on first use
        template = self._lib.llama_model_chat_template(runner.model_handle, None)
        self.chat_template: str | None = template.decode("utf-8") if template else None
        eos = int(self._lib.llama_vocab_eos(self._vocab))
        self.eos_token_id: int | None = eos if eos >= 0 else None
        self.eos_token = self.convert_ids_to_tokens(eos) if eos >= 0 else None
        bos = int(self._lib.llama_vocab_bos(self._vocab))
        self.bos_token = self.convert_ids_to_tokens(bos) if bos >= 0 else None

    def __len__(self) -> int:
        return self._runner.vocab_size

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens=add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Ids of `text`; special tokens written in it (<|im_start|>) become their ids, as in transformers."""
        data = text.encode("utf-8")
        room = len(data) + 8
        for _ in range(2):
            out = (ctypes.c_int32 * room)()
            n = self._lib.llama_tokenize(self._vocab, data, len(data), out, room, add_special_tokens, True)
            if n >= 0:
                return list(out[:n])
            room = -n  # llama.cpp says how many it needs
        raise RuntimeError(f"llama.cpp could not tokenize {len(data)} bytes")

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = False,
               clean_up_tokenization_spaces: bool = False) -> str:
        """Text of `ids`; an incomplete UTF-8 character ends in U+FFFD, as Hugging Face's byte-level BPE does."""
        del clean_up_tokenization_spaces  # byte-level BPE needs no clean-up
        special = not skip_special_tokens
        return b"".join(self._piece(int(i), special) for i in ids).decode("utf-8", errors="replace")

    def convert_ids_to_tokens(self, token_id: int) -> str:
        return self._piece(token_id, True).decode("utf-8", errors="replace")

    def apply_chat_template(self, conversation: Sequence[dict[str, str]], tokenize: bool = False,
                            add_generation_prompt: bool = False, **kwargs: Any) -> str | list[int]:
        if not self.chat_template:
            raise ValueError("this model has no chat template")
        if self._template is None:
            self._template = _compile(self.chat_template)
        text = self._template.render(messages=list(conversation), add_generation_prompt=add_generation_prompt,
                                     eos_token=self.eos_token, bos_token=self.bos_token, **kwargs)
        return self.encode(text) if tokenize else text

    def _piece(self, token_id: int, special: bool) -> bytes:
        key = (token_id, special)
        piece = self._pieces.get(key)
        if piece is None:
            buf = ctypes.create_string_buffer(64)
            n = self._lib.llama_token_to_piece(self._vocab, token_id, buf, len(buf), 0, special)
            if n < 0:  # a longer piece: llama.cpp says how long
                buf = ctypes.create_string_buffer(-n)
                n = self._lib.llama_token_to_piece(self._vocab, token_id, buf, len(buf), 0, special)
            piece = self._pieces[key] = buf.raw[:max(n, 0)]
        return piece


def _compile(source: str):
    """The chat template in the sandboxed Jinja environment chat templates are written for
    (the one transformers renders them in: trimmed blocks, loop controls, tojson, raise_exception)."""
    import json
    from datetime import datetime

    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise TemplateError(message)

    def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)
