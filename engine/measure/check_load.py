"""Draft candidates for the check: found (read-only) in a folder or the local Hugging Face cache, checked for the
target's tokenizer before any weights load, then loaded beside the engine's target and their cost measured."""
from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.decoding.proposers import DraftModelProposer, measure_proposer
from engine.errors import EngineError, ModelLoadError
from engine.measure.check_types import CandidateCheck
from engine.models.census import census_from_config
from engine.models.store import gguf_file, resolve_source
from engine.models.tokenizers import check_compatible, tokenizer_info
from engine.runners.llamacpp import LlamaCppRunner
from engine.types import ProposerCost, Sampling

log = logging.getLogger(__name__)

WEIGHTS = ("*.safetensors", "pytorch_model*.bin")
SAMPLED = Sampling(temperature=1.0)  # what a sampled draft's cost is measured with (costs.SAMPLED)


@dataclass(frozen=True)
class DraftUnderTest:
    """A loaded draft model the check compares with the target."""

    name: str  # display name
    runner: object  # its Runner (engine.runners): forward / prefill / reset
    vocab: int  # rows compared: the vocabulary it shares with the target
    params: int  # its parameters (0: unknown)
    cost: ProposerCost | None  # one greedy draft token, measured on this machine (None: not measured)
    sampled_cost: ProposerCost | None = None  # the same when it draws its drafts (temperature > 0)
    holder: object = None  # whatever keeps its weights alive (an Engine of its own on torch)
    spec: str = ""  # where it was loaded from ("" for the engine's own draft)


def params_of(runner, model: torch.nn.Module | None = None) -> int:
    """Parameters of a torch model, or of a llama.cpp runner's model; 0 when neither says.

    A torch model's count comes from its config: weights packed for the CPU fast path or held as
    8-bit buffers are no longer parameters (counting those gave a 0.5B draft as "0.1B").
    """
    if model is not None:
        config = getattr(model, "config", None)
        try:
            return census_from_config(config.to_dict(), "model").params
        except (ModelLoadError, AttributeError, KeyError, TypeError, ValueError):  # a config the census does not know
            return sum(p.numel() for p in model.parameters())
    lib, handle = getattr(runner, "_lib", None), getattr(runner, "model_handle", None)
    return int(lib.llama_model_n_params(handle)) if lib is not None and handle is not None else 0


def hf_cache() -> Path:
    """Where Hugging Face keeps downloaded models here (HF_HUB_CACHE, HF_HOME/hub, or ~/.cache/huggingface/hub)."""
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface"))
    return home / "hub"


def _model_folder(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(next(folder.glob(w), None) for w in WEIGHTS)


def find_candidates(folder: Path, depth: int = 4) -> list[str]:
    """Model folders (config.json and weights) and .gguf files under `folder`, read-only, nothing downloaded.
    A Hugging Face cache (models--org--name/snapshots/REV) gives each model's newest snapshot once."""
    found: list[str] = []
    if not folder.is_dir():
        return found
    snapshots = sorted(folder.glob("models--*/snapshots"))
    for snap in snapshots:
        revisions = sorted((p for p in snap.iterdir() if _model_folder(p)), key=lambda p: p.stat().st_mtime)
        found += [str(revisions[-1])] if revisions else []
    if snapshots:
        return found
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        if len(here.relative_to(folder).parts) >= depth:
            dirs[:] = []
        if _model_folder(here):
            found.append(str(here))
            dirs[:] = []
            continue
        found += [str(here / f) for f in sorted(files) if f.endswith(".gguf")]
        dirs.sort()
    return found


def tokenizer_refusal(target_spec: str | None, draft_spec: str) -> tuple[str | None, int, str]:
    """(why the draft cannot draft for the target, or None; the shared vocabulary; the draft's name).
    The message names both vocabularies (store.check_compatible); read without loading weights."""

    name = resolve_source(draft_spec, "draft").name
    try:
        shared = check_compatible(tokenizer_info(target_spec, "target"), tokenizer_info(draft_spec, "draft"))
    except EngineError as e:
        return str(e), 0, name
    return None, shared, name


def refused(name: str, reason: str, spec: str = "") -> CandidateCheck:
    return CandidateCheck(name=name, kind="draft", status="refused", reason=reason, spec=spec)


def measure_draft(runner, vocab: int, device: torch.device) -> tuple[ProposerCost, ProposerCost]:
    """Its greedy and sampled cost per token through its own propose(), as the engine measures its draft at load."""
    prompt = [(7 * i) % max(vocab - 1, 1) + 1 for i in range(24)]
    iters = 5 if device.type == "cuda" else 3
    greedy = measure_proposer(DraftModelProposer(runner, Sampling(), vocab, None), "draft", prompt, device, iters=iters)
    generator = torch.Generator(device=device).manual_seed(0)
    sampled = measure_proposer(DraftModelProposer(runner, SAMPLED, vocab, generator), "draft", prompt, device,
                               iters=iters)
    return greedy, sampled


def engine_draft(engine) -> DraftUnderTest | None:
    """The engine's own draft with the costs it measured at load."""
    if engine.draft_runner is None:
        return None
    costs = {c.source: c for c in engine.info.proposer_costs}
    sampled = {c.source: c for c in engine.info.sampled_costs}
    return DraftUnderTest(engine.info.draft_name or "draft", engine.draft_runner, engine.vocab,
                          params_of(engine.draft_runner, engine.draft), costs.get("draft"), sampled.get("draft"))


def load_drafts(engine, target_spec: str | None, specs: Sequence[str],
                progress: Callable[[float, str], None] | None = None,
                load_torch: Callable[[str], object] | None = None) -> tuple[list[DraftUnderTest], list[CandidateCheck]]:
    """Each spec checked against the target's tokenizer, then loaded on the engine's runtime and its cost measured.

    load_torch(spec) -> an Engine holding that model as its target (the torch runtime: the CLI's and the
    app's own loader, with their options); None refuses model folders on torch. Refusals come back as rows.
    """
    loaded, refusals = [], []
    for n, spec in enumerate(dict.fromkeys(specs)):
        reason, shared, name = tokenizer_refusal(target_spec, spec)
        if progress is not None:
            progress(n / max(len(specs), 1), f"Loading draft {name}")
        if reason is not None:
            refusals.append(refused(name, reason, spec))
            continue
        try:
            loaded.append(_load_one(engine, spec, name, shared, load_torch))
        except EngineError as e:
            refusals.append(refused(name, str(e).splitlines()[0], spec))
    return loaded, refusals


def _load_one(engine, spec: str, name: str, shared: int, load_torch) -> DraftUnderTest:

    source = resolve_source(spec, "draft")
    if engine.info.runtime == "llamacpp":
        if source.kind not in ("gguf", "default"):
            raise EngineError(f"{name} is a model folder; the llama.cpp runtime checks .gguf drafts "
                              "(run the check with --runtime torch for folders).")
        runner = LlamaCppRunner(gguf_file(source), threads=engine.info.threads or None,
                                batch_threads=engine.info.threads_batch or None, label=name)
        holder, model = runner, None
    else:
        if load_torch is None:
            raise EngineError(f"{name} cannot be loaded here.")
        holder = load_torch(spec)
        runner, model = holder.target_runner, holder.target
    vocab = min(shared or engine.vocab, engine.vocab, runner.vocab_size)
    greedy, sampled = measure_draft(runner, vocab, engine.device)
    return DraftUnderTest(name, runner, vocab, params_of(runner, model), greedy, sampled, holder, spec)
