"""Named model pairs (assets/presets): hub ids with their config.json fields, so plans work offline."""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path

from engine.errors import ModelLoadError
from engine.settings import ModelChoice, PairPreset

log = logging.getLogger(__name__)

PACKAGED = "packaged:"  # model ids of the packaged default pair ("packaged:target", "packaged:draft")


@dataclass(frozen=True)
class PresetModel:
    """One model of a preset."""

    id: str  # hub id ("Qwen/Qwen3-32B") or "packaged:target" / "packaged:draft"
    name: str  # display name
    config: dict = field(compare=False, repr=False)  # the config.json fields a plan needs

    @property
    def packaged(self) -> bool:
        return self.id.startswith(PACKAGED)

    @property
    def spec(self) -> str | None:
        """What engine.models.store.resolve_source takes: None for the packaged default, else the hub id."""
        return None if self.packaged else self.id


@dataclass(frozen=True)
class Preset:
    """A named target/draft pair."""

    name: str  # what --preset takes, e.g. "qwen3-32b"
    title: str  # what a person reads in a menu
    target: PresetModel  # the model whose output is produced
    draft: PresetModel  # the proposer

    @property
    def offline(self) -> bool:
        """True when it needs no download (the packaged pair)."""
        return self.target.packaged and self.draft.packaged


def _assets() -> resources.abc.Traversable:
    return resources.files("assets").joinpath("presets")


@lru_cache(maxsize=1)
def _models() -> dict[str, PresetModel]:
    out = {}
    for entry in _assets().joinpath("models").iterdir():
        if entry.name.endswith(".json"):
            raw = json.loads(entry.read_text(encoding="utf-8"))
            out[raw["id"]] = PresetModel(raw["id"], raw["name"], raw["config"])
    return out


@lru_cache(maxsize=1)
def presets() -> tuple[Preset, ...]:
    """Every preset, in menu order (the packaged default first)."""
    raw = json.loads(_assets().joinpath("pairs.json").read_text(encoding="utf-8"))
    models = _models()
    return tuple(Preset(p["name"], p["title"], models[p["target"]], models[p["draft"]]) for p in raw["presets"])


def preset(name: str) -> Preset:
    """The preset called `name`; a ModelLoadError lists the names there are."""
    for p in presets():
        if p.name == name.strip().lower():
            return p
    raise ModelLoadError(f"Unknown preset {name!r}: choose one of {', '.join(p.name for p in presets())}.")


def preset_model(model_id: str) -> PresetModel | None:
    """The shipped config of a hub id (or "packaged:<role>") when a preset names it."""
    return _models().get(model_id)


def packaged(role: str) -> PresetModel:
    return _models()[PACKAGED + role]


def other_drafts(target_id: str, draft_id: str | None) -> tuple[PresetModel, ...]:
    """Drafts that presets pair with this target, smallest first, the current one left out."""
    found = {p.draft.id: p.draft for p in presets() if p.target.id == target_id and p.draft.id != draft_id}

    def size(m: PresetModel) -> int:
        c = m.config
        return int(c["hidden_size"]) * int(c["num_hidden_layers"])

    return tuple(sorted(found.values(), key=size))


def pair_presets() -> tuple[PairPreset, ...]:
    """The presets as the Models dialog shows them."""

    def choice(m: PresetModel) -> ModelChoice:
        return ModelChoice() if m.packaged else ModelChoice("hub", m.id)

    return tuple(PairPreset(p.name, p.title, choice(p.target), choice(p.draft), p.offline) for p in presets())


# --------------------------------------------------------------------------- local hub cache

def cached_snapshot(repo_id: str) -> Path | None:
    """The local Hugging Face cache folder of `repo_id` when its config.json is there (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    try:
        path = try_to_load_from_cache(repo_id, "config.json")
    except Exception as e:  # a malformed id or an unreadable cache: not cached, as far as we can tell
        log.debug("hub cache lookup for %s failed: %s", repo_id, e)
        return None
    return Path(path).parent if isinstance(path, str) else None


def weights_cached(folder: Path) -> bool:
    """True when every safetensors shard the snapshot's index names (or a single file) is present."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError):
            return False
        return all((folder / s).is_file() for s in shards)
    return (folder / "model.safetensors").is_file()


def hub_availability(repo_id: str) -> str:
    """'cached' (weights in the local cache), 'config' (only its config there) or 'missing'."""
    folder = cached_snapshot(repo_id)
    if folder is None:
        return "missing"
    return "cached" if weights_cached(folder) else "config"


def offline_message(repo_id: str) -> str:
    """What a person reads when a hub model is needed without network."""
    return (f"{repo_id} is not in the local Hugging Face cache and there is no network to download it: "
            f"run `huggingface-cli download {repo_id}` on a connected machine (or copy its cache folder), "
            f"or use the packaged default pair, which works offline.")
