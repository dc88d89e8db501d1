"""The data: the embedded stdlib corpus, text files, Megatron indexed datasets, and the
sample / micro-batch layout every rank reads."""
import hashlib
import os
import sysconfig

import numpy as np
import pytest
import torch

from llm_act.train import data as D


def test_embedded_corpus_is_the_listed_stdlib_files_with_a_fixed_split():
    c = D.embedded_corpus()
    root = sysconfig.get_paths()["stdlib"]
    read = lambda names: b"".join(open(os.path.join(root, n + ".py"), "rb").read() for n in names)
    train, valid = read(D.STDLIB_TRAIN), read(D.STDLIB_VALID)
    assert c.train.tobytes() == train and c.valid.tobytes() == valid
    assert c.sha256 == hashlib.sha256(train + valid).hexdigest()
    assert c.vocab_size == 256 and len(c.train) > 300_000 and len(c.valid) > 20_000
    assert not set(D.STDLIB_TRAIN) & set(D.STDLIB_VALID)
    assert c.sha256 in c.describe()


def test_samples_are_windows_in_a_seeded_order_redrawn_per_epoch():
    tokens = np.arange(1000, dtype=np.int64)
    s = D.Samples(tokens, seq_length=10, seed=3)
    assert len(s) == 99
    first = [int(s[j][0]) for j in range(len(s))]
    assert sorted(first) == list(range(0, 990, 10))  # every window once per epoch
    assert all((s[j] == np.arange(s[j][0], s[j][0] + 11)).all() for j in range(5))
    second = [int(s[j][0]) for j in range(len(s), 2 * len(s))]
    assert sorted(second) == sorted(first) and second != first
    again = D.Samples(tokens, seq_length=10, seed=3)
    assert [int(again[j][0]) for j in range(len(s))] == first
    other = D.Samples(tokens, seq_length=10, seed=4)
    assert [int(other[j][0]) for j in range(len(s))] != first
    with pytest.raises(ValueError, match="5 training tokens, fewer than one sample of --seq-length 10"):
        D.Samples(tokens[:5], seq_length=10, seed=0)[0]
    with pytest.raises(ValueError, match="0 training tokens"):  # not an IndexError
        D.Samples(tokens[:0], seq_length=10, seed=0)[0]


def test_micro_batches_of_data_parallel_ranks_tile_the_global_batch():
    s = D.Samples(np.arange(5000, dtype=np.int64), seq_length=8, seed=0, shuffle=False)
    seen = []
    for rank in range(2):
        for i in range(3):
            b = D.micro_batch(s, start=12, index=i, micro_batch_size=2, dp_rank=rank, dp_size=2)
            assert b.tokens.shape == b.labels.shape == b.position_ids.shape == (2, 8)
            assert torch.equal(b.labels[:, :-1], b.tokens[:, 1:])
            assert b.loss_mask.dtype == torch.float32 and bool((b.loss_mask == 1).all())
            seen += [int(r[0]) // 8 for r in b.tokens]
    assert sorted(seen) == list(range(12, 24))


def test_text_file_is_bytes_with_the_last_5_percent_for_validation(tmp_path):
    path = tmp_path / "t.txt"
    raw = bytes(range(256)) * 40
    path.write_bytes(raw)
    d = D.load(str(path))
    assert d.vocab_size == 256 and d.sha256 == hashlib.sha256(raw).hexdigest()
    assert d.train.tobytes() + d.valid.tobytes() == raw
    assert len(d.valid) == int(len(raw) * 0.05)


def indexed(prefix, docs):
    """Write `docs` (token arrays) as a Megatron indexed dataset prefix.bin/.idx."""
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder, get_bin_path, get_idx_path

    builder = IndexedDatasetBuilder(get_bin_path(prefix), dtype=np.uint16)
    for doc in docs:
        builder.add_document(doc, [len(doc)])
    builder.finalize(get_idx_path(prefix))
    return prefix


def test_megatron_indexed_dataset(tmp_path):
    prefix = str(tmp_path / "corpus_text_document")
    docs = [np.arange(i, i + 50 + 7 * i) % 1000 for i in range(40)]
    indexed(prefix, docs)
    flat = np.concatenate(docs)
    for path in (prefix, prefix + ".bin", prefix + ".idx"):
        d = D.load(path)
        assert d.vocab_size == int(flat.max()) + 1
        assert np.array_equal(np.concatenate([d.train, d.valid]), flat)
        assert len(d.valid) == sum(len(x) for x in docs[-2:])  # 5% of 40 documents
        assert d.sha256 == hashlib.sha256(open(prefix + ".bin", "rb").read()).hexdigest()


def test_missing_data_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="neither a file nor the prefix"):
        D.load(str(tmp_path / "nothing"))


@pytest.mark.parametrize("lone", [".bin", ".idx"])
def test_half_an_indexed_dataset_is_refused_not_read_as_text(tmp_path, lone):
    prefix = indexed(str(tmp_path / "c"), [np.arange(100)])
    other = ".idx" if lone == ".bin" else ".bin"
    os.remove(prefix + other)
    for given in (prefix + lone, prefix):
        with pytest.raises(FileNotFoundError, match=rf"{prefix}\{other} is missing; a Megatron indexed "
                                                   rf"dataset needs both"):
            D.load(given)


def test_empty_and_corrupt_files_are_clear_errors(tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_bytes(b"")
    with pytest.raises(ValueError, match=rf"--data-path {empty}: the file is empty; expected a text file"):
        D.load(str(empty))
    prefix = indexed(str(tmp_path / "c"), [np.arange(100)])
    good_idx = open(prefix + ".idx", "rb").read()
    open(prefix + ".bin", "wb").close()
    with pytest.raises(ValueError, match=r"c\.bin is empty"):
        D.load(prefix)
    indexed(prefix, [np.arange(100)])
    (tmp_path / "c.idx").write_bytes(b"not an index")
    with pytest.raises(ValueError, match=r"c\.idx does not start with the index header"):
        D.load(prefix)
    (tmp_path / "c.idx").write_bytes(good_idx[:-8])  # truncated: megatron-core's own error, named
    with pytest.raises(ValueError, match=r"cannot read .*c\.bin/\.idx as a Megatron indexed dataset: "):
        D.load(prefix)


def test_data_shorter_than_one_sample_is_refused_up_front(tmp_path):
    path = tmp_path / "short.txt"
    path.write_bytes(b"x" * 70)  # 67 train bytes after the 5% validation cut
    d = D.load(str(path))
    d.check_fits(seq_length=66)
    with pytest.raises(ValueError, match=rf"text file {path} \(bytes\): 67 training tokens, fewer than "
                                         r"one sample of --seq-length 67 \+ 1"):
        d.check_fits(seq_length=67)
