"""The test models' own helpers: the word-level tokenizer the OpenAI-server tests send
text through must give one token per word, special tokens included."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from transformers import AutoTokenizer

from tests.support.tiny_models import write_word_tokenizer


def test_the_word_tokenizer_gives_one_token_per_word(tmp_path):
    """``t12`` is token 12, not bos (``t1``) and an unknown ``2``; a word outside the
    vocabulary is one unknown token (``t0``)."""
    write_word_tokenizer(str(tmp_path))
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    words = "t12 t1 t5 t100 t2 t19263 hello t511"
    assert tokenizer(words, add_special_tokens=False).input_ids == [12, 1, 5, 100, 2, 0, 0, 511]
    assert tokenizer.decode([12, 1, 300]).split() == ["t12", "t1", "t300"]
