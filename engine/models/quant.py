"""Per-model precision: float dtypes, 8-bit / 4-bit weights through bitsandbytes, and fast 8-bit (fastquant.py)."""
from __future__ import annotations

import contextlib
import importlib.util
import logging
import sys
import warnings
from collections.abc import Iterator
from functools import lru_cache
from typing import Any

from engine.errors import ModelLoadError
from engine.loadspec import Precision

log = logging.getLogger(__name__)

FLOATS: tuple[Precision, ...] = ("bfloat16", "float16", "float32")
QUANTIZED: tuple[Precision, ...] = ("int8", "nf4")
# One byte per weight and a float32 scale per output row, quantized at load (engine/models/fastquant.py).
FAST: tuple[Precision, ...] = ("int8-wo", "fp8")
# Bytes per element of the float precisions (what the weights and the KV cache are held in).
FLOAT_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}
NF4_BLOCK = 64  # bitsandbytes' default 4-bit block: one float32 absmax per 64 weights
NF4_CODE_BYTES = 16 * 4  # the 16-entry NF4 code book every 4-bit weight keeps (float32)
# Why a CUDA graph can or cannot hold a quantized layer (measured on an H200, bitsandbytes 0.50.2):
# the 4-bit kernels are plain launches; LLM.int8() looks for outlier columns with data-dependent
# shapes, and its capture fails ("operation failed due to a previous error during capture").
CAPTURABLE = {"nf4": True, "int8": False, "int8-wo": True, "fp8": True}


def is_quantized(precision: str) -> bool:
    return precision in QUANTIZED


def is_fast(precision: str) -> bool:
    """int8-wo / fp8: 8-bit weights quantized at load, read by the lean forward at memory speed."""
    return precision in FAST


@contextlib.contextmanager
def _no_hub_kernels() -> Iterator[None]:
    """While bitsandbytes is first imported: on a CPU with AVX512-BF16 its import asks the Hub for a 4-bit kernel
    (`kernels.get_kernel("kernels-community/...")`), a download at run time this app never makes. Hidden for the
    import, `kernels` cannot be found and bitsandbytes keeps its own CPU kernel (its warning about it is left out)."""
    if "bitsandbytes" in sys.modules:  # imported already: nothing more is fetched
        yield
        return
    saved = sys.modules.get("kernels")
    sys.modules["kernels"] = None  # type: ignore[assignment]  # `from kernels import …` raises ImportError
    quiet = logging.getLogger("bitsandbytes.backends.cpu.ops")
    level = quiet.level
    quiet.setLevel(logging.ERROR)
    try:
        yield
    finally:
        quiet.setLevel(level)
        if saved is not None:
            sys.modules["kernels"] = saved
        else:
            sys.modules.pop("kernels", None)


def import_bitsandbytes() -> Any:
    """bitsandbytes, imported without asking the Hub for anything (every import of it in the project goes here
    first; later imports, transformers' included, find it loaded)."""
    with _no_hub_kernels():
        import bitsandbytes
    return bitsandbytes


def bitsandbytes_problem() -> str | None:
    """Why 8-bit/4-bit cannot be used here (one line a person can act on), or None when it can."""
    if importlib.util.find_spec("bitsandbytes") is None:
        return "int8 and nf4 need the bitsandbytes package: pip install 'bitsandbytes>=0.45'"
    try:
        import_bitsandbytes()  # its import checks the native library
    except Exception as e:  # a broken or CPU-less build: say so, never a traceback
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        return f"bitsandbytes is installed but does not load ({first[:160]})"
    return None


@lru_cache(maxsize=1)
def nf4_absmax_bytes_on_cpu() -> int:
    """Bytes of one 4-bit block's absmax on a CPU: bitsandbytes (0.48+) repacks 4-bit weights at their
    first use with bf16 absmax where the CPU has AVX512-BF16, and keeps float32 absmax elsewhere."""
    try:
        import_bitsandbytes()
        from bitsandbytes.functional import has_avx512bf16
    except Exception:  # no bitsandbytes, or a build without it: nothing is repacked
        return 4
    return 2 if has_avx512bf16() else 4


def require_bitsandbytes(precision: str, name: str) -> None:
    """Raises ModelLoadError when `precision` needs bitsandbytes and it cannot be used."""
    if not is_quantized(precision):
        return
    problem = bitsandbytes_problem()
    if problem is not None:
        raise ModelLoadError(f"{name} in {precision}: {problem}; or choose bfloat16/float16.")


def quantization_config(precision: str, compute_dtype: Any) -> Any | None:
    """transformers' BitsAndBytesConfig for int8 / nf4 (None for float precisions).

    nf4 without double quantization: the second-level absmax saves 0.4 bits per weight but costs
    one more kernel per layer in every decoding step; the plan counts float32 absmax.
    """
    if not is_quantized(precision):
        return None
    from transformers import BitsAndBytesConfig

    if precision == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=compute_dtype,
                              bnb_4bit_use_double_quant=False)


def checkpoint_quantization(config: dict) -> str | None:
    """What a config.json says about weights that are already quantized: 'int8', 'nf4', 'fp4',
    another method's name (awq, gptq, ...), or None for plain float weights."""
    q = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not isinstance(q, dict):
        return None
    method = str(q.get("quant_method", "")).lower()
    if method == "bitsandbytes" or q.get("load_in_4bit") or q.get("load_in_8bit"):
        if q.get("load_in_8bit") or q.get("_load_in_8bit"):
            return "int8"
        return str(q.get("bnb_4bit_quant_type", "nf4")).lower()
    return method or "unknown"


def quantized_kind(model: Any) -> str | None:
    """'int8' or 'nf4'/'fp4' when a loaded model holds bitsandbytes layers; None otherwise."""
    for module in model.modules():
        kind = layer_kind(module)
        if kind is not None:
            return kind
    return None


def layer_kind(module: Any) -> str | None:
    """The bitsandbytes kind of one module (by class name: no bitsandbytes import needed)."""
    name = type(module).__name__
    if name == "Linear8bitLt":
        return "int8"
    if name in ("Linear4bit", "LinearNF4", "LinearFP4"):
        quant_state = getattr(getattr(module, "weight", None), "quant_state", None)
        return str(getattr(quant_state, "quant_type", "nf4"))
    return None


class _Int8CastFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return "inputs will be cast" not in record.getMessage()


def quiet_int8_casts() -> None:
    """LLM.int8() says on every call that bf16 inputs are cast to fp16; that is how it works, not news."""
    warnings.filterwarnings("ignore", message=r"MatMul8bitLt: inputs will be cast", category=UserWarning)
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _Int8CastFilter) for f in logger.filters):
        logger.addFilter(_Int8CastFilter())
