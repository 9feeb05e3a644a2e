"""config.json with a zero, negative or missing size: the field is named in one line, where the config is read."""
from __future__ import annotations

import json
import shutil

import pytest

from app.cli import main
from engine.errors import ModelLoadError
from engine.models.census import census_from_config, check_sizes


def _bad_copy(src, dst, **changes):
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text(encoding="utf-8"))
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config), encoding="utf-8")
    return dst


@pytest.mark.parametrize("field,value", [("num_attention_heads", 0), ("hidden_size", 0), ("num_attention_heads", -4),
                                         ("num_key_value_heads", 0), ("num_hidden_layers", -1), ("vocab_size", 0),
                                         ("head_dim", -64), ("hidden_size", "64"), ("num_attention_heads", 2.5),
                                         ("hidden_size", None)])
def test_generate_names_the_bad_field(tiny_pair, tmp_path, capsys, field, value):
    bad = _bad_copy(tiny_pair[0], tmp_path / "bad", **{field: value})
    code = main(["generate", "--target", str(bad), "--draft", str(tiny_pair[1]), "--device", "cpu",
                 "--prompt", "hi", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1, err
    assert field in err and "internal error" not in err


def test_the_plan_names_it_too():
    config = {"model_type": "qwen2", "hidden_size": 64, "num_attention_heads": 0, "num_hidden_layers": 2,
              "vocab_size": 320}
    with pytest.raises(ModelLoadError, match="num_attention_heads is 0"):
        census_from_config(config, "tiny")
    with pytest.raises(ModelLoadError, match="not a multiple"):
        check_sizes({**config, "num_attention_heads": 3}, "tiny")


def test_a_folder_with_config_but_no_weights_says_so(tiny_pair, tmp_path, capsys):
    folder = tmp_path / "config-only"
    folder.mkdir()
    shutil.copy(tiny_pair[0] / "config.json", folder / "config.json")
    code = main(["generate", "--target", str(folder), "--draft", str(tiny_pair[1]), "--device", "cpu",
                 "--prompt", "hi", "--max-new-tokens", "2"])
    err = capsys.readouterr().err
    assert code == 2 and "no weights" in err and "differ" not in err
