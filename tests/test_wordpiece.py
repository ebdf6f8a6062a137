"""The native WordPiece encoder against Hugging Face `tokenizers` itself: the same ids for every
text, whether the encoder takes the text or hands it back, for the real all-MiniLM tokenizer and
for other BERT configurations; tokenizers of another shape are left to the reference."""

from __future__ import annotations

import random
import threading
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
from tokenizers import Tokenizer, normalizers, pre_tokenizers, processors
from tokenizers.models import WordPiece

from fabric_gpu.model import DEFAULT_MODEL_ID, load_tokenizer, resolve_model_dir
from fabric_gpu.tokenise import encode_texts
from fabric_gpu.wordpiece import NativeWordPiece, merge_handed_back


@pytest.fixture(scope="module")
def minilm() -> Tokenizer:
    return load_tokenizer(resolve_model_dir(DEFAULT_MODEL_ID))


def _reference(tokenizer: Tokenizer, texts: list[str]) -> list[list[int]]:
    return [e.ids for e in tokenizer.encode_batch(texts, add_special_tokens=True)]


def _split(lengths: np.ndarray, tokens: np.ndarray) -> list[list[int]]:
    ends = np.cumsum(lengths)
    return [
        tokens[end - n : end].tolist()
        for n, end in zip(lengths.tolist(), ends.tolist(), strict=True)
    ]


def _fuzz_texts(tokenizer: Tokenizer, n: int, seed: int = 0) -> list[str]:
    """Every ASCII byte, vocabulary words in any case, punctuation runs, the special tokens'
    spellings, words past the length limit, and Unicode that must be handed back."""
    rng = random.Random(seed)
    words = [w for w in tokenizer.get_vocab() if not w.startswith("[")]
    ascii_chars = [chr(i) for i in range(128)]
    texts = []
    for i in range(n):
        kind = i % 6
        if kind == 0:
            texts.append("".join(rng.choice(ascii_chars) for _ in range(rng.randint(0, 80))))
        elif kind == 1:
            texts.append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 30))))
        elif kind == 2:
            pool = "abcXYZ019 .,#[]-'\t\n\r\x0b\x0c\x1c\x1f\x7f\x00"
            texts.append("".join(rng.choice(pool) for _ in range(rng.randint(0, 200))))
        elif kind == 3:
            texts.append(
                rng.choice(
                    [
                        "[MASK] is hidden", "[CLS]", "a[SEP]b", "[pad] lower", "naïve café",
                        "日本語 text", "x" * 100, "x" * 101, "Hello, World!", "", "   ",
                        "ab\x01cd", "\u00a0nbsp", "e\u0301", "don't stop-believing...",
                    ]
                )
            )  # fmt: skip
        elif kind == 4:
            texts.append(
                "".join(
                    rng.choice(words).capitalize() + rng.choice(["", "-", "'s", ".", "  ", "\n"])
                    for _ in range(rng.randint(1, 20))
                )
            )
        else:
            texts.append("".join(rng.choice(words) for _ in range(rng.randint(1, 6))))
    return texts


SPECIALS = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")  # all-MiniLM's added tokens


def _handed_back(text: str) -> bool:
    return not text.isascii() or any(special in text for special in SPECIALS)


def test_every_text_gets_the_reference_tokenizers_ids(minilm: Tokenizer) -> None:
    texts = _fuzz_texts(minilm, 30_000)
    native = NativeWordPiece.of(minilm)
    assert native is not None
    found = native.encode(texts)
    assert found is not None
    lengths, tokens = found
    back = np.flatnonzero(lengths < 0)
    # Most texts are the native encoder's; Unicode and "[MASK]" are handed back, not guessed.
    assert 0 < len(back) < len(texts) // 2
    assert [int(i) for i in back] == [i for i, t in enumerate(texts) if _handed_back(t)]
    back_ids = _reference(minilm, [texts[i] for i in back.tolist()])
    merged_lengths, merged = merge_handed_back(
        lengths, tokens, back,
        np.array([len(ids) for ids in back_ids], dtype=np.int64),
        np.array([i for ids in back_ids for i in ids], dtype=np.int32),
    )  # fmt: skip
    assert _split(merged_lengths, merged) == _reference(minilm, texts)


def test_ingest_encodes_arrow_and_list_texts_as_the_reference_does(
    minilm: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Natively, but for the texts handed back: only those reach the reference tokenizer."""
    from fabric_gpu import tokenise

    texts = _fuzz_texts(minilm, 5_000, seed=1)
    expected = _reference(minilm, texts)
    reference = tokenise._encode_reference
    given_to_reference: list[int] = []

    def counted(tokenizer: Tokenizer, chosen: Any, bar: Any) -> Any:
        given_to_reference.append(len(chosen))
        return reference(tokenizer, chosen, bar)

    monkeypatch.setattr(tokenise, "_encode_reference", counted)
    for given in (texts, pa.array(texts, pa.string()), pa.array(texts, pa.large_string())[7:]):
        given_to_reference.clear()
        lengths, tokens, refused = encode_texts(minilm, given)
        assert refused == {}
        assert _split(lengths, tokens) == expected[-len(given) :]
        handed_back = sum(_handed_back(t) for t in texts[-len(given) :])
        assert given_to_reference == [handed_back] and 0 < handed_back < len(given) // 2


def test_texts_all_handed_back_give_empty_native_arrays(minilm: Tokenizer) -> None:
    native = NativeWordPiece.of(minilm)
    assert native is not None
    found = native.encode(["naïve", "日本語"])
    assert found is not None
    lengths, tokens = found
    assert lengths.tolist() == [-1, -1] and tokens.dtype == np.int32 and len(tokens) == 0
    lengths, tokens, _ = encode_texts(minilm, ["naïve"])
    assert _split(lengths, tokens) == _reference(minilm, ["naïve"])


def test_texts_arrow_cannot_hold_go_to_the_reference(minilm: Tokenizer) -> None:
    texts = ["plain words", "a lone \ud800 surrogate", "more words"]
    native = NativeWordPiece.of(minilm)
    assert native is not None
    assert native.encode(texts) is None
    lengths, _, refused = encode_texts(minilm, texts)
    assert len(lengths) == 3 and lengths[0] == len(_reference(minilm, ["plain words"])[0])
    assert list(refused) == [1] and "could not be tokenised" in refused[1]


def test_no_texts(minilm: Tokenizer) -> None:
    lengths, tokens, refused = encode_texts(minilm, pa.array([], pa.string()))
    assert len(lengths) == 0 and len(tokens) == 0 and refused == {}


def _bert_like(
    lowercase: bool = True,
    prefix: str = "##",
    processor: processors.PostProcessor | None = None,
    normalizer: normalizers.Normalizer | None = None,
    pre_tokenizer: pre_tokenizers.PreTokenizer | None = None,
) -> Tokenizer:
    vocab = {"[UNK]": 0, "[CLS]": 1, "[SEP]": 2, "[MASK]": 3}
    for piece in [
        "the",
        "The",
        "cat",
        "Cat",
        "sat",
        "##s",
        "##ed",
        "on",
        "mat",
        ".",
        ",",
        "!",
        "un",
        "##believ",
        "##able",
    ]:
        vocab.setdefault(piece, len(vocab))
    vocab = {(p.replace("##", prefix, 1) if p.startswith("##") else p): i for p, i in vocab.items()}
    tokenizer = Tokenizer(
        WordPiece(
            vocab, unk_token="[UNK]", max_input_chars_per_word=12, continuing_subword_prefix=prefix
        )
    )
    tokenizer.normalizer = normalizer or normalizers.BertNormalizer(lowercase=lowercase)
    tokenizer.pre_tokenizer = pre_tokenizer or pre_tokenizers.BertPreTokenizer()
    if processor is not None:
        tokenizer.post_processor = processor
    tokenizer.add_special_tokens(["[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    return tokenizer


@pytest.mark.parametrize(
    "tokenizer",
    [
        _bert_like(),
        _bert_like(lowercase=False),
        _bert_like(prefix=""),
        _bert_like(prefix="@@"),
        _bert_like(processor=processors.BertProcessing(("[SEP]", 2), ("[CLS]", 1))),
        _bert_like(processor=processors.TemplateProcessing(single="[CLS] [CLS] $A [SEP]", special_tokens=[("[CLS]", 1), ("[SEP]", 2)])),
    ],
    ids=["lowercase-no-specials", "cased", "no-prefix", "other-prefix", "bert-processing", "template"],
)  # fmt: skip
def test_other_bert_configurations_match_the_reference(tokenizer: Tokenizer) -> None:
    texts = [
        "The cat sat on the mat.", "THE CATS SAT, unbelievable!", "Cats catsed unbelievablebelievable",
        "averyveryverylongword the", "x[MASK]y", "", "cat\tsat\x0bon", "the,,, cat !!",
    ]  # fmt: skip
    native = NativeWordPiece.of(tokenizer)
    assert native is not None
    lengths, tokens, refused = encode_texts(tokenizer, texts)
    assert refused == {}
    assert _split(lengths, tokens) == _reference(tokenizer, texts)


@pytest.mark.parametrize(
    "tokenizer",
    [
        _bert_like(normalizer=normalizers.Sequence([normalizers.NFKC(), normalizers.Lowercase()])),
        _bert_like(pre_tokenizer=pre_tokenizers.Whitespace()),
        _bert_like(processor=processors.ByteLevel()),
    ],
    ids=["other-normalizer", "other-pre-tokenizer", "other-post-processor"],
)
def test_tokenizers_of_another_shape_are_left_to_the_reference(tokenizer: Tokenizer) -> None:
    assert NativeWordPiece.of(tokenizer) is None
    texts = ["The cat sat on the mat.", "unbelievable, cats!"]
    lengths, tokens, _ = encode_texts(tokenizer, texts)
    assert _split(lengths, tokens) == _reference(tokenizer, texts)


def test_a_tokenizer_that_truncates_is_left_to_the_reference(minilm: Tokenizer) -> None:
    truncating = Tokenizer.from_str(minilm.to_str())
    truncating.enable_truncation(8)
    assert NativeWordPiece.of(truncating) is None


def test_two_threads_encode_with_one_encoder_at_once(minilm: Tokenizer) -> None:
    native = NativeWordPiece.of(minilm)
    assert native is not None
    texts = [t for t in _fuzz_texts(minilm, 20_000, seed=2) if t.isascii() and "[" not in t]
    expected = _reference(minilm, texts)
    results: dict[int, list[list[int]]] = {}
    start = threading.Barrier(2)

    def encode(which: int) -> None:
        start.wait()
        found = native.encode(texts)
        assert found is not None
        results[which] = _split(*found)

    threads = [threading.Thread(target=encode, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results[0] == expected and results[1] == expected


def test_bad_offsets_are_refused_with_the_text_named(minilm: Tokenizer) -> None:
    from fabric_gpu import _wordpiece

    encoder = _wordpiece.Encoder(list(minilm.get_vocab().items()), "##", 100, 100, True, [], [], [])
    data = np.frombuffer(b"abcdef", dtype=np.uint8)
    with pytest.raises(ValueError, match="text 1"):
        encoder.encode(np.array([0, 4, 2], dtype=np.int64), data)
    with pytest.raises(ValueError, match="past the end"):
        encoder.encode(np.array([0, 9], dtype=np.int64), data)
