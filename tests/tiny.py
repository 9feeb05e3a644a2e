"""Tiny random models with a real byte-level BPE tokenizer, saved to disk, for fast CPU tests."""
from __future__ import annotations

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
                context: int = 512, tied: bool = True) -> Qwen2ForCausalLM:
    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=context,
        tie_word_embeddings=tied,
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
