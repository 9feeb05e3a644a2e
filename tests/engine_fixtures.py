"""Builds Engines on the tiny models without going through the model store."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.decoding import Engine
from engine.types import ModelInfo


def tiny_engine(target_dir: Path, draft_dir: Path, dtype: torch.dtype = torch.float32) -> Engine:
    tok = AutoTokenizer.from_pretrained(target_dir)
    target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval()
    info = ModelInfo(
        target_name="tiny-target", draft_name="tiny-draft", device="cpu",
        dtype=str(dtype).removeprefix("torch."), fast_path="eager", vocab_size=len(tok),
    )
    return Engine(target, tok, info, draft=draft)
