"""Crafted draft-head folders: a head people pass around, its manifest or a shard damaged, loaded by `generate --head`.
Each must end in one line (exit 2) or an answer (exit 0), never read a file outside the head folder."""
from __future__ import annotations

import copy
import hashlib
import json
import os
import random
import shutil
from pathlib import Path

from tools.fuzz.core import Outcome, World, run_in_process
from tools.fuzz.files import sentinel, tree_hash, with_outside_check, world_distiller

_HEAD: list[Path] = []  # the world's head, trained once for its tiny target


def _world_head(world: World) -> Path:
    """A one-step head for the world's target (seconds on a CPU), made at first use."""
    if not _HEAD:
        out = world.root / "head"
        world_distiller(world, world.root / "head-work", out).run()
        _HEAD.append(out)
    return _HEAD[0]


WRONG = [None, 5, -1, "x", [], {}, [5], [{}], True, 1e400, "../x", "/etc/passwd", "a/b", "..", "", "\u0000"]


def head_case(rng: random.Random, world: World) -> Outcome:
    head = world.path("-head")
    shutil.copytree(_world_head(world), head)
    manifest = json.loads((head / "manifest.json").read_text(encoding="utf-8"))
    shard = head / manifest["shards"][0]["file"]
    kind = rng.choice(["field", "shard-field", "shard-bytes", "shard-bytes-hashed", "manifest-bytes", "extra-shard"])
    if kind == "field":
        manifest[rng.choice(["format", "name", "config", "target", "shards"])] = rng.choice(WRONG)
    elif kind == "shard-field":
        manifest["shards"][0][rng.choice(["file", "sha256"])] = rng.choice(WRONG + [str(sentinel(world) / "passwd")])
    elif kind in ("shard-bytes", "shard-bytes-hashed"):
        from tools.fuzz.cases import mutate

        data = mutate(rng, shard.read_bytes(), header=256)
        shard.write_bytes(data)
        if kind == "shard-bytes-hashed":  # a manifest rewritten for the damaged shard: safetensors must refuse it
            manifest["shards"][0]["sha256"] = hashlib.sha256(data).hexdigest()
    elif kind == "extra-shard":
        extra = copy.deepcopy(manifest["shards"][0])
        extra["file"] = rng.choice(["missing.safetensors", manifest["shards"][0]["file"]])
        manifest["shards"].append(extra)
    text = json.dumps(manifest)
    if kind == "manifest-bytes":
        text = rng.choice(["[" * 100_000, "[]", "null", os.urandom(40).hex(), text[: rng.randrange(len(text))]])
    (head / "manifest.json").write_text(text, encoding="utf-8")
    argv = ["generate", "--target", str(world.target), "--head", str(head), "--proposer", "head", "--device", "cpu",
            "--dtype", "float32", "--prompt", "hi", "--max-new-tokens", "2"]
    before = tree_hash(sentinel(world))
    return with_outside_check(run_in_process("head", argv), world, before, {})
