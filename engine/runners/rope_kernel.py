"""One launch per layer for what the lean forward does between the q/k/v matmul and attention.

Between `qkv = x @ Wqkv` and attention the lean forward rotates the query and key heads (RoPE:
x * cos + rotate_half(x) * sin), writes the rotated keys and the values into the static cache at
their slots and lays the queries out as [1, Hkv, G * W, D] for grouped attention. As torch ops that
is about eight small kernels a layer (two multiplies, a roll, an add, two `index_copy_`, the copies
of the transposes); on a GPU at batch 1 each costs a few microseconds whatever it moves — on a
48-layer 14B target they were 0.67 ms of a 9.8 ms forward (bench/results/h200_forward_profile_14b.json).
`rope_and_write` does all of it in one Triton kernel, one program per (row, head), rounding as the
torch ops round (each product to the activation dtype, then their sum), so its output is
bit-identical to the torch path's.

Used by engine/runners/lean.py on CUDA outside torch.compile (inductor fuses the torch ops itself),
and in its batched form (`rope_and_write_rows`: every sequence's tokens into its own cache row) by the
batched forward (engine/runners/batched.py); without Triton, on a CPU or under compile the torch ops run.
"""
from __future__ import annotations

import contextlib

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the torch ops serve
    triton = None
    tl = None

AVAILABLE = triton is not None


def runs(x: torch.Tensor) -> bool:
    """Whether the kernel takes a forward whose activations are x (CUDA, no gradients, not compiling)."""
    return (AVAILABLE and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
            and not torch.compiler.is_compiling() and not (torch.is_grad_enabled() and x.requires_grad))


if AVAILABLE:
    @triton.jit
    def _bf16_rounded(v):
        """float32 -> the nearest bf16 value (ties to even), still float32: by integer ops, since the
        compiler may fold a float32 -> bf16 -> float32 round trip away (then nothing is rounded)."""
        b = v.to(tl.int32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & -65536  # -65536: the top 16 bits, 0xFFFF0000
        return b.to(tl.float32, bitcast=True)

    @triton.jit
    def _rope_write_kernel(qk_ptr, qk_row, v_ptr, v_row, cos_ptr, sin_ptr, pos_ptr, slot_ptr, row_ptr,
                           q_ptr, k_cache_ptr, v_cache_ptr, cache_head, cache_row, W,
                           HQ: tl.constexpr, HKV: tl.constexpr, D: tl.constexpr, BLOCK: tl.constexpr,
                           BF16: tl.constexpr, ROWS: tl.constexpr):
        """Program (f, h), f = b * W + w (token w of batch row b): query head h < HQ -> q; key head -> the k
        cache; value head -> the v cache as it is. Batch row b writes cache row row_ptr[b] (ROWS) or b."""
        f = tl.program_id(0)
        h = tl.program_id(1)
        b = f // W
        w = f % W
        d = tl.arange(0, BLOCK)
        live = d < D
        slot = tl.load(slot_ptr + f)
        row = tl.load(row_ptr + b) if ROWS else b
        base = row.to(tl.int64) * cache_row
        if h < HQ + HKV:
            pos = tl.load(pos_ptr + f)
            dt = q_ptr.dtype.element_ty
            x = tl.load(qk_ptr + f * qk_row + h * D + d, mask=live, other=0.0).to(tl.float32)
            # rotate_half as a roll by D/2; its sign is folded into the sin table (lean.py's _stage)
            r = tl.load(qk_ptr + f * qk_row + h * D + (d + D // 2) % D, mask=live, other=0.0).to(tl.float32)
            c = tl.load(cos_ptr + pos * D + d, mask=live, other=0.0).to(tl.float32)
            s = tl.load(sin_ptr + pos * D + d, mask=live, other=0.0).to(tl.float32)
            if BF16:  # each product rounded to bf16, then their sum, as torch's three ops round
                out = _bf16_rounded(_bf16_rounded(x * c) + _bf16_rounded(r * s)).to(dt)
            else:
                out = ((x * c).to(dt).to(tl.float32) + (r * s).to(dt).to(tl.float32)).to(dt)
            if h < HQ:  # query head h = kv * G + g goes to row g * W + w of its KV group: ((b * HQ + h) * W + w) * D
                tl.store(q_ptr + ((b * HQ + h) * W + w) * D + d, out, mask=live)
            else:
                tl.store(k_cache_ptr + base + (h - HQ) * cache_head + slot * D + d, out, mask=live)
        else:
            hv = h - HQ - HKV
            val = tl.load(v_ptr + f * v_row + hv * D + d, mask=live, other=0.0)
            tl.store(v_cache_ptr + base + hv * cache_head + slot * D + d, val, mask=live)


def rope_and_write(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                   slots: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, n_heads: int) -> torch.Tensor:
    """qk [W, Hq + Hkv, D] and v [W, Hkv, D] (rows may be strided, heads packed), cos/sin tables
    [cache_len, D], pos/slots [W] long, caches [1, Hkv, cache_len, D] (a slot's D values contiguous)
    -> queries [1, Hkv, G * W, D] rotated; rotated keys and the values written at `slots`."""
    return _launch(qk, v, cos, sin, pos, slots, None, k_cache, v_cache, n_heads, 1, qk.shape[0])


def rope_and_write_rows(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
                        k_cache: torch.Tensor, v_cache: torch.Tensor, rows: torch.Tensor | None,
                        n_heads: int) -> torch.Tensor:
    """The batched forward's form (engine/runners/batched.py: forward_rows): qk [B, W, Hq + Hkv, D] and
    v [B, W, Hkv, D] (each batch row's W rows evenly strided), pos [B, W] long (a row's cache slot is its
    position), caches [slots, Hkv, cache_len, D], rows [B] long: the cache row of each batch row (None: the
    first B) -> queries [B, Hkv, G * W, D] rotated; rotated keys and the values written in their rows."""
    b, w = qk.shape[:2]
    assert w == 1 or (qk.stride(0) == w * qk.stride(1) and v.stride(0) == w * v.stride(1)), "rows evenly strided"
    assert pos.is_contiguous() and pos.shape == (b, w)
    flat_pos = pos.view(-1)
    return _launch(qk.flatten(0, 1), v.flatten(0, 1), cos, sin, flat_pos, flat_pos, rows, k_cache, v_cache,
                   n_heads, b, w)


def _launch(qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, pos: torch.Tensor,
            slots: torch.Tensor, rows: torch.Tensor | None, k_cache: torch.Tensor, v_cache: torch.Tensor,
            n_heads: int, b: int, w: int) -> torch.Tensor:
    """qk [B*W, Hq + Hkv, D], v [B*W, Hkv, D], pos/slots [B*W], caches [R, Hkv, L, D] -> q [B, Hkv, G*W, D]."""
    n_qk, dim = qk.shape[1:]
    n_kv = v.shape[1]
    assert qk.stride(2) == 1 and qk.stride(1) == dim and v.stride(2) == 1 and v.stride(1) == dim
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(3) == 1 and k_cache.stride(2) == dim
    assert cos.is_contiguous() and sin.is_contiguous() and n_qk == n_heads + n_kv
    q = torch.empty(b, n_kv, (n_heads // n_kv) * w, dim, dtype=qk.dtype, device=qk.device)
    with torch.cuda.device(qk.device) if qk.is_cuda else contextlib.nullcontext():
        _rope_write_kernel[(b * w, n_heads + 2 * n_kv)](
            qk, qk.stride(0), v, v.stride(0), cos, sin, pos, slots, slots if rows is None else rows, q, k_cache,
            v_cache, k_cache.stride(1), k_cache.stride(0), w,
            HQ=n_heads, HKV=n_kv, D=dim, BLOCK=triton.next_power_of_2(dim), BF16=qk.dtype == torch.bfloat16,
            ROWS=rows is not None, num_warps=1)
    return q
