"""8-bit weights that decode at memory speed: weight-only int8 ("int8-wo") and FP8 e4m3 ("fp8").

Both keep one byte per weight and one float32 scale per output row (per-channel), quantized once
from the loaded float weights; a pre-quantized FP8 checkpoint is refused in one line before its weights
load (checkpoint_problem below, asked by engine/models/loader.py).
The matmul reads the 8-bit weight and dequantizes inside the kernel: on CUDA a small Triton GEMM
for the forwards of up to 64 rows (decoding, short prompts; engine/models/fastquant_kernel.py), so a
batch-1 forward streams half the bytes of bf16; wider forwards (long prompts' chunks) dequantize the
weight into the compute dtype and use cuBLAS. Measured on an H200 (torch 2.11): torch's own `_weight_int8pack_mm`
is 10-20x slower than bf16 there, a dequantize-then-matmul 3-6x, and inductor's fused dequant 2.6x
slower at batch 1 (docs/quantization.md has the figures behind these choices).

FP8 can also quantize the activations per forward (`torch._scaled_mm`, FP8 tensor cores):
FP8_ACTIVATIONS picks "none" (weight-only, the default), "tensor" (one dynamic scale per
activation tensor) or "token" (one per row, rowwise scaled mm); bench/fast_8bit_speed.py compares them.

Everything here is plain tensors and ops (the kernel is a custom op with a fake implementation),
so the lean forward's CUDA graphs and torch.compile take it as they take nn.Linear.

`rms_norm` and `silu_mul` are what every precision's lean forward runs before its matmuls: one
Triton launch each on CUDA (torch runs four and two kernels), torch's ops elsewhere.
"""
from __future__ import annotations

import logging
import os
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from engine.errors import ModelLoadError
from engine.models import fastquant_kernel as kernel
from engine.models.device import pick_device
from engine.settings import DEVICES

log = logging.getLogger(__name__)

FAST_PRECISIONS = ("int8-wo", "fp8")
INT8_MAX = 127.0  # symmetric: -127..127, so the scale maps the row's largest |w| to 127
FP8_MAX = 448.0  # largest finite float8_e4m3fn
FP8_DTYPE = torch.float8_e4m3fn
FP8_MIN_CAPABILITY = (8, 9)  # Ada and Hopper have FP8 tensor cores and conversions
SCALE_EPS = 1e-12  # an all-zero row keeps a tiny scale (its weights quantize to 0)
FP8_MODES = ("none", "tensor", "token")
# The FP8 activation mode (see the module note); an internal switch the GPU bench compares.
FP8_ACTIVATIONS = os.environ.get("SPECDEC_FP8_ACT", "none")


def storage_dtype(kind: str) -> torch.dtype:
    return torch.int8 if kind == "int8-wo" else FP8_DTYPE


# --------------------------------------------------------------------------- the maths

def quantize(weight: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] float -> (8-bit weight [N, K], float32 scale [N]) with weight ~= q * scale[:, None].

    int8: round to nearest of w / s, s = max|w_row| / 127 (error at most s / 2 per weight).
    fp8: w / s cast to e4m3 (round to nearest even), s = max|w_row| / 448 (relative error <= 2^-4).
    """
    assert weight.dim() == 2, f"a linear weight is [out, in], not {tuple(weight.shape)}"
    w = weight.detach().float()
    top = FP8_MAX if kind == "fp8" else INT8_MAX
    scale = (w.abs().amax(dim=1) / top).clamp(min=SCALE_EPS)  # [N]
    scaled = w / scale[:, None]
    if kind == "int8-wo":
        q = scaled.round_().clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    elif kind == "fp8":
        q = scaled.clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    else:
        raise ValueError(f"unknown 8-bit kind {kind!r}: use one of {FAST_PRECISIONS}")
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """(8-bit weight [N, K], scale [N]) -> float weight [N, K] in dtype (scaled in float32 first)."""
    return (q.float() * scale.float()[:, None]).to(dtype)


def dequant_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ dequantized(q).T -> [M, N] in x's dtype: the weight is cast whole, then one GEMM."""
    return F.linear(x, q.to(x.dtype)) * scale.to(x.dtype)


def _one_kernel(*tensors: torch.Tensor) -> bool:
    """Whether the one-launch norm / gate kernels take x (the first): CUDA rows of a forward without
    gradients (they have no backward), not under compile (inductor fuses torch's ops itself)."""
    x = tensors[0]
    return (kernel.AVAILABLE and x.is_cuda and x.dim() == 2 and x.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float16) and not torch.compiler.is_compiling()
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in tensors)))


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen2RMSNorm/LlamaRMSNorm: normalise in float32, cast back, then scale (one Triton kernel
    on CUDA for the lean forward's [W, hidden] rows; torch's ops elsewhere and under torch.compile)."""
    if _one_kernel(x, weight) and weight.dim() == 1 and weight.dtype == x.dtype and weight.is_contiguous():
        return kernel.rms_norm(x, weight, eps)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), eps=eps).to(x.dtype)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[W, 2I] = [gate | up] -> silu(gate) * up [W, I] (one Triton kernel on CUDA, as rms_norm)."""
    if _one_kernel(gate_up):
        return kernel.silu_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


@torch.library.custom_op("specdec::wo_matmul", mutates_args=())
def wo_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
              residual: torch.Tensor | None = None) -> torch.Tensor:
    """residual + x [M, K] (contiguous) times the 8-bit weight q [N, K] with row scales [N] + bias -> [M, N].

    CUDA, few rows, bf16/fp16: the Triton kernel (dequantizes in registers; bias and residual added
    in float32 in its epilogue, one rounding). Elsewhere: the weight dequantized to x's dtype, then
    one matmul (int8 on a CPU: torch's int8-weight kernel), then the adds.
    """
    if kernel.runs(x, q):
        return kernel.matmul(x, q, scale, bias, None if residual is None else residual.contiguous())
    if x.device.type == "cpu" and q.dtype == torch.int8 and x.dtype in (torch.float32, torch.bfloat16):
        out = torch._weight_int8pack_mm(x, q, scale.to(x.dtype))
    else:
        out = dequant_matmul(x, q, scale)
    if bias is not None:
        out = out + bias
    return out if residual is None else residual + out


@wo_matmul.register_fake
def _wo_matmul_fake(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None,
                    residual: torch.Tensor | None = None) -> torch.Tensor:
    return x.new_empty(x.shape[0], q.shape[0])


def fp8_act_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, mode: str) -> torch.Tensor:
    """FP8 x FP8 on the tensor cores: x [M, K] quantized here with a dynamic scale per tensor or per row."""
    if q.shape[0] % 16 or q.shape[1] % 16:  # _scaled_mm takes only sizes divisible by 16
        return dequant_matmul(x, q, scale)
    xf = x.float()
    if mode == "token":
        sx = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=SCALE_EPS)  # [M, 1]
        xq = (xf / sx).to(FP8_DTYPE)
        return torch._scaled_mm(xq, q.t(), scale_a=sx, scale_b=scale[None, :], out_dtype=x.dtype)
    sx = (xf.abs().amax() / FP8_MAX).clamp(min=SCALE_EPS)  # scalar
    xq = (xf / sx).to(FP8_DTYPE)
    one = torch.ones((), device=x.device, dtype=torch.float32)
    return torch._scaled_mm(xq, q.t(), scale_a=sx, scale_b=one, out_dtype=x.dtype) * scale.to(x.dtype)


# --------------------------------------------------------------------------- the module

class QuantLinear(nn.Module):
    """An nn.Linear's replacement holding 8-bit weights [N, K] and float32 row scales [N]."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, kind: str) -> None:
        super().__init__()
        assert q.dim() == 2 and scale.shape == (q.shape[0],), "one scale per output row"
        self.kind = kind
        self.out_features, self.in_features = q.shape
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale.float())
        self.register_buffer("bias", bias)

    @classmethod
    def from_linear(cls, linear: nn.Linear, kind: str, device: torch.device | None = None,
                    block: int = 8192) -> QuantLinear:
        """Quantizes `linear` where its weight is, or on `device` `block` rows at a time (per-row scales make
        the blocks exact), so neither the float weight nor its float32 copies sit whole there."""
        weight = linear.weight.detach()
        with torch.no_grad():
            if device is None:
                q, scale = quantize(weight, kind)
            else:
                n = weight.shape[0]
                q = torch.empty(weight.shape, dtype=storage_dtype(kind), device=device)
                scale = torch.empty(n, dtype=torch.float32, device=device)
                for i in range(0, n, block):
                    q[i:i + block], scale[i:i + block] = quantize(weight[i:i + block].to(device), kind)
            bias = None if linear.bias is None else linear.bias.detach().clone().to(q.device)
        return cls(q, scale, bias, kind)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x [..., K] -> [..., N]; with `residual` [..., N], residual + the layer (fused on CUDA)."""
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()  # [M, K]
        mode = FP8_ACTIVATIONS if self.kind == "fp8" and x.is_cuda else "none"
        if mode in ("tensor", "token") and x2.shape[0] <= kernel.MAX_ROWS:
            out = fp8_act_matmul(x2, self.qweight, self.scale, mode)
            if self.bias is not None:
                out = out + self.bias
            out = out.view(*shape[:-1], self.out_features)
            return out if residual is None else residual + out
        res2 = None if residual is None else residual.reshape(-1, self.out_features)
        out = wo_matmul(x2, self.qweight, self.scale, self.bias, res2)
        return out.view(*shape[:-1], self.out_features)

    def weight_float(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dequantized weight (what the maths is tested against)."""
        return dequantize(self.qweight, self.scale, dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features} -> {self.out_features}, {self.kind}, bias={self.bias is not None}"


def fusable(modules: list[nn.Module]) -> bool:
    """Several QuantLinears of one kind reading one input (q/k/v, gate/up): one matmul instead of several."""
    kinds = {getattr(m, "kind", None) for m in modules}
    return all(isinstance(m, QuantLinear) for m in modules) and len(kinds) == 1


def fuse(modules: list[QuantLinear]) -> QuantLinear:
    """One QuantLinear over the rows of all; the originals are re-pointed at its slices (nothing held twice)."""
    if len(modules) == 1:
        return modules[0]
    with torch.no_grad():
        q = torch.cat([m.qweight for m in modules])
        scale = torch.cat([m.scale for m in modules])
        bias = None
        if any(m.bias is not None for m in modules):
            bias = torch.cat([m.bias if m.bias is not None else q.new_zeros(m.out_features, dtype=_bias_dtype(modules))
                              for m in modules])
        row = 0
        for m in modules:
            n = m.out_features
            m.qweight, m.scale = q[row:row + n], scale[row:row + n]
            if m.bias is not None:
                m.bias = bias[row:row + n]
            row += n
    return QuantLinear(q, scale, bias, modules[0].kind)


def _bias_dtype(modules: list[QuantLinear]) -> torch.dtype:
    return next(m.bias.dtype for m in modules if m.bias is not None)


# --------------------------------------------------------------------------- models

def quantize_model(model: nn.Module, kind: str, device: torch.device | None = None, head: bool | None = None) -> int:
    """Replaces every nn.Linear inside the decoder layers by a QuantLinear, layer by layer; returns how many.

    The embedding stays in the float dtype. An untied output head is quantized too where it will sit on
    a GPU (`head` None) or when `head` says so: at batch 1 it is the largest matrix a forward reads
    (1.56 GB of a 14B target's bf16 weights), and the kernel streams it at half the bytes; llama.cpp and
    gpt-fast quantize it as well. A tied head stays float: it is also the embedding.
    Each float weight is released as soon as its replacement exists. With `device` (a model loaded
    in host memory), each decoder layer moves there in float, is quantized there, and only then
    does the next one move; the output head is quantized there a block of rows at a time; the rest of
    the model follows at the end — so the device never holds more than the 8-bit model and one float
    layer (loading the float model there first would need the float model's memory: 28 GB for a 14B
    target the plan gives 15).
    """
    count = 0
    for layer in model.model.layers:
        if device is not None:
            layer.to(device)
        for name, module in list(layer.named_modules()):
            if type(module) is not nn.Linear:
                continue
            parent_name, _, child = name.rpartition(".")
            parent = layer.get_submodule(parent_name) if parent_name else layer
            setattr(parent, child, QuantLinear.from_linear(module, kind))
            del module
            count += 1
    out = model.get_output_embeddings()
    if head is None:
        head = (device if device is not None else getattr(out, "weight", torch.empty(0)).device).type == "cuda"
    if head and untied_head(model):
        # in blocks of rows even where it already is: its float32 copies whole would be 6 GB for a 14B target
        model.set_output_embeddings(QuantLinear.from_linear(out, kind, device=device or out.weight.device))
        del out
        count += 1
    if device is not None:
        model.to(device)  # the embedding, norms, a tied output head and RoPE buffers
    log.info("quantized %d linear layers to %s", count, kind)
    return count


def untied_head(model: nn.Module) -> bool:
    """Whether the output head is a plain float nn.Linear of its own (not the embedding's weight)."""
    out, embed = model.get_output_embeddings(), model.get_input_embeddings()
    return (type(out) is nn.Linear and out.weight.is_floating_point()
            and out.weight is not getattr(embed, "weight", None)
            and not getattr(model.config, "tie_word_embeddings", False))


def head_rows(module: nn.Module, rows: torch.Tensor, dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight rows [len(rows), K], bias rows or None) of an output head, float or 8-bit, in `dtype`
    (default: the float weight's own, or bfloat16's for an 8-bit one): what a draft head gathers."""
    bias = getattr(module, "bias", None)
    if isinstance(module, QuantLinear):
        rows = rows.to(module.qweight.device)
        weight = dequantize(module.qweight.index_select(0, rows), module.scale.index_select(0, rows),
                            dtype or torch.bfloat16)
    else:
        weight = getattr(module, "weight", None)
        if weight is None:
            raise ValueError("the target's output head has no plain weight (packed already?): bind the head first")
        rows = rows.to(weight.device)
        weight = weight.detach().index_select(0, rows).to(dtype or weight.dtype)
    bias = None if bias is None else bias.detach().index_select(0, rows).to(dtype or bias.dtype)
    return weight.contiguous(), None if bias is None else bias.contiguous()


def model_kind(model: nn.Module) -> str | None:
    """'int8-wo' or 'fp8' when a model holds QuantLinears; None otherwise."""
    return next((m.kind for m in model.modules() if isinstance(m, QuantLinear)), None)


def checkpoint_problem(config: dict) -> str | None:
    """Why a pre-quantized FP8 checkpoint (compressed-tensors / quantization_config) does not load here, or None.

    Such folders (weight float8_e4m3fn + weight_scale, as vLLM reads them) need transformers'
    compressed-tensors integration and its package to load at all; the lean forward would then see
    that package's modules, not QuantLinear. Converting them is not built yet: one line says so.
    """
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    method = str(q.get("quant_method", "")).lower() if isinstance(q, dict) else ""
    if method not in ("compressed-tensors", "fp8"):
        return None
    return (f"an FP8 checkpoint ({method}) does not load in this version; load its bfloat16 original with "
            "--target-quant fp8 (the same weights, quantized at load), or serve it with vLLM")


def _fp8_refused(here: str) -> str:
    return (f"fp8 needs a GPU of compute capability {FP8_MIN_CAPABILITY[0]}.{FP8_MIN_CAPABILITY[1]} or newer "
            f"(Ada, Hopper); {here} — use int8-wo")


def precision_problem(precision: str, device: torch.device) -> str | None:
    """Why this device cannot run this 8-bit precision (one line naming what would), or None."""
    if precision != "fp8":
        return None
    if device.type != "cuda":
        return _fp8_refused(f"this is the {device.type.upper()}")
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < FP8_MIN_CAPABILITY:
        return _fp8_refused(f"this is {major}.{minor}")
    return None


def precision_refusals(precisions: Sequence[str]) -> dict[str, dict[str, str]]:
    """precision -> device choice -> why it cannot run there, for the Models dialog's choices (auto, cpu, cuda and
    cuda:N for each GPU seen), each choice judged on the device a load would pick for it: plain strings, so the
    dialog greys what cannot run without asking torch. Choices that run a precision are left out."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    found: dict[str, dict[str, str]] = {}
    for choice in (*DEVICES, *(f"cuda:{n}" for n in range(gpus))):
        try:
            device = pick_device(choice)
        except ModelLoadError:  # cuda asked for and none seen: no precision loads, fp8 least of all
            device = None
        for precision in precisions:
            if device is not None:
                problem = precision_problem(precision, device)
            else:
                problem = _fp8_refused("this PyTorch build sees no CUDA GPU") if precision == "fp8" else None
            if problem is not None:
                found.setdefault(precision, {})[choice] = problem
    return found


def require_runnable(precision: str, device: torch.device, name: str) -> None:
    """Raises ModelLoadError (one line) when `precision` cannot run on `device`."""
    problem = precision_problem(precision, device)
    if problem is not None:
        raise ModelLoadError(f"{name} in {precision}: {problem}.")
    if precision in FAST_PRECISIONS and device.type == "cuda" and not kernel.AVAILABLE:
        log.warning("%s in %s: Triton is not installed, so 8-bit weights are dequantized per matmul "
                    "(correct, but slower than bfloat16): pip install triton", name, precision)
