"""Tiny random Qwen2 models written as GGUF files (float32, llama.cpp's tensor names), for llama.cpp tests."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
from transformers import PreTrainedTokenizerFast, Qwen2ForCausalLM

from tests.tiny import CHAT_TEMPLATE, build_model, build_tokenizer, noisy_copy


def _vocab_metadata(tok: PreTrainedTokenizerFast) -> tuple[list[str], list[int], list[str]]:
    """Tokens in id order, their llama.cpp types, and the BPE merges ("a b"), as a GPT-2-style GGUF holds them."""
    by_id = {i: t for t, i in tok.get_vocab().items()}
    special = set(tok.all_special_ids) | {i for i, t in tok.added_tokens_decoder.items() if t.special}
    tokens, types = [], []
    for i in range(len(tok)):
        tokens.append(by_id[i])
        # Added special tokens are control tokens: llama.cpp never splits text into them.
        types.append(int(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL))
    backend = json.loads(tok.backend_tokenizer.to_str())
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]]
    return tokens, types, merges


def write_tiny_gguf(path: Path, tok: PreTrainedTokenizerFast, model: Qwen2ForCausalLM) -> Path:
    """Writes `model` with its tokenizer as a float32 GGUF that llama.cpp (and transformers) load as "qwen2".

    Qwen2 needs no q/k permutation: its RoPE (rotate-half) is llama.cpp's NEOX mode for this
    architecture. A tied output head is simply left out; llama.cpp reuses token_embd.
    """
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "qwen2")
    writer.add_name(path.stem)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]) if getattr(cfg, "rope_parameters", None)
                              else float(cfg.rope_theta))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    tokens, types, merges = _vocab_metadata(tok)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_eos_token_id(tok.eos_token_id)
    writer.add_pad_token_id(tok.pad_token_id)
    writer.add_add_bos_token(False)
    writer.add_chat_template(tok.chat_template or CHAT_TEMPLATE)

    names = gguf.TensorNameMap(gguf.MODEL_ARCH.QWEN2, cfg.num_hidden_layers)
    tied = cfg.tie_word_embeddings
    for hf_name, tensor in model.state_dict().items():
        if tied and hf_name == "lm_head.weight":
            continue
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"no llama.cpp name for {hf_name}"
        writer.add_tensor(name, tensor.detach().float().numpy().astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def save_gguf_pair(root: Path, *, noise: float = 0.02, seed: int = 0) -> tuple[Path, Path, Path, Path]:
    """(target.gguf, draft.gguf, target folder, draft folder): the same tiny pair in both formats.

    The folders hold the identical weights for the torch runtime, so the two runtimes can be
    compared on one model.
    """
    root.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer()
    target = build_model(len(tok), seed=seed)
    target.config.eos_token_id = tok.eos_token_id
    draft = noisy_copy(target, noise=noise, seed=seed + 1)
    out = []
    for name, model in (("target", target), ("draft", draft)):
        out.append(write_tiny_gguf(root / f"tiny-{name}.gguf", tok, model))
    for name, model in (("target", target), ("draft", draft)):
        folder = root / name
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        out.append(folder)
    return out[0], out[1], out[2], out[3]
