"""Command-line option types: each checks one value before any model loads and says what is wrong in one line."""
from __future__ import annotations

import argparse
import math
import os
import re
import tempfile
from pathlib import Path

from engine.limits import K_AUTO, K_MAX, MAX_NEW_TOKENS, TREE_ALTERNATIVES_MAX, TREE_NODES_MAX
from engine.settings import TOP_K_RANGE

MAX_SEED = 2**63 - 1  # every torch generator takes it
MAX_WARMUP = 100  # untimed generations per mode; more is a typo, not a plan
MAX_REPEAT = 1000  # timed repeats of every run; more is a typo, not a plan
MAX_MINUTES = 7 * 24 * 60  # a distillation budget beyond a week is a typo
DEVICE_NAME = re.compile(r"auto|cpu|cuda(:\d{1,3})?")


def whole(text: str, low: int, high: int, what: str) -> int:
    try:
        value = int(text.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be a whole number, got {short(text)!r}") from None
    if not low <= value <= high:
        raise argparse.ArgumentTypeError(f"{what} must be from {low} to {high}, got {short(text)}")
    return value


def sequences(text: str) -> int:
    """--max-seqs: sequences decoded together."""
    return whole(text, 1, 1024, "--max-seqs")


def short(text: str, limit: int = 40) -> str:
    """An echoed value stays short: a 10,000-digit number is not worth a screenful."""
    text = text.strip()
    return text if len(text) <= limit else text[:limit] + "…"


def number(text: str, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{what} must be a number, got {short(text)!r}") from None
    if not math.isfinite(value):  # nan slips through every comparison; inf samples uniformly
        raise argparse.ArgumentTypeError(f"{what} must be a finite number, got {short(text)}")
    return value


def k(text: str) -> int:
    """1..K_MAX, or "auto" (K_AUTO: chosen per step)."""
    if text.strip().lower() == "auto":
        return K_AUTO
    try:
        return whole(text, 1, K_MAX, "K (draft tokens per step)")
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e}, or auto") from None


def listed(text: str, item, what: str) -> str:
    """A comma-separated list whose every item `item` accepts; the text itself is kept (the command parses it)."""
    items = [t.strip() for t in utf8(text, what).split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{what} needs at least one value")
    values = [item(t) for t in items]
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"{what}: a value is listed twice in {short(text)!r}")
    return text


def k_list(text: str) -> str:
    return listed(text, k, "--k")


def temperature_list(text: str) -> str:
    return listed(text, temperature, "--temperature")


def repeat(text: str) -> int:
    return whole(text, 1, MAX_REPEAT, "repeats")


def minutes(text: str) -> float:
    value = number(text, "minutes")
    if not 0 < value <= MAX_MINUTES:
        raise argparse.ArgumentTypeError(f"minutes must be > 0 and at most {MAX_MINUTES} (a week), got {value:g}")
    return value


def max_new_tokens(text: str) -> int:
    return whole(text, 1, MAX_NEW_TOKENS, "max new tokens")


def warmup(text: str) -> int:
    return whole(text, 0, MAX_WARMUP, "warm-up runs")


def seed(text: str) -> int:
    return whole(text, 0, MAX_SEED, "the seed")


def top_k(text: str) -> int:
    return whole(text, 0, TOP_K_RANGE[1], "top-k")


def temperature(text: str) -> float:
    value = number(text, "temperature")
    if value < 0:
        raise argparse.ArgumentTypeError(f"temperature must be >= 0 (0 = greedy), got {value}")
    return value


def top_p(text: str) -> float:
    value = number(text, "top-p")
    if not 0.0 < value <= 1.0:
        raise argparse.ArgumentTypeError(f"top-p must be in (0, 1] (1 disables it), got {value}")
    return value


def device(text: str) -> str:
    if not DEVICE_NAME.fullmatch(text.strip()):
        raise argparse.ArgumentTypeError(f"a device must be auto, cpu, cuda or cuda:N, got {short(text)!r}")
    return text.strip()


def utf8(text: str, what: str) -> str:
    """Text from the command line, which may carry undecodable bytes as surrogate escapes."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise argparse.ArgumentTypeError(f"{what} is not valid UTF-8 text") from None
    return text


def prompt(text: str) -> str:
    if not utf8(text, "the prompt").strip():
        raise argparse.ArgumentTypeError("the prompt is empty")
    return text


def model_spec(text: str) -> str:
    return utf8(text, "a model path or hub id")


def head(text: str) -> str:
    """auto, none, or a draft head folder that exists (a typo should not cost a model load)."""
    text = utf8(text, "a draft head folder").strip()
    if text in ("auto", "none"):
        return text
    if not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"draft head folder {short(text)!r} does not exist (or use auto or none)")
    return text


def tree(text: str) -> str:
    """auto, 0..3 (alternatives beside each head draft token) or dN (a dynamic tree of N nodes, e.g. d48)."""
    value = text.strip().lower()
    if value == "auto" or value in {str(a) for a in range(TREE_ALTERNATIVES_MAX + 1)}:
        return value
    if value.startswith("d"):
        return f"d{whole(value[1:], 1, TREE_NODES_MAX, 'the nodes of a dynamic tree (dN)')}"
    raise argparse.ArgumentTypeError(f"--tree takes auto, 0 to {TREE_ALTERNATIVES_MAX}, or dN for a dynamic tree "
                                     f"of N nodes (1 to {TREE_NODES_MAX}, e.g. d48); got {short(text)!r}")


def key_value(text: str) -> tuple[str, str]:
    """KEY=VALUE (the value is checked by the command that knows the key)."""
    key, sep, value = utf8(text, "a KEY=VALUE setting").partition("=")
    if not sep or not key.strip() or not value.strip():
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {short(text)!r}")
    return key.strip(), value.strip()


def path(text: str) -> Path:
    if not utf8(text, "a file or folder name").strip():  # Path("") is ".": the current folder, never meant
        raise argparse.ArgumentTypeError("the file or folder name is empty")
    return Path(text)


def memory(text: str) -> int:
    """A memory size with its unit ("24GiB", "80 GB", "512MiB"), more than 0 bytes."""
    from engine.models.plan import parse_size  # pure arithmetic, no torch

    text = utf8(text, "a memory size").strip()
    if re.fullmatch(r"[-+]?[0-9]*\.?[0-9]+", text) and float(text) > 0:
        raise argparse.ArgumentTypeError(f"a memory size needs a unit: {short(text)}GiB (binary) or "
                                         f"{short(text)}GB (decimal), got {short(text)!r}")
    if text.startswith("-") or re.fullmatch(r"[-+]?[0-9]*\.?[0-9]+", text):
        raise argparse.ArgumentTypeError(f"a memory size must be more than 0, got {short(text)}")
    try:
        value = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"a memory size must be more than 0, got {short(text)}")
    return value


def check_devices(args: argparse.Namespace) -> None:
    """Options that contradict each other, found before loading: --gpus above 1 on the CPU."""
    gpus, dev = getattr(args, "gpus", None), getattr(args, "device", None)
    if gpus is not None and gpus > 1 and dev == "cpu":
        raise argparse.ArgumentTypeError(f"--gpus {gpus} splits the target over GPUs, but --device cpu runs on the "
                                         f"CPU: drop one of them")


def check_writable(path: Path) -> None:
    """Raises ArgumentTypeError now, before minutes of loading and timing, if a results file could not be written later."""
    where = path.parent if str(path.parent) else Path(".")
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"output {path} is a folder; give a file name")
    if not where.is_dir():
        raise argparse.ArgumentTypeError(f"output folder {where} does not exist")
    # Trying is the only honest test (permissions, read-only mounts, root, ACLs): append to an existing
    # file (its content and time stay), or create and delete a scratch file beside a new one.
    try:
        if path.exists():
            open(path, "ab").close()
        else:
            fd, scratch = tempfile.mkstemp(dir=where, prefix=f".{path.name}.", suffix=".check")
            os.close(fd)
            os.unlink(scratch)
    except OSError as e:
        raise argparse.ArgumentTypeError(f"cannot write {path}: {e.strerror or e}") from None


def tree_frontier(text: str) -> int:
    return whole(text, 1, TREE_NODES_MAX, "--tree-frontier")
