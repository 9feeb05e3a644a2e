"""What moving the loaded pair from llama.cpp to torch costs (for a draft head, which reads hidden states): speed and
memory, from the costs measured at load and the two memory plans; no Qt."""
from __future__ import annotations

from engine.types import MemoryPlan, ModelInfo

GiB = 2**30


def _target_weights(plan: MemoryPlan) -> int:
    return sum(i.bytes for d in plan.devices for i in d.items if (i.kind, i.model) == ("weights", "target"))


def _one_forward_ms(info: ModelInfo) -> float | None:
    return next((ms for width, ms in info.target_ms if width == 1 and ms > 0), None)


def switch_cost(info: ModelInfo, here: MemoryPlan | None, torch: MemoryPlan | None) -> str:
    """The question's text: why the switch, then what it costs on this machine, each figure saying where it is from.

    Speed: the llama.cpp target forward measured at load, and the share of the weights each forward reads on torch
    (a CPU decode reads every weight once per token, so their bytes set its pace). Memory: the two plans' totals.
    """
    lines = [f"A draft head reads the target's hidden states, which {info.fast_path} does not give. The torch "
             "runtime does: switch the loaded pair to torch to train one (and to use it afterwards)?", ""]
    ms = _one_forward_ms(info)
    if ms is not None:
        lines.append(f"• Speed now: {1000 / ms:.1f} target forwards a second on {info.fast_path} "
                     f"({ms:.0f} ms each, measured when the pair loaded).")
    if here is not None and torch is not None and _target_weights(here) > 0:
        ratio = _target_weights(torch) / _target_weights(here)
        lines.append(f"• On torch the target is {torch.target_precision} ({gib(_target_weights(torch))} of weights "
                     f"instead of {gib(_target_weights(here))} as {here.target_precision}): each token reads "
                     f"{ratio:.1f}× the bytes, so expect standard decoding about {ratio:.1f}× slower until the "
                     "head's drafts win some of it back.")
    if torch is not None:
        before = f" instead of {gib(here.total)}" if here is not None else ""
        room = min((d.capacity for d in torch.devices if d.capacity is not None), default=None)
        lines.append(f"• Memory: {gib(torch.total)}{before}" + (f", of {gib(room)} available." if room else "."))
    lines += ["", "The first load on torch converts the models once into a cached copy; llama.cpp stays a choice "
              "in File ▸ Load models…"]
    return "\n".join(lines)


def gib(n: int) -> str:
    return f"{n / GiB:.1f} GiB"


