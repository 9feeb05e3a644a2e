"""The Triton kernel behind 8-bit weights on CUDA: y = (x @ q.T) * scale for a few rows, dequantized in registers.

A forward of decoding has 1 to K+1 rows, so the matmul is bound by reading the weight: the kernel
loads 8-bit tiles [BN, BK], widens them to x's dtype (exact: int8 and e4m3 values are bf16 values)
and accumulates x [16, BK] @ tile.T on the tensor cores in float32. A layer with few output
columns and a long input (the MLP's down projection) splits K over programs (split-K) so enough
of them stream at once; their partial sums meet in a float32 buffer by atomic adds.
Without Triton (or on a CPU) `runs` is False and the caller dequantizes instead.
"""
from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the dequantizing path serves
    triton = None
    tl = None

AVAILABLE = triton is not None
MAX_ROWS = 16  # rows one tile holds (tl.dot's smallest M); wider inputs dequantize and use cuBLAS
TARGET_PROGRAMS = 264  # about two waves of an H200's 132 SMs: enough loads in flight to stream
BLOCK_K = 256
STAGES = 3  # software pipelining depth; 3 x (BN x BK + 16 x BK x 2) bytes fits Ada's 100 KB too


def runs(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether the kernel takes this call (CUDA, bf16/fp16 activations, at most MAX_ROWS rows)."""
    return (AVAILABLE and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2
            and x.shape[0] <= MAX_ROWS and q.dtype in (torch.int8, torch.float8_e4m3fn))


def config(n: int, k: int) -> tuple[int, int]:
    """(BN, split) for an [n, k] weight: wide tiles for wide layers, split-K until programs fill the GPU."""
    bn = 64 if n >= 8192 else 32
    blocks = -(-n // bn)
    split = 1
    while blocks * split < TARGET_PROGRAMS and k // (split * 2) >= 2 * BLOCK_K:
        split *= 2
    return bn, split


if AVAILABLE:
    @triton.jit
    def _wo_kernel(x_ptr, w_ptr, s_ptr, y_ptr, M, N, K, k_per_split,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr, SPLIT: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        on = pid_n * BN + tl.arange(0, BN)  # [BN] output columns
        om = tl.arange(0, BM)  # [BM] rows (M of them real)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_lo = pid_k * k_per_split
        for k0 in range(k_lo, k_lo + k_per_split, BK):
            ok = k0 + tl.arange(0, BK)
            x = tl.load(x_ptr + om[:, None] * K + ok[None, :], mask=(om[:, None] < M) & (ok[None, :] < K), other=0.0)
            w = tl.load(w_ptr + on[:, None] * K + ok[None, :], mask=(on[:, None] < N) & (ok[None, :] < K), other=0)
            if FP8:
                w = w.to(tl.float8e4nv, bitcast=True)  # loaded as bytes: a zero byte is +0.0
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))  # [BM, BN]
        s = tl.load(s_ptr + on, mask=on < N, other=0.0)
        acc = acc * s[None, :]  # per column, so split-K partials can be scaled before they meet
        y = y_ptr + om[:, None] * N + on[None, :]
        mask = (om[:, None] < M) & (on[None, :] < N)
        if SPLIT == 1:
            tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:
            tl.atomic_add(y, acc, mask=mask)


def matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] bf16/fp16 contiguous, q [N, K] int8/e4m3, scale [N] float32 -> [M, N] in x's dtype."""
    m, k = x.shape
    n = q.shape[0]
    bn, split = config(n, k)
    fp8 = q.dtype == torch.float8_e4m3fn
    weight = q.view(torch.uint8) if fp8 else q
    k_per_split = -(-(-(-k // split)) // BLOCK_K) * BLOCK_K  # K / split rounded up to whole tiles
    out = torch.empty(m, n, dtype=x.dtype, device=x.device) if split == 1 else \
        torch.zeros(m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, bn), split)
    with torch.cuda.device(x.device):  # Triton launches on the current device; a split model spans several
        _wo_kernel[grid](x, weight, scale, out, m, n, k, k_per_split, BM=MAX_ROWS, BN=bn, BK=BLOCK_K, FP8=fp8,
                         SPLIT=split, num_warps=4, num_stages=STAGES)
    return out if split == 1 else out.to(x.dtype)
