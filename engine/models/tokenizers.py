"""Whether two models share one token stream: tokenizer facts read without loading weights, and the check."""
from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path

from engine.errors import IncompatibleModelsError, ModelLoadError
from engine.loadspec import ProgressFn
from engine.models.census import check_sizes
from engine.models.gguf import read_gguf_header
from engine.models.store import Role, _first_line, _prepare, _Prepared, _read_json, resolve_source


@dataclass(frozen=True)
class TokenizerInfo:
    """What decides whether two models can share one token stream, read without loading weights."""

    name: str  # display name of the model it belongs to
    vocab: dict[str, int] = field(repr=False)  # token -> id, added tokens included
    merges: tuple[str, ...] = field(repr=False)  # BPE merges as "a b", in priority order
    eos: str | None  # end-of-sequence token text
    bos: str | None  # beginning-of-sequence token text
    pad: str | None  # padding token text
    head_rows: int  # rows of the model's output head (embedding size), may exceed len(vocab)

    @property
    def length(self) -> int:
        """Ids the tokenizer can produce: one past the largest id."""
        return max(self.vocab.values(), default=-1) + 1



def read_gguf_tokenizer(path: Path, name: str) -> TokenizerInfo:
    """Tokens, merges and special tokens from GGUF metadata: no slow tokenizer, no weights."""
    header = read_gguf_header(path)
    fields = header.fields
    tokens = fields.get("tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(f"{path} has no tokenizer in its GGUF metadata; it cannot be used here.")
    merges = fields.get("tokenizer.ggml.merges") or []
    # A crafted or damaged file can hold any type under these keys: check before indexing with them.
    if not isinstance(tokens, list) or not all(isinstance(t, str) for t in tokens) \
            or not isinstance(merges, list) or not all(isinstance(m, str) for m in merges):
        raise ModelLoadError(f"{path} has damaged tokenizer metadata (tokens or merges are not lists of text).")

    def tok(key: str) -> str | None:
        i = fields.get(key)
        if i is None:
            return None
        if not isinstance(i, int) or isinstance(i, bool):
            raise ModelLoadError(f"{path} has damaged tokenizer metadata ({key} is not a token id).")
        return tokens[i] if 0 <= i < len(tokens) else None

    # GGUF lists dims fastest-first: [hidden, vocab]; an untied head has its own output.weight.
    shape = header.tensor_shapes.get("output.weight") or header.tensor_shapes.get("token_embd.weight")
    return TokenizerInfo(
        name=name,
        vocab={t: i for i, t in enumerate(tokens) if not _is_placeholder(t)},
        merges=tuple(merges),
        eos=tok("tokenizer.ggml.eos_token_id"),
        bos=tok("tokenizer.ggml.bos_token_id") if fields.get("tokenizer.ggml.add_bos_token") else None,
        pad=tok("tokenizer.ggml.padding_token_id"),
        head_rows=int(shape[-1]) if shape else len(tokens),
    )


def _is_placeholder(token: str) -> bool:
    # llama.cpp fills unused embedding rows with "[PAD123]" entries; they are not tokens.
    return token.startswith("[PAD") and token.endswith("]") and token[4:-1].isdigit()


def read_folder_tokenizer(folder: Path, name: str) -> TokenizerInfo:
    """Tokenizer facts from tokenizer.json + configs; builds the tokenizer only as a fallback."""
    from transformers import AutoTokenizer

    config = _read_json(folder / "config.json")
    check_sizes(config, name, complete=False)  # a 0 or negative size is named here, before anything divides by it
    text_config = config.get("text_config") or config
    rows = int(text_config.get("vocab_size") or 0)
    tok_cfg = _read_json(folder / "tokenizer_config.json")
    special = _read_json(folder / "special_tokens_map.json")
    backend = _read_json(folder / "tokenizer.json")
    if backend.get("model", {}).get("vocab") is None:
        try:
            tok = AutoTokenizer.from_pretrained(str(folder))
        except Exception as e:
            raise ModelLoadError(f"Could not read the tokenizer of {name} in {folder}: {_first_line(e)}") from None
        backend = json.loads(tok.backend_tokenizer.to_str()) if getattr(tok, "is_fast", False) else {}
        vocab = dict(tok.get_vocab())
        tok_cfg = {"eos_token": tok.eos_token, "bos_token": tok.bos_token, "pad_token": tok.pad_token}
    else:
        vocab = dict(backend["model"]["vocab"])
    for added in backend.get("added_tokens", []):
        vocab[added["content"]] = int(added["id"])
    raw_merges = backend.get("model", {}).get("merges") or []
    merges = tuple(m if isinstance(m, str) else " ".join(m) for m in raw_merges)

    def special_token(key: str) -> str | None:
        v = tok_cfg.get(key, special.get(key))
        if isinstance(v, dict):
            v = v.get("content")
        return v or None

    bos = special_token("bos_token")
    if bos is not None and tok_cfg.get("add_bos_token") is False:
        bos = None  # declared but never inserted: it does not change the token stream
    info = TokenizerInfo(
        name=name, vocab={t: i for t, i in vocab.items() if not _is_placeholder(t)}, merges=merges,
        eos=special_token("eos_token"), bos=bos, pad=special_token("pad_token"), head_rows=rows,
    )
    # No vocab_size in config.json: assume the head has exactly one row per token.
    return info if info.head_rows else replace(info, head_rows=info.length)


def _tokenizer_info(prepared: _Prepared) -> TokenizerInfo:
    if prepared.folder is not None:
        return read_folder_tokenizer(prepared.folder, prepared.source.name)
    assert prepared.gguf is not None
    return read_gguf_tokenizer(prepared.gguf, prepared.source.name)


def tokenizer_info(spec: str | None, role: Role, progress: ProgressFn | None = None) -> TokenizerInfo:
    """Tokenizer facts for one model spec, without loading weights."""
    with ExitStack() as stack:
        return _tokenizer_info(_prepare(resolve_source(spec, role), progress, stack))


def check_compatible(target_tok_info: TokenizerInfo, draft_tok_info: TokenizerInfo) -> int:
    """Raises IncompatibleModelsError unless both models share one tokenizer; returns the shared vocab."""
    t, d = target_tok_info, draft_tok_info
    prefix = (f"The draft {d.name} (vocabulary {d.length:,} tokens, {d.head_rows:,} embedding rows) and "
              f"the target {t.name} (vocabulary {t.length:,} tokens, {t.head_rows:,} embedding rows) ")
    suffix = "; choose a draft from the same model family (same tokenizer)."
    if t.vocab != d.vocab:
        differ = [tok for tok, i in t.vocab.items() if d.vocab.get(tok) != i]
        example = f", e.g. {differ[0]!r} is id {t.vocab[differ[0]]} in the target" if differ else ""
        raise IncompatibleModelsError(
            prefix + f"have different vocabularies ({len(differ):,} target tokens differ{example})" + suffix)
    if t.merges != d.merges:
        raise IncompatibleModelsError(
            prefix + f"have different BPE merges ({len(t.merges):,} vs {len(d.merges):,})" + suffix)
    for label, a, b in (("end-of-sequence", t.eos, d.eos), ("beginning-of-sequence", t.bos, d.bos),
                        ("padding", t.pad, d.pad)):
        # An unset bos/pad on one side does not change the token stream; a different one does.
        if a != b and (label == "end-of-sequence" or (a is not None and b is not None)):
            raise IncompatibleModelsError(prefix + f"use different {label} tokens ({a!r} vs {b!r})" + suffix)
    shared = min(t.head_rows, d.head_rows)
    if shared < t.length:
        raise IncompatibleModelsError(
            prefix + f"share only {shared:,} embedding rows but the tokenizer has {t.length:,} ids" + suffix)
    return shared
