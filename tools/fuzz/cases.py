"""Random command lines and random or mutated GGUF, prompts and settings files for the fuzzer."""
from __future__ import annotations

import json
import os
import random
import struct
from pathlib import Path

from tools.fuzz.core import World

# --------------------------------------------------------------------------- random values

HUGE = "9" * 30
PROMPTS = ["def add(a, b):", "Hello world!", "用Python写一个快速排序", "🙂🚀✨", "x", "", "   ", "a\nb\tc",
           "=HYPERLINK(\"http://evil.example\",\"x\")", "The quick brown fox " * 60, "caf\udce9", "\x00nul",
           "-1", "@SUM(A1)"]


FAULT_RATE = 0.15  # in a faulty case, the chance each option takes a bad value


class Faults:
    """Per case: a clean case (every value valid, so it runs deep) or a faulty one (bad values here and there)."""

    rate = 0.0

    @classmethod
    def start(cls, rng: random.Random) -> None:
        cls.rate = 0.0 if rng.random() < 0.5 else FAULT_RATE

    @classmethod
    def hit(cls, rng: random.Random) -> bool:
        return rng.random() < cls.rate


def _pick(rng: random.Random, good: tuple | list, bad: tuple | list = ()):
    return rng.choice(bad) if bad and Faults.hit(rng) else rng.choice(good)


def number_text(rng: random.Random, good: list[str], bad: list[str] | None = None) -> str:
    bad = (bad or []) + ["-1", "0", "nan", "inf", "-inf", "1e400", HUGE, "-" + HUGE, "two", "", " ", "0x10", "1.5",
                         "1_000", "9" * 5000, "٣"]
    return _pick(rng, good, bad)


def model_spec(rng: random.Random, world: World, role: str, mutated_gguf: Path | None = None) -> list[str]:
    """--target/--draft, or nothing (the tiny 'default'), or something that is not a model."""
    own = world.target if role == "target" else world.draft
    good = [[f"--{role}", str(own)]] * 8 + [[], [f"--{role}", "default"], [f"--{role}", str(world.gguf)],
                                            [f"--{role}", str(world.target)]]
    bad = [[f"--{role}", "./no/such/model"], [f"--{role}", str(world.no_config)], [f"--{role}", str(world.text_file)],
           [f"--{role}", "nobody/not-cached-model"], [f"--{role}", "~nobody_at_all/x"], [f"--{role}", "a" * 5000],
           [f"--{role}", "bad\x00path"], [f"--{role}", ""], [f"--{role}", "/proc/self"]]
    if mutated_gguf is not None:
        return [f"--{role}", str(mutated_gguf)]
    return _pick(rng, good, bad)


def decoding_options(rng: random.Random) -> list[str]:
    argv: list[str] = []
    if rng.random() < 0.6:
        argv += ["--k", number_text(rng, ["1", "2", "3", "5", "8", "12"], ["13", "40000"])]
    if rng.random() < 0.5:
        argv += ["--temperature", number_text(rng, ["0", "0.7", "1", "2", "100"])]
    if rng.random() < 0.3:
        argv += ["--top-k", number_text(rng, ["0", "1", "5", "50", "100000"])]
    if rng.random() < 0.3:
        argv += ["--top-p", number_text(rng, ["1", "0.9", "0.5", "0.01"], ["1.0000001"])]
    if rng.random() < 0.4:
        argv += ["--seed", number_text(rng, ["0", "1", "42", "4294967296", str(2**63 - 1)], [str(2**63)])]
    if rng.random() < 0.4:
        argv += ["--proposer", _pick(rng, ["draft", "ngram", "draft+ngram"], ["both", ""])]
    if rng.random() < 0.5:
        argv += ["--device", _pick(rng, ["cpu", "cpu", "auto"], ["cuda", "cuda:1", "cuda:x", "tpu", ""])]
    if rng.random() < 0.4:
        argv += ["--dtype", _pick(rng, ["float32", "float32", "bfloat16", "auto", "float16"], ["int8"])]
    if rng.random() < 0.3:
        argv += ["--fast-path", _pick(rng, ["auto", "eager", "static", "compiled"], ["turbo"])]
    if rng.random() < 0.05:
        argv += ["-v"]
    return argv


def generate_argv(rng: random.Random, world: World, gguf: Path | None = None) -> list[str]:
    argv = ["generate"]
    if not Faults.hit(rng):
        argv += ["--prompt", _pick(rng, PROMPTS[:10], PROMPTS[10:])]
    if rng.random() < 0.3:
        argv += ["--raw"]
    if rng.random() < 0.5:
        argv += ["--mode", _pick(rng, ["speculative", "standard", "standard"], ["turbo"])]
    argv += ["--max-new-tokens", number_text(rng, ["1", "2", "4", "6", "8"], ["100000"])]
    if rng.random() < 0.5:
        argv += ["--json"]
    argv += model_spec(rng, world, "target", gguf) + model_spec(rng, world, "draft") + decoding_options(rng)
    if "--device" not in argv:
        argv += ["--device", "cpu"]
    return argv


def output_path(rng: random.Random, world: World, suffix: str) -> str:
    return _pick(rng, [str(world.path(suffix))],
                 [str(world.root), str(world.root / "missing" / f"out{suffix}"), f"/proc/specdec{suffix}", ""])


def bench_argv(rng: random.Random, world: World, prompts: Path | None = None) -> list[str]:
    argv = ["bench", "--prompts", str(prompts or _pick(rng, [world.prompts],
                                                       [world.text_file, world.root / "nope.jsonl", world.root]))]
    modes = ["standard", "speculative", "hf", "hf-static", "hf-assisted", "warp", ""]
    if rng.random() < 0.8:
        chosen = rng.sample(modes[:5], rng.randint(1, 3)) if not Faults.hit(rng) else [rng.choice(modes)] * 2
        argv += ["--modes", ",".join(chosen)]
    argv += ["--max-new-tokens", number_text(rng, ["1", "2", "3", "4"])]
    argv += ["--warmup", number_text(rng, ["0", "0", "1"], ["101"])]
    if rng.random() < 0.4:
        argv += ["--json", output_path(rng, world, ".json")]
    if rng.random() < 0.4:
        argv += ["--csv", output_path(rng, world, ".csv")]
    if rng.random() < 0.2:
        argv += ["--raw"]
    argv += model_spec(rng, world, "target") + model_spec(rng, world, "draft") + decoding_options(rng)
    if "--device" not in argv:
        argv += ["--device", "cpu"]
    return argv


def cli_argv(rng: random.Random, world: World) -> list[str]:
    """One random command line: mostly plausible, sometimes garbage."""
    Faults.start(rng)
    roll = rng.random()
    if roll < 0.55:
        argv = generate_argv(rng, world)
    elif roll < 0.85:
        argv = bench_argv(rng, world)
    elif roll < 0.93:
        argv = ["cache", _pick(rng, ["info", "info", "verify", "clean"], ["defrag"])] + (
            ["--all"] if rng.random() < 0.1 else [])
    else:
        argv = rng.choice([["--quit-after-ms", "300"], ["--help"], ["generate", "--help"], ["bench"], ["generate"],
                           ["cache"], ["generate", "--prompt"], ["generate", "--bogus", "1"], ["bench", "--prompts"],
                           ["--demo", "--quit-after-ms", "200"], ["--no-draft", "--quit-after-ms", "300"]])
    if argv and Faults.hit(rng) and rng.random() < 0.3:  # a stray or repeated flag
        argv.insert(rng.randint(1, len(argv)), rng.choice(["--k", "--json", "--unknown", "--", "-x"]))
    return argv


# --------------------------------------------------------------------------- mutated files

def mutate(rng: random.Random, data: bytes, header: int = 4096) -> bytes:
    """A damaged copy: flipped bits, overwritten or cut ranges, inserted junk, a huge number, crafted arrays."""
    out = bytearray(data)
    kind = rng.choice(["flip", "flip-header", "overwrite", "truncate", "insert", "delete", "u64", "nested", "empty",
                       "magic-only", "type"])
    if kind == "flip":
        for _ in range(rng.randint(1, 20)):
            i = rng.randrange(len(out))
            out[i] ^= 1 << rng.randrange(8)
    elif kind == "flip-header":
        for _ in range(rng.randint(1, 6)):
            i = rng.randrange(min(header, len(out)))
            out[i] ^= 1 << rng.randrange(8)
    elif kind == "overwrite":
        i = rng.randrange(len(out))
        n = rng.randint(1, 4096)
        out[i:i + n] = os.urandom(min(n, len(out) - i))
    elif kind == "truncate":
        out = out[: rng.randrange(len(out))]
    elif kind == "insert":
        i = rng.randrange(len(out))
        out[i:i] = os.urandom(rng.randint(1, 64))
    elif kind == "delete":
        i = rng.randrange(len(out))
        del out[i:i + rng.randint(1, 64)]
    elif kind == "u64":
        i = rng.randrange(0, min(header, len(out) - 8))
        out[i:i + 8] = struct.pack("<Q", rng.choice([2**63, 2**64 - 1, 2**32, 10**12]))
    elif kind == "nested":
        depth = rng.choice([5, 100, 10_000])
        out = bytearray(b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", 1) + b"x" + struct.pack("<I", 9)
                        + struct.pack("<IQ", 9, 1) * depth + struct.pack("<IQ", 0, 0))
    elif kind == "empty":
        out = bytearray()
    elif kind == "magic-only":
        out = bytearray(b"GGUF")
    elif kind == "type":
        i = rng.randrange(24, min(header, len(out) - 4))
        out[i:i + 4] = struct.pack("<I", rng.choice([13, 99, 2**31]))
    return bytes(out)


def gguf_case(rng: random.Random, world: World) -> list[str]:
    Faults.start(rng)
    path = world.path(".gguf")
    path.write_bytes(mutate(rng, world.gguf_bytes))
    return generate_argv(rng, world, gguf=path)


def prompts_case(rng: random.Random, world: World) -> list[str]:
    Faults.start(rng)
    lines = ['{"id": "a", "category": "code", "prompt": "def add(a, b):"}',
             '{"id": "b", "category": "chat", "prompt": "你好"}']
    kind = rng.choice(["bytes", "utf8", "deep", "long", "dup", "types", "surrogate", "bom-crlf", "nul", "empty",
                       "formula", "mutate"])
    if kind == "bytes":
        data = os.urandom(rng.randint(1, 2000))
    elif kind == "utf8":
        data = '{"id": "a", "prompt": "caf'.encode() + b"\xe9\xff" + b'"}\n'
    elif kind == "deep":
        data = ("[" * rng.choice([50, 5000, 200_000])).encode() + b"\n"
    elif kind == "long":
        data = json.dumps({"id": "long", "prompt": "word " * rng.choice([10, 3000])}).encode() + b"\n"
    elif kind == "dup":
        data = (lines[0] + "\n" + lines[0] + "\n").encode()
    elif kind == "types":
        data = rng.choice(['{"id": [1, {"x": 2}], "category": null, "prompt": "hi"}', '[1, 2]', '"just text"',
                           '{"prompt": 5}', '{"id": 1e400, "prompt": "x"}', "null", '{"prompt": ""}']).encode()
    elif kind == "surrogate":
        data = rng.choice(['{"id": "\\ud800", "prompt": "x"}', '{"prompt": "a\\udce9b"}',
                           '{"category": "\\udfff", "prompt": "x"}']).encode()
    elif kind == "bom-crlf":
        data = b"\xef\xbb\xbf" + "\r\n".join(lines).encode() + b"\r\n"
    elif kind == "nul":
        data = b'{"id": "a\x00", "prompt": "x\x00y"}\n'
    elif kind == "empty":
        data = rng.choice([b"", b"\n\n\n", b"   \n"])
    elif kind == "formula":
        data = b'{"id": "=1+1", "category": "@cmd", "prompt": "-2+3"}\n'
    else:
        data = mutate(rng, "\n".join(lines).encode(), header=200)
    path = world.path(".jsonl")
    path.write_bytes(data)
    return bench_argv(rng, world, prompts=path)


SETTINGS_KEYS = ["generation/settings", "display/settings", "models/selection", "window/splitter", "window/view",
                 "window/geometry"]


def settings_value(rng: random.Random) -> str:
    values = [
        json.dumps({"seed": rng.choice([3000000000, -5, 10**30]), "k": rng.choice([0, 99, 10**40, "x"]),
                    "temperature": rng.choice(["nan", 1e308, -1, None]), "top_p": rng.choice([2, "inf", []]),
                    "mode": rng.choice(["turbo", 7, None]), "system_prompt": rng.choice(["x" * 200_000, 5, "ok"])}),
        json.dumps({"sizes": rng.choice([[10**20, 5, 5], [-1, 2], [], "abc", [1.5, 2.5, 3.5], list(range(100))])}),
        json.dumps({"charts_visible": rng.choice([None, "no", {"a": 1}, 0])}),
        json.dumps({"target": {"kind": rng.choice(["folder", "gguf", "hub", "alien"]),
                               "value": rng.choice(["a\x00b", "a" * 10_000, "/nope", 5])},
                    "device": rng.choice(["cuda:999999999999", "cpu", 3]), "dtype": rng.choice(["int3", None])}),
        "[" * rng.choice([10, 100_000]),
        "@ByteArray(" + "".join(f"\\x{rng.randrange(256):02x}" for _ in range(rng.randint(0, 200))) + ")",
        "@Variant(\\0\\0\\0\\x7f\\0\\0\\0\\x1cjunk)", "@Invalid()", "1, 2, 3", "", "true",
    ]
    value = rng.choice(values)
    if value.startswith("@") or value in ("1, 2, 3", "", "true"):
        return value
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def settings_case(rng: random.Random, world: World) -> list[str]:
    path = world.path(".ini")
    if rng.random() < 0.2:
        path.write_bytes(os.urandom(rng.randint(1, 8000)))
    else:
        sections: dict[str, list[str]] = {}
        for _ in range(rng.randint(1, 8)):
            section, key = rng.choice(SETTINGS_KEYS).split("/")
            sections.setdefault(section, []).append(f"{key}={settings_value(rng)}")
        text = "".join(f"[{s}]\n" + "\n".join(lines) + "\n" for s, lines in sections.items())
        data = text.encode("utf-8", "surrogatepass")
        path.write_bytes(mutate(rng, data, header=len(data)) if rng.random() < 0.2 else data)
    return ["--demo", "--settings", str(path), "--quit-after-ms", "150"]

