"""Tiny random models with a real byte-level BPE tokenizer, saved to disk, for fast CPU tests."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "def add(a, b):\n    return a + b\n",
    "The quick brown fox jumps over the lazy dog. Speculative decoding is lossless.",
    "Hello world! How are you today? I am fine, thank you.",
    "for i in range(10):\n    print(i * i)\n",
    "快速排序是一种分治算法。我们先选择一个基准元素。",
    "emoji test 🙂🚀✨ and more 🙂",
]


def build_tokenizer(vocab_size: int = 320, seed_corpus: list[str] | None = None) -> PreTrainedTokenizerFast:
    """Byte-level BPE: Chinese and emoji split across tokens, as in real Qwen/GPT-2 tokenizers."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator((seed_corpus or CORPUS) * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_model(vocab_size: int, *, seed: int, layers: int = 2, hidden: int = 64,
                context: int = 512) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        tie_word_embeddings=True,
        initializer_range=0.3,  # peaky distributions, so greedy and top-k behave like a real model
        eos_token_id=None,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config).eval()
    return model


def noisy_copy(model: Qwen2ForCausalLM, *, noise: float, seed: int) -> Qwen2ForCausalLM:
    """A draft that agrees with the target more or less often, depending on `noise`."""
    draft = Qwen2ForCausalLM(model.config).eval()
    draft.load_state_dict(model.state_dict())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=g) * noise * p.std().clamp_min(1e-3))
    return draft


def save_pair(root: Path, *, noise: float = 0.3, seed: int = 0, tokenizer=None, context: int = 512) -> tuple[Path, Path]:
    """Writes target/ and draft/ folders (config, safetensors, tokenizer) under `root`."""
    tok = tokenizer or build_tokenizer()
    target = build_model(len(tok), seed=seed, context=context)
    target.config.eos_token_id = tok.eos_token_id
    draft = noisy_copy(target, noise=noise, seed=seed + 1)
    paths = []
    for name, model in (("target", target), ("draft", draft)):
        folder = root / name
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        paths.append(folder)
    return paths[0], paths[1]


def write_tiny_gguf(path: Path, tok, model) -> Path:
    """Writes a float32 qwen2 GGUF of a tiny HF model with its byte-level BPE tokenizer."""
    import gguf
    import numpy as np

    cfg = model.config
    w = gguf.GGUFWriter(str(path), "qwen2")
    w.add_name("tiny-qwen2")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]))
    w.add_file_type(gguf.LlamaFileType.ALL_F32)
    backend = json.loads(tok.backend_tokenizer.to_str())
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = set(tok.all_special_tokens) | {a["content"] for a in backend["added_tokens"]}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]])
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    w.add_add_bos_token(False)
    w.add_chat_template(tok.chat_template)
    names = {
        "model.embed_tokens.weight": "token_embd.weight",
        "model.norm.weight": "output_norm.weight",
    }
    per_layer = {
        "input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
        "self_attn.q_proj.weight": "attn_q.weight", "self_attn.q_proj.bias": "attn_q.bias",
        "self_attn.k_proj.weight": "attn_k.weight", "self_attn.k_proj.bias": "attn_k.bias",
        "self_attn.v_proj.weight": "attn_v.weight", "self_attn.v_proj.bias": "attn_v.bias",
        "self_attn.o_proj.weight": "attn_output.weight", "mlp.gate_proj.weight": "ffn_gate.weight",
        "mlp.up_proj.weight": "ffn_up.weight", "mlp.down_proj.weight": "ffn_down.weight",
    }
    for i in range(cfg.num_hidden_layers):
        for hf, gg in per_layer.items():
            names[f"model.layers.{i}.{hf}"] = f"blk.{i}.{gg}"
    state = model.state_dict()
    for hf, gg in names.items():
        w.add_tensor(gg, state[hf].detach().float().numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def save_predictable_target(folder: Path, *, seed: int = 0, context: float = 0.01, tokenizer=None) -> Path:
    """A target whose next token depends mostly on the current one, for draft-head tests.

    A random transformer's next token hinges on its whole context, so a small head trained for
    seconds agrees with it by chance only. Here the attention and MLP outputs are scaled by
    `context` and the output head is untied and peaky: the next token is a random function of
    the current one, nudged by the context; a head trained for ~150 steps then agrees with it
    about half the time (accepted and rejected drafts both occur, as with a real head).
    """
    tok = tokenizer or build_tokenizer()
    base = build_model(len(tok), seed=seed, layers=4)
    config = base.config
    config.tie_word_embeddings = False
    config.eos_token_id = tok.eos_token_id
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(context)
            layer.mlp.down_proj.weight.mul_(context)
        model.lm_head.weight.mul_(4.0)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


if __name__ == "__main__":
    # A pair for trying GPU scripts on the CPU first: python -m tests.tiny /tmp/tiny [context]
    import sys

    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/tiny")
    print(*save_pair(folder, noise=0.02, context=int(sys.argv[2]) if len(sys.argv) > 2 else 4096))
