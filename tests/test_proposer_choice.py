"""The proposer choice is a typed value: the settings' and the CLI's words become it once, at the request."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from engine.errors import GenerationError
from engine.types import PROPOSERS, GenerationRequest, ProposerChoice


def test_a_word_becomes_a_choice_with_its_kinds():
    request = GenerationRequest(prompt="x", proposer="draft+ngram")
    assert request.proposer is ProposerChoice.DRAFT_NGRAM and request.proposer.kinds == ("draft", "ngram")
    assert replace(request, proposer="head").proposer.kinds == ("head",)
    assert request.proposer == "draft+ngram" and json.dumps(request.proposer) == '"draft+ngram"'  # still its word
    assert [ProposerChoice(p).kinds for p in PROPOSERS] == [("draft",), ("ngram",), ("draft", "ngram"), ("head",)]


def test_an_unknown_proposer_is_one_clear_line():
    with pytest.raises(GenerationError, match="Unknown proposer 'eagle'") as err:
        GenerationRequest(prompt="x", proposer="eagle")  # type: ignore[arg-type]
    assert "\n" not in str(err.value)
