"""data.py: the shipped corpus, the byte tokenizer and seeded batches."""
from importlib import resources

import pytest
import torch

from zero_offload import data
from zero_offload.data import CharCorpus


def test_shipped_corpus_is_package_data_with_its_source():
    root = resources.files("zero_offload").joinpath("data")
    text = root.joinpath(data.DEFAULT_CORPUS).read_text(encoding="utf-8")
    assert 40_000 < len(text.encode()) < 300_000
    assert text.isascii() and text.startswith("First Citizen:")
    source = root.joinpath("SOURCE.md").read_text(encoding="utf-8")
    assert "public domain" in source.lower() and "karpathy/char-rnn" in source


def test_encode_decode_round_trip_whole_corpus():
    corpus = CharCorpus.default()
    assert corpus.tokens.dtype == torch.int64 and corpus.vocab_size == 256
    assert len(corpus) == len(corpus.text.encode())
    assert corpus.decode(corpus.tokens) == corpus.text
    assert data.decode(data.encode("héllo – ☃")) == "héllo – ☃"


def test_decode_replaces_invalid_utf8_and_rejects_out_of_range():
    assert data.decode([104, 0xFF, 105]) == "h\ufffdi"
    with pytest.raises(ValueError, match=r"\[0, 256\)"):
        data.decode([300])


def test_batches_are_shifted_windows_of_the_text():
    corpus = CharCorpus.default()
    x, y = corpus.batch(batch_size=4, seq_len=50, generator=torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (4, 50) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    train_text = corpus.decode(corpus.split("train"))
    for row_x, row_y in zip(x, y):
        window = corpus.decode(torch.cat([row_x, row_y[-1:]]))
        assert window in train_text


def test_batches_are_seeded():
    corpus = CharCorpus.default()
    a = corpus.batch(batch_size=8, seq_len=16, generator=torch.Generator().manual_seed(3))
    b = corpus.batch(batch_size=8, seq_len=16, generator=torch.Generator().manual_seed(3))
    c = corpus.batch(batch_size=8, seq_len=16, generator=torch.Generator().manual_seed(4))
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0], c[0])
    stream = corpus.batches(batch_size=8, seq_len=16, seed=3)
    assert torch.equal(next(stream)[0], a[0])


def test_val_split_is_the_tail():
    corpus = CharCorpus("abcdefghij" * 10, val_fraction=0.2)
    assert corpus.split("train").numel() == 80 and corpus.split("val").numel() == 20
    assert torch.equal(torch.cat([corpus.split("train"), corpus.split("val")]), corpus.tokens)
    x, _ = corpus.batch(batch_size=2, seq_len=19, split="val", generator=torch.Generator().manual_seed(0))
    assert corpus.decode(x[0]) in corpus.text[80:]


def test_bad_arguments_name_the_fix():
    corpus = CharCorpus("short text")
    with pytest.raises(ValueError, match="shorter seq_len"):
        corpus.batch(batch_size=1, seq_len=100)
    with pytest.raises(ValueError, match="batch_size must be a positive int"):
        corpus.batch(batch_size=0, seq_len=2)
    with pytest.raises(ValueError, match="split must be one of"):
        corpus.split("test")
    with pytest.raises(ValueError, match="val_fraction"):
        CharCorpus("abc", val_fraction=1.0)


def test_from_file(tmp_path):
    path = tmp_path / "t.txt"
    path.write_text("to be or not to be\n", encoding="utf-8")
    assert CharCorpus.from_file(path, val_fraction=0.0).text == "to be or not to be\n"
