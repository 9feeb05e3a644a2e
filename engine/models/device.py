"""Choosing the device and dtype a pair runs in: CUDA when present, bf16 only where it is native."""
from __future__ import annotations

import logging
import platform
import subprocess
from functools import lru_cache

import torch

from engine.errors import ModelLoadError

log = logging.getLogger(__name__)

DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "float32": torch.float32,
    "fp32": torch.float32,
}


def pick_device(device: str = "auto") -> torch.device:
    """auto: the first CUDA device if there is one, else the CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ModelLoadError(
                f"Device {device!r} was asked for but this PyTorch build sees no CUDA GPU "
                f"(torch {torch.__version__}); use --device cpu or install a CUDA build of torch."
            )
        return torch.device(device)
    if device == "cpu":
        return torch.device("cpu")
    raise ModelLoadError(f"Unknown device {device!r}: use auto, cpu, cuda or cuda:N.")


def _cpuinfo_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                key, _, value = line.partition(":")
                # x86 lists "flags", arm64 lists "Features"; the first processor is representative.
                if key.strip() in ("flags", "Features"):
                    return set(value.split())
    except OSError:
        pass
    return set()


@lru_cache(maxsize=1)
def cpu_has_native_bf16() -> bool:
    """True when the processor computes bf16 in hardware (AVX512-BF16/AMX on x86, BF16 on arm64).

    Without it PyTorch emulates bf16 matmuls by converting to float32, which is slower than
    float32 itself, so the choice of dtype on CPU hinges on this.
    """
    flags = _cpuinfo_flags()
    if flags & {"avx512_bf16", "amx_bf16", "bf16"}:
        return True
    if platform.system() == "Darwin" and platform.machine() == "arm64":
        try:
            out = subprocess.run(
                ["sysctl", "-n", "hw.optional.arm.FEAT_BF16"], capture_output=True, text=True, timeout=2
            )
            return out.stdout.strip() == "1"
        except (OSError, subprocess.SubprocessError):
            return False
    if not flags:
        # No /proc/cpuinfo (Windows, sandboxes): only AMX in torch's own dispatch proves native bf16.
        capability = getattr(torch.backends.cpu, "get_cpu_capability", lambda: "")()
        return "AMX" in str(capability).upper()
    return False


def pick_dtype(device: torch.device, dtype: str = "auto") -> torch.dtype:
    """auto: bf16 on CUDA; on CPU bf16 only where it is native, float32 otherwise."""
    if dtype == "auto":
        if device.type == "cuda":
            return torch.bfloat16
        if device.type == "cpu" and cpu_has_native_bf16():
            return torch.bfloat16
        return torch.float32
    try:
        chosen = DTYPES[dtype]
    except KeyError:
        raise ModelLoadError(f"Unknown dtype {dtype!r}: use auto, bfloat16, float16 or float32.") from None
    if device.type == "cpu" and chosen == torch.bfloat16 and not cpu_has_native_bf16():
        log.warning("bfloat16 on a CPU without native bf16 is emulated and slower than float32")
    return chosen


def dtype_name(dtype: torch.dtype) -> str:
    """'bfloat16' for torch.bfloat16: the name ModelInfo and bench configs carry."""
    return str(dtype).removeprefix("torch.")


def output_device(model: torch.nn.Module) -> torch.device:
    """Where a model's logits come out: its output head's device (the last GPU of a split model)."""
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", getattr(head, "qweight", None))  # a packed CPU head has none
    return weight.device if isinstance(weight, torch.Tensor) else next(model.parameters()).device
