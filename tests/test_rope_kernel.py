"""The one-launch RoPE + cache write (engine/runners/rope_kernel.py) gives the torch ops' bits.

On a GPU the whole lean forward is compared with the kernel and without it (logits and caches equal
bit for bit, chains and trees, Qwen2 and Qwen3's q/k norms). Without a GPU the kernel's indexing
runs in Triton's interpreter when Triton is installed.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.runners import rope_kernel
from engine.runners.lean import LeanDecoder
from engine.runners.tree import Tree
from tests.test_qwen3 import tiny_qwen3
from tests.tiny import build_model

ROOT = Path(__file__).resolve().parents[1]
INTERPRETED = """
import torch
from engine.runners import rope_kernel as rk
torch.manual_seed(0)
for dtype in (torch.float32, torch.float16, torch.bfloat16):
    for W, Hq, Hkv, D in ((1, 4, 2, 16), (6, 6, 2, 32), (3, 4, 4, 24)):
        L = 40
        qkv = torch.randn(W, (Hq + 2 * Hkv) * D + 8).to(dtype)[:, :(Hq + 2 * Hkv) * D]  # strided rows
        qk, v = qkv[:, :(Hq + Hkv) * D].unflatten(1, (Hq + Hkv, D)), qkv[:, (Hq + Hkv) * D:].unflatten(1, (Hkv, D))
        cos, sin = torch.randn(L, D).to(dtype), torch.randn(L, D).to(dtype)
        pos, slots = torch.tensor([5, 9, 2, 7, 7, 30][:W]), torch.tensor([11, 12, 13, 14, 15, 16][:W])
        kv, ref = torch.zeros(2, 2, Hkv, L, D, dtype=dtype), torch.zeros(2, 2, Hkv, L, D, dtype=dtype)
        q = rk.rope_and_write(qk, v, cos, sin, pos, slots, kv[1, 0][None], kv[1, 1][None], Hq)
        r = qk * cos[pos][:, None] + torch.roll(qk, D // 2, dims=-1) * sin[pos][:, None]
        ref[1, 0][None].index_copy_(2, slots, r[:, Hq:].transpose(0, 1)[None])
        ref[1, 1][None].index_copy_(2, slots, v.transpose(0, 1)[None])
        assert torch.equal(q, r[:, :Hq].transpose(0, 1).reshape(1, Hkv, (Hq // Hkv) * W, D)), (dtype, W)
        assert torch.equal(kv, ref), (dtype, W)
    # The batched form: B rows of W tokens, each into its own cache row (the first B, or the rows named).
    for B, W, Hq, Hkv, D, rows in ((3, 2, 4, 2, 16, None), (2, 5, 6, 2, 32, [3, 1]), (1, 1, 4, 4, 24, [2])):
        L, R = 40, 4
        qkv = torch.randn(B, W, (Hq + 2 * Hkv) * D + 8).to(dtype)[..., :(Hq + 2 * Hkv) * D]
        qk = qkv[..., :(Hq + Hkv) * D].unflatten(-1, (Hq + Hkv, D))
        v = qkv[..., (Hq + Hkv) * D:].unflatten(-1, (Hkv, D))
        cos, sin = torch.randn(L, D).to(dtype), torch.randn(L, D).to(dtype)
        pos = torch.tensor([[7 * b + 3 + w for w in range(W)] for b in range(B)])
        kv, ref = torch.zeros(2, 2, R, Hkv, L, D, dtype=dtype), torch.zeros(2, 2, R, Hkv, L, D, dtype=dtype)
        which = torch.tensor(rows) if rows is not None else None
        q = rk.rope_and_write_rows(qk, v, cos, sin, pos, kv[1, 0], kv[1, 1], which, Hq)
        r = qk * cos[pos][:, :, None] + torch.roll(qk, D // 2, dims=-1) * sin[pos][:, :, None]
        where = (torch.arange(B) if rows is None else which)[:, None].expand(B, W)
        ref[1, 0][where, :, pos] = r[:, :, Hq:]
        ref[1, 1][where, :, pos] = v
        assert torch.equal(q, r[:, :, :Hq].permute(0, 2, 1, 3).reshape(B, Hkv, (Hq // Hkv) * W, D)), (dtype, B, W)
        assert torch.equal(kv, ref), (dtype, B, W)
print("ok")
"""


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="Triton is not installed")
def test_kernel_indexing_in_the_interpreter():
    env = {**os.environ, "TRITON_INTERPRET": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-c", INTERPRETED], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "ok" in done.stdout, done.stderr[-2000:]


def test_off_cuda_the_torch_ops_run():
    assert not rope_kernel.runs(torch.zeros(2, 8)), "a CPU forward uses torch's ops"


def _both_ways(model, monkeypatch, feed):
    """feed(decoder) -> tensors, once with the kernel and once with torch's ops."""
    out = []
    for fused in (True, False):
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(rope_kernel, "runs", lambda x: False)
            decoder = LeanDecoder(model, 128, share_weights=False)
            out.append(feed(decoder) + [decoder.stages[0].kv.clone()])
    return out


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_cuda_forward_is_bit_identical_with_and_without_the_kernel(family, monkeypatch):
    model = (build_model(320, seed=3) if family == "qwen2" else tiny_qwen3(320, seed=3)).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 300, (40,), device="cuda")
    parents = [-1, 0, 0, 1, 1, 2]  # a tree under the last committed token
    depth = torch.tensor([0, 1, 1, 2, 2, 2], device="cuda")
    ancestors = torch.zeros(6, 6, dtype=torch.bool, device="cuda")
    for i, p in enumerate(parents):
        ancestors[i, i] = True
        if p >= 0:
            ancestors[i] |= ancestors[p]

    def feed(decoder):
        start = torch.zeros((), dtype=torch.long, device="cuda")
        got = [decoder.forward(ids[:30], start, logits=True).clone()]  # a prompt-wide forward
        for width in (1, 5):  # a decode step and a chain verify
            start += 30 if width == 1 else 1
            got.append(decoder.forward(ids[30:30 + width], start).clone())
        start += 5
        got.append(decoder.forward(ids[:6], start, tree=Tree(depth, ancestors)).clone())
        return got

    with_kernel, without = _both_ways(model, monkeypatch, feed)
    assert rope_kernel.AVAILABLE, "a CUDA machine of this project has Triton (torch's CUDA wheels bring it)"
    for a, b in zip(with_kernel, without):
        assert torch.equal(a, b)


@pytest.mark.gpu
def test_cuda_batched_rows_are_bit_identical_with_and_without_the_kernel(monkeypatch):
    from engine.runners.batched import BatchedDecoder

    model = build_model(320, seed=3).to("cuda", torch.bfloat16)
    ids = torch.randint(0, 300, (4, 6), device="cuda")
    out = []
    for fused in (True, False):
        with monkeypatch.context() as m:
            if not fused:
                m.setattr(rope_kernel, "runs", lambda x: False)
            decoder = BatchedDecoder(model, 128, 4)
            got = [decoder.forward_rows(ids, [0, 3, 7, 1], kv_len=64, every=True).clone(),  # the first rows
                   decoder.forward_rows(ids[:2, :3], [6, 9], slots=[3, 1], kv_len=64, every=True).clone()]
            out.append(got + [decoder.kv.clone()])
    for a, b in zip(*out):
        assert torch.equal(a, b)
