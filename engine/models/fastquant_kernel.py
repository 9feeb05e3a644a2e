"""The Triton kernel behind 8-bit weights on CUDA: y = (x @ q.T) * scale (+ bias) (+ residual) for a few rows.

A forward of decoding has 1 to K+1 rows (16 in a tree), so the matmul is bound by reading the
weight: the kernel loads 8-bit tiles [BN, BK], widens them to x's dtype in registers and accumulates
x [16, BK] @ tile.T on the tensor cores in float32. Up to MAX_ROWS rows (a short prompt, a wide
tree) it runs in row tiles of 16, the programs of one weight tile launched side by side so that
their re-reads of it can hit L2 (not timed beyond 16 rows). int8 widens by conversion. e4m3 widens one of
three ways (WIDENS; the fastest per GPU is in the tuned table, `bench/int8_kernel_sweep.py
--widens` times them): "bits" moves each byte into a bf16 (or fp16) word with integer ops — sign to
the top, exponent and mantissa under it — which is the value times 2^-120 (2^-8 in fp16), exact for
every e4m3 number, the 2^120 riding in the scale; "asm" lays out the same bits in PTX, four bytes
at a time; "convert" uses the GPU's own e4m3 conversion.
The epilogue adds the bias and the residual stream in float32 and rounds once, as cuBLAS's
addmm does for bf16 weights, so no separate add kernels run.

Beside it, two one-launch kernels for what a layer does before its matmuls, used by the lean
forward on CUDA for every precision: the RMSNorm (torch runs it as four kernels: cast, norm, cast,
scale) and silu(gate) * up (two); bench/int8_kernel_sweep.py --prologues times both ways. Fused
into the 8-bit kernel's prologue instead, they made it slower than the launches they saved (on an
H200, one row: the 14B gate/up step took 78 us with the norm inside against 43 for the norm kernel
then the matmul, down 96 us against 25: the per-step work on the row tile stalls the weight stream).

A layer with few output columns and a long input (the MLP's down projection, o, q/k/v on wide
models) splits K over programs (split-K) so enough of them stream at once: each writes its float32
partial sum to its own slice of a [split, M, N] buffer and a second small kernel sums the slices
with the epilogue — no zero-fill, no atomics, the same sum in the same order every time.

Tile shapes: tuned per GPU and layer shape by bench/int8_kernel_sweep.py into
fastquant_tuned.json (the sweep times this kernel, L2-cold, inside CUDA graphs); shapes or GPUs
without an entry use `heuristic`. Without Triton (or on a CPU) `runs` is False and the caller
dequantizes instead.
"""
from __future__ import annotations

import contextlib
import functools
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the dequantizing path serves
    triton = None
    tl = None

log = logging.getLogger(__name__)
AVAILABLE = triton is not None
TILE_ROWS = 16  # rows one program holds (tl.dot's smallest M)
MAX_ROWS = 64  # rows the kernel takes (in tiles of TILE_ROWS); wider inputs dequantize and use cuBLAS
TARGET_PROGRAMS = 264  # about two waves of an H200's 132 SMs: enough loads in flight to stream
TUNED_FILE = Path(__file__).with_name("fastquant_tuned.json")
# e4m3's bits moved into a 16-bit float are its value times 2^-(bias difference): bf16 127 - 7, fp16 15 - 7
FP8_UNSCALE = {torch.bfloat16: 2.0 ** 120, torch.float16: 2.0 ** 8}
REDUCE_BN = 256
WIDENS = ("bits", "convert", "asm")  # ways to widen e4m3 tiles in the kernel (see _widen)


@dataclass(frozen=True)
class Tile:
    bn: int  # output columns per program
    bk: int  # input depth per step
    split: int  # programs along K (1: no split)
    warps: int = 4
    stages: int = 3  # software pipelining depth; 3 x (BN x BK + 16 x BK x 2) bytes fits Ada's 100 KB too

    def key(self) -> list[int]:
        return [self.bn, self.bk, self.split, self.warps, self.stages]


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_bucket(m: int) -> int:
    """Rows are tuned in three bands: a standard step (1), a chain verify (2-8), a tree (9-16)."""
    return 1 if m <= 1 else 8 if m <= 8 else 16


def heuristic(n: int, k: int) -> Tile:
    """A tile for a shape nobody tuned: wide tiles for wide layers, split-K until programs fill the GPU."""
    bn = 64 if n >= 4096 else 32
    bk = 128 if k >= 4096 or k % 256 else 256
    blocks = _cdiv(n, bn)
    split = 1
    while blocks * split < TARGET_PROGRAMS and k // (split * 2) >= 4 * bk:
        split *= 2
    return Tile(bn, bk, split)


@functools.lru_cache(maxsize=8)
def _tuned_for(gpu: str) -> dict[str, Tile]:
    """This GPU's tuned tiles; an unreadable or damaged table is no table (the heuristic serves)."""
    try:
        table = json.loads(TUNED_FILE.read_text()).get(gpu, {})
        return {key: Tile(*map(int, value)) for key, value in table.get("tiles", {}).items()}
    except (OSError, ValueError, TypeError, AttributeError) as exc:
        log.warning("ignoring the 8-bit kernel's tuned tiles (%s): %s", TUNED_FILE.name, exc)
        return {}


def tile_key(n: int, k: int, m: int) -> str:
    return f"{n}x{k}/m{row_bucket(m)}"


@functools.lru_cache(maxsize=64)
def _tile_for(n: int, k: int, bucket: int, gpu: str) -> Tile:
    return _tuned_for(gpu).get(tile_key(n, k, bucket)) or heuristic(n, k)


@functools.lru_cache(maxsize=16)
def _gpu_name(device: torch.device) -> str:
    """The name the tuned table files this device under ("" off CUDA), asked once per device."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else ""


def tile_for(n: int, k: int, m: int, device: torch.device) -> Tile:
    """The tuned tile of this GPU for an [n, k] weight and m rows, else the heuristic's (looked up once)."""
    return _tile_for(n, k, row_bucket(m), _gpu_name(device))


def widen_for(device: torch.device) -> str:
    """This GPU's fastest way to widen e4m3 tiles (the sweep's `--widens` writes it), else "bits"."""
    return _widen_for(_gpu_name(device))


@functools.lru_cache(maxsize=8)
def _widen_for(gpu: str) -> str:
    try:
        way = json.loads(TUNED_FILE.read_text()).get(gpu, {}).get("fp8_widen", "bits")
    except (OSError, ValueError, TypeError, AttributeError):
        return "bits"
    return way if way in WIDENS else "bits"


def usable_widen(way: str, x: torch.Tensor) -> str:
    """`way` where it can run: the PTX way needs CUDA (not the interpreter) and bf16."""
    if way not in WIDENS:
        raise ValueError(f"widen must be one of {', '.join(WIDENS)}, not {way!r}")
    if way == "asm" and (not x.is_cuda or x.dtype != torch.bfloat16):
        return "bits"
    return way


def runs(x: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether the kernel takes this call (CUDA, bf16/fp16 activations, at most MAX_ROWS rows)."""
    return (AVAILABLE and x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() == 2
            and x.shape[0] <= MAX_ROWS and q.dtype in (torch.int8, torch.float8_e4m3fn))


if AVAILABLE:
    @triton.jit
    def _widen(w, dtype: tl.constexpr, FP8: tl.constexpr, WIDEN: tl.constexpr):
        """An 8-bit tile [BN, BK] -> x's dtype: int8 converted; e4m3 bytes (as uint8) by the WIDEN way.

        0 ("bits"): each byte re-laid as a 16-bit float by integer ops, its value times 2^-120 (bf16)
        or 2^-8 (fp16); 1 ("convert"): the GPU's own e4m3 conversion, the value itself; 2 ("asm", bf16
        on CUDA only): the re-laying of "bits" as PTX on four bytes at once (two byte permutes, then a
        mask, a shift and a merge per pair of weights).
        """
        if FP8:
            if WIDEN == 1:
                return w.to(tl.float8e4nv, bitcast=True).to(dtype)
            if WIDEN == 2:
                return tl.inline_asm_elementwise(
                    asm="""{
                    .reg .b32 lo, hi, mlo, mhi;
                    prmt.b32 lo, $2, 0, 0x1404;
                    prmt.b32 hi, $2, 0, 0x3424;
                    and.b32 mlo, lo, 0x7f007f00;
                    and.b32 mhi, hi, 0x7f007f00;
                    shr.b32 mlo, mlo, 4;
                    shr.b32 mhi, mhi, 4;
                    lop3.b32 $0, lo, mlo, 0x80008000, 0xec;
                    lop3.b32 $1, hi, mhi, 0x80008000, 0xec;
                    }""",
                    constraints="=r,=r,r", args=[w], dtype=tl.bfloat16, is_pure=True, pack=4)
            b = w.to(tl.int32)
            if dtype == tl.bfloat16:
                bits = ((b & 0x80) << 8) | ((b & 0x7F) << 4)  # s eeee mmm -> s 0000eeee mmm0000
            else:
                bits = ((b & 0x80) << 8) | ((b & 0x7F) << 7)  # s eeee mmm -> s 0eeee mmm0000000
            return bits.to(tl.int16).to(dtype, bitcast=True)  # the low 16 bits, as they are
        return w.to(dtype)

    @triton.jit
    def _wo_kernel(x_ptr, w_ptr, s_ptr, b_ptr, r_ptr, y_ptr, M, N, K, k_per_split,
                   BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, FP8: tl.constexpr, SPLIT: tl.constexpr,
                   HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr, EVEN_K: tl.constexpr, UNSCALE: tl.constexpr,
                   WIDEN: tl.constexpr):
        # row tiles vary fastest: the programs reading one weight tile are launched side by side
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        on = pid_n * BN + tl.arange(0, BN)  # [BN] output columns
        om = pid_m * BM + tl.arange(0, BM)  # [BM] rows (those < M real)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        k_lo = pid_k * k_per_split
        for k0 in range(k_lo, k_lo + k_per_split, BK):
            ok = k0 + tl.arange(0, BK)
            if EVEN_K:  # every tile whole: only the row and column edges are masked
                x = tl.load(x_ptr + om[:, None] * K + ok[None, :], mask=om[:, None] < M, other=0.0)
                w = tl.load(w_ptr + on[:, None] * K + ok[None, :], mask=on[:, None] < N, other=0)
            else:
                x = tl.load(x_ptr + om[:, None] * K + ok[None, :], mask=(om[:, None] < M) & (ok[None, :] < K),
                            other=0.0)
                w = tl.load(w_ptr + on[:, None] * K + ok[None, :], mask=(on[:, None] < N) & (ok[None, :] < K),
                            other=0)
            acc += tl.dot(x, tl.trans(_widen(w, x.dtype, FP8, WIDEN)))  # [BM, BN]
        s = tl.load(s_ptr + on, mask=on < N, other=0.0)
        acc = acc * (s * UNSCALE)[None, :]  # per column, so split-K partials are scaled before they meet
        mask = (om[:, None] < M) & (on[None, :] < N)
        if SPLIT == 1:
            if HAS_BIAS:
                acc += tl.load(b_ptr + on, mask=on < N, other=0.0).to(tl.float32)[None, :]
            if HAS_RES:
                acc += tl.load(r_ptr + om[:, None] * N + on[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(y_ptr + om[:, None] * N + on[None, :], acc.to(y_ptr.dtype.element_ty), mask=mask)
        else:  # this program's partial sum: its own slice of the [SPLIT, M, N] float32 buffer
            tl.store(y_ptr + pid_k * M * N + om[:, None] * N + on[None, :], acc, mask=mask)

    @triton.jit
    def _reduce_kernel(p_ptr, b_ptr, r_ptr, y_ptr, M, N, SPLIT: tl.constexpr, BN: tl.constexpr,
                       HAS_BIAS: tl.constexpr, HAS_RES: tl.constexpr):
        row = tl.program_id(0)
        on = tl.program_id(1) * BN + tl.arange(0, BN)
        live = on < N
        acc = tl.zeros((BN,), dtype=tl.float32)
        for s in range(SPLIT):  # in order: the same rounding every run
            acc += tl.load(p_ptr + s * M * N + row * N + on, mask=live, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + on, mask=live, other=0.0).to(tl.float32)
        if HAS_RES:
            acc += tl.load(r_ptr + row * N + on, mask=live, other=0.0).to(tl.float32)
        tl.store(y_ptr + row * N + on, acc.to(y_ptr.dtype.element_ty), mask=live)


    @triton.jit
    def _rms_norm_kernel(x_ptr, g_ptr, y_ptr, K, eps, BLOCK: tl.constexpr):
        """One row per program: y = g * bf16(x * rsqrt(mean(x^2) + eps)), as HF's RMSNorm rounds."""
        row = tl.program_id(0)
        ok = tl.arange(0, BLOCK)
        live = ok < K
        x = tl.load(x_ptr + row * K + ok, mask=live, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(x * x, axis=0) / K + eps)
        h = (x * r).to(y_ptr.dtype.element_ty)
        g = tl.load(g_ptr + ok, mask=live, other=0.0)
        tl.store(y_ptr + row * K + ok, (h.to(tl.float32) * g.to(tl.float32)).to(y_ptr.dtype.element_ty), mask=live)

    @triton.jit
    def _silu_mul_kernel(x_ptr, y_ptr, K, BLOCK: tl.constexpr):
        """[M, 2K] = [gate | up] -> silu(gate) * up [M, K], rounded as the two torch ops round."""
        row = tl.program_id(0)
        ok = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        live = ok < K
        gate = tl.load(x_ptr + row * 2 * K + ok, mask=live, other=0.0).to(tl.float32)
        up = tl.load(x_ptr + row * 2 * K + K + ok, mask=live, other=0.0)
        act = (gate * tl.sigmoid(gate)).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + row * K + ok, (act.to(tl.float32) * up.to(tl.float32)).to(y_ptr.dtype.element_ty),
                 mask=live)


def rms_norm(x: torch.Tensor, g: torch.Tensor, eps: float) -> torch.Tensor:
    """x [M, K] contiguous bf16/fp16, g [K] -> RMSNorm(x) * g in one launch."""
    m, k = x.shape
    out = torch.empty_like(x)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _rms_norm_kernel[(m,)](x, g, out, k, float(eps), BLOCK=triton.next_power_of_2(k), num_warps=8)
    return out


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [M, 2K] contiguous = [gate | up] -> silu(gate) * up [M, K] in one launch."""
    m, k2 = x.shape
    k = k2 // 2
    out = torch.empty(m, k, dtype=x.dtype, device=x.device)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _silu_mul_kernel[(m, _cdiv(k, 1024))](x, out, k, BLOCK=1024, num_warps=4)
    return out


def matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
           residual: torch.Tensor | None = None, tile: Tile | None = None, widen: str | None = None) -> torch.Tensor:
    """x [M <= MAX_ROWS, K] bf16/fp16 contiguous, q [N, K] int8/e4m3, scale [N] float32 -> [M, N] in x's dtype.

    bias [N] and residual [M, N] (contiguous) are added in float32 before the one rounding.
    widen: how e4m3 tiles become x's dtype (WIDENS; default: this GPU's tuned way, else "bits").
    """
    m, k = x.shape
    n = q.shape[0]
    tile = tile or tile_for(n, k, m, x.device)
    fp8 = q.dtype == torch.float8_e4m3fn
    weight = q.view(torch.uint8) if fp8 else q
    way = usable_widen(widen or widen_for(x.device), x) if fp8 else "bits"
    # the 2^-120 (2^-8) of e4m3's re-laid bits, taken back; the GPU's own conversion gives the value
    unscale = FP8_UNSCALE[x.dtype] if fp8 and way != "convert" else 1.0
    split = tile.split
    k_per_split = _cdiv(_cdiv(k, split), tile.bk) * tile.bk  # K / split rounded up to whole tiles
    even_k = k % tile.bk == 0 and k_per_split * split == k
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    dummy = out  # an unused pointer where bias or residual is absent
    b, r = (bias if bias is not None else dummy), (residual if residual is not None else dummy)
    # split 1 writes y with the epilogue; split-K writes float32 partials the reduction sums into y
    partial = out if split == 1 else torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    # Triton launches on the current device; a split model spans several (a CPU: the interpreter's checks)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _wo_kernel[(_cdiv(m, TILE_ROWS), _cdiv(n, tile.bn), split)](
            x, weight, scale, b, r, partial, m, n, k, k_per_split, BM=TILE_ROWS, BN=tile.bn, BK=tile.bk, FP8=fp8,
            SPLIT=split, HAS_BIAS=split == 1 and bias is not None, HAS_RES=split == 1 and residual is not None,
            EVEN_K=even_k, UNSCALE=unscale, WIDEN=WIDENS.index(way), num_warps=tile.warps, num_stages=tile.stages)
        if split > 1:
            _reduce_kernel[(m, _cdiv(n, REDUCE_BN))](
                partial, b, r, out, m, n, SPLIT=split, BN=REDUCE_BN, HAS_BIAS=bias is not None,
                HAS_RES=residual is not None, num_warps=4)
    return out
