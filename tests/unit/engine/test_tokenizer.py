"""Tokenizer wrapper: encode like transformers, UTF-8-safe streaming detokenization."""

from __future__ import annotations

from pathlib import Path

import pytest

from vocabulary.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir: Path) -> Tokenizer:
    return Tokenizer.from_model_dir(tiny_model_dir)


def test_encode_adds_bos_like_the_post_processor(tokenizer: Tokenizer) -> None:
    ids = tokenizer.encode("Hello world")
    assert ids[0] == 0  # <|begin_of_text|>
    assert ids[1:] == tokenizer.encode("Hello world", add_special_tokens=False)
    assert tokenizer.decode(ids) == "Hello world"


def test_encode_matches_transformers(tokenizer: Tokenizer, tiny_model_dir: Path) -> None:
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(str(tiny_model_dir))
    for text in ["Hello world", "héllo ✓ 日本語", "  two  spaces", ""]:
        assert tokenizer.encode(text) == hf(text)["input_ids"]


def test_eos_ids_and_vocab_come_from_the_checkpoint(tokenizer: Tokenizer) -> None:
    assert tokenizer.eos_token_ids == (1,)
    assert tokenizer.vocab_size == 512


def test_detokenizer_holds_back_incomplete_characters(tokenizer: Tokenizer) -> None:
    text = "é✓日"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = tokenizer.detokenizer(tokenizer.encode("context"))
    deltas = [detok.push(t) for t in ids]
    assert "".join(deltas) == text
    assert all(d in ("", "é", "✓", "日") for d in deltas)  # never a partial character
    assert deltas.count("") == len(ids) - 3


def test_detokenizer_skips_special_tokens(tokenizer: Tokenizer) -> None:
    detok = tokenizer.detokenizer()
    ids = [*tokenizer.encode("ab"), 1]  # BOS, a, b, EOS
    assert [detok.push(t) for t in ids] == ["", "a", "b", ""]


def test_detokenizer_text_after_a_long_prompt_equals_decoding_it_whole(
    tokenizer: Tokenizer,
) -> None:
    from deploy.checkpoints.checkpoint_files import CORPUS

    ids = tokenizer.encode(CORPUS.read_text(), add_special_tokens=False)
    prompt, out = ids[:600], ids[600:900]
    detok = tokenizer.detokenizer(prompt)  # keeps only the prompt's last tokens as context
    got = "".join(detok.push(t) for t in out)
    whole, head = tokenizer.decode(prompt + out), tokenizer.decode(prompt)
    assert whole.startswith(head) and got == whole[len(head) :]


def test_ids_the_tokenizer_does_not_know_have_no_text_and_stall_nothing(
    tokenizer: Tokenizer,
) -> None:
    detok = tokenizer.detokenizer(tokenizer.encode("The"))
    unknown = [tokenizer.vocab_size, tokenizer.vocab_size + 7, 128255]
    assert [detok.push(t) for t in unknown] == ["", "", ""]
    rest = tokenizer.encode(" river runs", add_special_tokens=False)
    assert "".join(detok.push(t) for t in rest) == " river runs"
