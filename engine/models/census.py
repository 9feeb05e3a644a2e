"""What a model's weights weigh, read from config.json, safetensors headers or a GGUF header — never the tensors."""
from __future__ import annotations

import json
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ModelLoadError
from engine.models.quant import checkpoint_quantization
from engine.models.gguf import read_gguf_header

# safetensors dtype -> bytes per element
_ST_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
             "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8}
_FLOAT_ST = ("F64", "F32", "F16", "BF16")
_LAYER = re.compile(r"(?:^|\.)(?:layers|blk)\.(\d+)\.")
# Tensors bitsandbytes writes beside a quantized weight: stored as they are, whatever the dtype.
_BNB_SUFFIXES = (".SCB", ".absmax", ".quant_map", ".nested_absmax", ".nested_quant_map", ".weight_format",
                 ".quant_state.bitsandbytes__nf4", ".quant_state.bitsandbytes__fp4")
# Architectures whose parameter count this module can derive from config.json alone.
CONFIG_TYPES = ("qwen2", "qwen3", "llama", "mistral")


@dataclass(frozen=True)
class LayerCensus:
    """One decoder layer's weights, by how quantization treats them."""

    linear_params: int  # weights of the layer's linear modules: what bitsandbytes quantizes
    linear_rows: int  # their output rows summed (LLM.int8 keeps one float32 scale per row)
    linears: int  # how many linear modules (4-bit keeps a small code book per module)
    largest_linear: int  # params of the largest one (a 4-bit verify dequantizes one at a time)
    other_params: int  # norms and biases: they stay in the float dtype
    stored_bytes: int = 0  # an already-quantized checkpoint's quantized tensors, bytes as stored


@dataclass(frozen=True)
class ModelCensus:
    """The shape facts a memory plan needs about one model."""

    name: str  # display name
    model_type: str  # config.json model_type ("qwen2", "llama", ...)
    layers: tuple[LayerCensus, ...]  # one per decoder layer, in order
    embed_params: int  # input embedding
    head_params: int  # output head (0 when tied to the embedding)
    other_params: int  # everything outside the layers besides embedding and head (final norm)
    hidden: int  # residual width
    intermediate: int  # MLP width
    heads: int  # query heads
    kv_heads: int  # key/value heads
    head_dim: int  # width of one head
    vocab: int  # rows of the output head
    max_positions: int  # the model's own context limit
    prequantized: str | None  # "int8"/"nf4"/"fp4"/other method when the checkpoint is quantized already
    source: str  # where the figures come from, said to people: "safetensors headers", "config.json", ...

    @property
    def params(self) -> int:
        """Parameters in float terms (pre-quantized tensors not included)."""
        return (self.embed_params + self.head_params + self.other_params
                + sum(layer.linear_params + layer.other_params for layer in self.layers))

    @property
    def kv_bytes_per_token(self) -> int:
        """Key + value elements one token adds to the cache (multiply by the element size)."""
        return 2 * len(self.layers) * self.kv_heads * self.head_dim


# --------------------------------------------------------------------------- config.json

def _text_config(config: dict) -> dict:
    return config.get("text_config") or config


REQUIRED_SIZES = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")  # each a whole number > 0
OPTIONAL_SIZES = ("num_key_value_heads", "head_dim", "intermediate_size", "max_position_embeddings")  # > 0 if given


def check_sizes(config: object, name: str, *, complete: bool = True) -> None:
    """ModelLoadError naming the first size field of config.json that is missing, not a whole number, or not > 0
    (complete=False: only the fields present are checked).

    Checked where config.json is first read, so a 0 or a negative size is named instead of dividing by it.
    """
    if not isinstance(config, dict):
        raise ModelLoadError(f"config.json of {name} is not a JSON object; it is not a model configuration.")
    c = _text_config(config)
    if not isinstance(c, dict):
        raise ModelLoadError(f"config.json of {name}: text_config is not a JSON object.")
    for key in REQUIRED_SIZES + OPTIONAL_SIZES:
        value = c.get(key)
        if value is None and (key in OPTIONAL_SIZES or not complete):
            continue
        if value is None:
            raise ModelLoadError(f"config.json of {name} has no {key}; it is not a model this app can load.")
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ModelLoadError(f"config.json of {name}: {key} is {str(value)[:40]}; it must be a whole number > 0 "
                                 f"(the file is damaged or hand-edited).")
    if c.get("num_attention_heads") is None or c.get("hidden_size") is None:
        return  # (complete=False: what is there is fine)
    heads, kv = c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    if heads % kv:
        raise ModelLoadError(f"config.json of {name}: num_attention_heads {heads} is not a multiple of "
                             f"num_key_value_heads {kv}.")
    if not c.get("head_dim") and c["hidden_size"] % heads:
        raise ModelLoadError(f"config.json of {name}: hidden_size {c['hidden_size']} is not a multiple of "
                             f"num_attention_heads {heads}.")


def _facts(config: dict) -> dict:
    c = _text_config(config)
    heads = int(c["num_attention_heads"])
    hidden = int(c["hidden_size"])
    return {
        "model_type": str(c.get("model_type") or config.get("model_type") or "unknown"),
        "hidden": hidden,
        "intermediate": int(c.get("intermediate_size") or 0),
        "heads": heads,
        "kv_heads": int(c.get("num_key_value_heads") or heads),
        "head_dim": int(c.get("head_dim") or hidden // heads),
        "vocab": int(c["vocab_size"]),
        "max_positions": int(c.get("max_position_embeddings") or 4096),
        "layers": int(c["num_hidden_layers"]),
        "tied": bool(c.get("tie_word_embeddings", config.get("tie_word_embeddings", False))),
    }


def census_from_config(config: dict, name: str, source: str = "config.json") -> ModelCensus:
    """Exact parameter counts of a Qwen2/Qwen3/Llama/Mistral model from its config.json fields."""
    check_sizes(config, name)
    f = _facts(config)
    c = _text_config(config)
    if f["model_type"] not in CONFIG_TYPES:
        raise ModelLoadError(
            f"Cannot size {name} ({f['model_type']}) from its config alone; the plan needs its weights' "
            f"headers (a local folder, a .gguf file, or a hub model in the local cache)."
        )
    hidden, inter, hd = f["hidden"], f["intermediate"], f["head_dim"]
    q_out, kv_out = f["heads"] * hd, f["kv_heads"] * hd
    shapes = [(q_out, hidden), (kv_out, hidden), (kv_out, hidden), (hidden, q_out),  # q k v o: (out, in)
              (inter, hidden), (inter, hidden), (hidden, inter)]  # gate up down
    bias = 0
    if f["model_type"] == "qwen2":
        bias += q_out + 2 * kv_out  # Qwen2 has q/k/v biases, no o bias
    elif c.get("attention_bias"):
        bias += q_out + 2 * kv_out + hidden
    if c.get("mlp_bias"):
        bias += 2 * inter + hidden
    qk_norms = 2 * hd if f["model_type"] == "qwen3" else 0  # Qwen3: RMSNorm over each q and k head
    layer = LayerCensus(
        linear_params=sum(o * i for o, i in shapes),
        linear_rows=sum(o for o, _ in shapes),
        linears=len(shapes),
        largest_linear=max(o * i for o, i in shapes),
        other_params=2 * hidden + bias + qk_norms,
    )
    vocab = f["vocab"]
    return ModelCensus(
        name=name, model_type=f["model_type"], layers=(layer,) * f["layers"],
        embed_params=vocab * hidden, head_params=0 if f["tied"] else vocab * hidden, other_params=hidden,
        hidden=hidden, intermediate=inter, heads=f["heads"], kv_heads=f["kv_heads"], head_dim=hd, vocab=vocab,
        max_positions=f["max_positions"], prequantized=checkpoint_quantization(config), source=source,
    )


# --------------------------------------------------------------------------- safetensors

def read_safetensors_header(path: Path) -> dict[str, dict]:
    """name -> {"dtype", "shape"} from a .safetensors file's JSON header (8-byte length, then JSON)."""
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            if n > 200 * 2**20:
                raise ValueError(f"header claims {n} bytes")
            header = json.loads(f.read(n))
    except (OSError, ValueError, struct.error, RecursionError) as e:
        raise ModelLoadError(f"{path} is not a readable safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise ModelLoadError(f"{path} is not a readable safetensors file: its header is not a table of tensors")
    header.pop("__metadata__", None)
    for name, entry in header.items():
        if not (isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list)
                and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in entry["shape"])):
            raise ModelLoadError(f"{path} is not a readable safetensors file: tensor {name[:80]!r} has no dtype "
                                 "and shape")
    return header


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            names = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
            return [folder / n for n in names]
        except (OSError, ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise ModelLoadError(f"Could not read {index}: {e}") from None
    # Some repositories also carry a consolidated copy for other runtimes: never count it twice.
    return sorted(p for p in folder.glob("*.safetensors") if not p.name.startswith("consolidated"))


def census_from_folder(folder: Path, name: str) -> ModelCensus:
    """A model folder: config.json facts, parameter counts from its safetensors headers when present."""
    try:
        config = json.loads((folder / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as e:
        raise ModelLoadError(f"Could not read {folder / 'config.json'}: {e}") from None
    check_sizes(config, name)
    files = _weight_files(folder)
    if not files:
        return census_from_config(config, name)  # *.bin or weights not downloaded: the config decides
    tensors: dict[str, dict] = {}
    for path in files:
        tensors.update(read_safetensors_header(path))
    f = _facts(config)
    return _census_from_tensors(
        name, f, {k: (v["dtype"], tuple(v["shape"])) for k, v in tensors.items()},
        checkpoint_quantization(config), "safetensors headers",
    )


def _census_from_tensors(name: str, f: dict, tensors: dict[str, tuple[str, tuple[int, ...]]],
                         prequantized: str | None, source: str, *, gguf: bool = False) -> ModelCensus:
    """Sorts named tensors into embedding, head, per-layer linear/other, and already-quantized bytes."""
    n_layers = f["layers"]
    acc = [{"lp": 0, "rows": 0, "n": 0, "big": 0, "other": 0, "stored": 0} for _ in range(n_layers)]
    embed = head = other = 0
    embed_names = ("token_embd.weight",) if gguf else ()
    head_names = ("output.weight",) if gguf else ()
    for tname, (dtype, shape) in tensors.items():
        numel = 1
        for d in shape:
            numel *= int(d)
        match = _LAYER.search(tname)
        stored = (not gguf) and (tname.endswith(_BNB_SUFFIXES) or dtype not in _FLOAT_ST)
        if match is None or int(match.group(1)) >= n_layers:
            if tname in embed_names or "embed_tokens" in tname:
                embed += numel
            elif tname in head_names or "lm_head" in tname:
                if not f["tied"]:
                    head += numel
            elif stored:
                other += -(-numel * _ST_BYTES.get(dtype, 4) // 2)  # rare: count its bytes as 2-byte params
            else:
                other += numel
            continue
        a = acc[int(match.group(1))]
        if stored:
            a["stored"] += numel * _ST_BYTES.get(dtype, 1)
        elif len(shape) == 2 and tname.endswith(".weight") and "norm" not in tname:
            a["lp"] += numel
            a["rows"] += int(shape[1] if gguf else shape[0])  # GGUF lists dims fastest-first: [in, out]
            a["n"] += 1
            a["big"] = max(a["big"], numel)
        else:
            a["other"] += numel
    layers = tuple(LayerCensus(a["lp"], a["rows"], a["n"], a["big"], a["other"], a["stored"]) for a in acc)
    return ModelCensus(
        name=name, model_type=f["model_type"], layers=layers, embed_params=embed, head_params=head,
        other_params=other, hidden=f["hidden"], intermediate=f["intermediate"], heads=f["heads"],
        kv_heads=f["kv_heads"], head_dim=f["head_dim"], vocab=f["vocab"], max_positions=f["max_positions"],
        prequantized=prequantized, source=source,
    )


# --------------------------------------------------------------------------- GGUF

def census_from_gguf(path: Path, name: str) -> ModelCensus:
    """A .gguf file: shapes from its header; the weights load dequantized, so every tensor counts as float."""
    header = read_gguf_header(path)
    fields = header.fields
    arch = str(fields.get("general.architecture", "llama"))

    def field(key: str, default: int | None = None) -> int:
        value = fields.get(f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"{path} has no {arch}.{key} in its GGUF header; it cannot be planned.")
        return int(value)

    heads = field("attention.head_count")
    hidden = field("embedding_length")
    embd = header.tensor_shapes.get("token_embd.weight") or (hidden, 0)
    f = {
        "model_type": arch, "hidden": hidden, "intermediate": field("feed_forward_length", 0), "heads": heads,
        "kv_heads": field("attention.head_count_kv", heads), "head_dim": field("attention.key_length", hidden // heads),
        "vocab": int((header.tensor_shapes.get("output.weight") or embd)[-1]),
        "max_positions": field("context_length", 4096), "layers": field("block_count"),
        "tied": "output.weight" not in header.tensor_shapes,
    }
    tensors = {k: ("F32", v) for k, v in header.tensor_shapes.items()}
    return _census_from_tensors(name, f, tensors, None, "GGUF header", gguf=True)
