"""Training data: token streams, fixed-length samples, and each rank's micro-batches.

The default corpus needs no download: the bytes of a fixed list of Python standard
library modules (present and stable on 3.10-3.13), read from this interpreter's own
stdlib directory, byte-level (vocabulary 256). Two of the files are the validation split.
The corpus's sha256 is printed at start, so runs on different Pythons can tell whether
they saw the same bytes. `--data-path` reads a text file (byte-level; the last 5% of its
bytes are validation) or a Megatron indexed dataset (prefix.bin/.idx, read with
megatron-core's own `IndexedDataset`; the last 5% of its documents are validation).

Samples are windows of seq_length + 1 tokens with stride seq_length (consecutive samples
share one token, as in Megatron's GPT dataset), visited in a seeded random order that is
redrawn each epoch. A sample is identified by its position in that endless order, so the
data position of a run is one integer (the number of samples consumed), saved in
checkpoints. Within a global batch, micro-batch i of data-parallel rank r takes the
samples start + (i * dp + r) * mbs ... + mbs, as Megatron's pretraining sampler does.
Every rank reads its batches itself (tensor- and pipeline-parallel peers read the same).
"""
from __future__ import annotations

import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

#: The embedded corpus: stdlib modules, in this order. The last two are the validation split.
STDLIB_TRAIN = (
    "argparse", "base64", "bisect", "calendar", "colorsys", "contextlib", "copy", "csv",
    "dataclasses", "difflib", "fnmatch", "fractions", "functools", "glob", "heapq",
    "statistics", "string", "queue", "weakref", "gettext",
)
STDLIB_VALID = ("textwrap", "shlex")
BYTE_VOCAB = 256
VALID_FRACTION = 0.05


@dataclass
class TokenData:
    """A train and a validation token stream (1-D integer arrays) and what they are."""

    train: np.ndarray
    valid: np.ndarray
    vocab_size: int
    name: str
    sha256: str

    def check_fits(self, seq_length: int) -> None:
        """Refuse data too short for one training sample up front, before a model is built
        (the samples would otherwise fail at the first batch)."""
        if len(self.train) < seq_length + 1:
            raise ValueError(f"data: {self.name}: {too_short(len(self.train), seq_length)}")

    def describe(self) -> str:
        return (f"data: {self.name}; {len(self.train):,} train / {len(self.valid):,} validation "
                f"tokens, vocab {self.vocab_size}, sha256 {self.sha256}")


def too_short(n_tokens: int, seq_length: int) -> str:
    return (f"{n_tokens} training tokens, fewer than one sample of --seq-length {seq_length} + 1; "
            f"give a longer --data-path or a smaller --seq-length")


def embedded_corpus() -> TokenData:
    """The stdlib byte corpus (see the module docstring)."""
    root = sysconfig.get_paths()["stdlib"]
    parts = {}
    for name in STDLIB_TRAIN + STDLIB_VALID:
        path = os.path.join(root, name + ".py")
        try:
            with open(path, "rb") as f:
                parts[name] = f.read()
        except OSError as err:
            raise FileNotFoundError(
                f"the embedded corpus needs the standard library source {path} ({err.strerror}); "
                "this Python ships without stdlib sources: pass --data-path FILE instead"
            ) from None
    digest = hashlib.sha256()
    for name in STDLIB_TRAIN + STDLIB_VALID:
        digest.update(parts[name])
    train = np.frombuffer(b"".join(parts[n] for n in STDLIB_TRAIN), dtype=np.uint8)
    valid = np.frombuffer(b"".join(parts[n] for n in STDLIB_VALID), dtype=np.uint8)
    return TokenData(train, valid, BYTE_VOCAB,
                     f"embedded stdlib corpus ({len(STDLIB_TRAIN)} + {len(STDLIB_VALID)} modules of "
                     f"Python {sysconfig.get_python_version()})", digest.hexdigest())


def text_file(path: str) -> TokenData:
    """A text (any) file as bytes; the last 5% of its bytes are validation."""
    with open(path, "rb") as f:
        raw = f.read()
    if not raw:
        raise ValueError(f"--data-path {path}: the file is empty; expected a text file (read as "
                         f"bytes) or a Megatron indexed dataset (prefix.bin + prefix.idx)")
    tokens = np.frombuffer(raw, dtype=np.uint8)
    cut = len(tokens) - int(len(tokens) * VALID_FRACTION)
    return TokenData(tokens[:cut], tokens[cut:], BYTE_VOCAB, f"text file {path} (bytes)",
                     hashlib.sha256(raw).hexdigest())


def _file_sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            digest.update(chunk)
    return digest.hexdigest()


def indexed_dataset(prefix: str) -> TokenData:
    """A Megatron indexed dataset: megatron-core's reader gives the dtype and document
    layout; the tokens are memory-mapped from prefix.bin (documents are contiguous there)."""
    import struct

    from megatron.core.datasets.indexed_dataset import _INDEX_HEADER, IndexedDataset, get_bin_path

    what = f"--data-path {prefix}: cannot read {prefix}.bin/.idx as a Megatron indexed dataset"
    if os.path.getsize(get_bin_path(prefix)) == 0:
        raise ValueError(f"{what}: {prefix}.bin is empty (no tokens)")
    with open(prefix + ".idx", "rb") as f:  # megatron-core asserts on a bad header; name the file
        if f.read(len(_INDEX_HEADER)) != _INDEX_HEADER:
            raise ValueError(f"{what}: {prefix}.idx does not start with the index header "
                             f"{_INDEX_HEADER!r}; rebuild it (Megatron-LM tools/preprocess_data.py)")
    failure = None
    hook, sys.unraisablehook = sys.unraisablehook, lambda _: None
    try:  # the half-built reader's __del__ raises too: keep that noise off the user's screen
        ds = IndexedDataset(prefix)
    except (AssertionError, ValueError, struct.error) as err:  # a truncated or mismatched pair
        failure = str(err)
    finally:
        sys.unraisablehook = hook
    if failure is not None:
        raise ValueError(f"{what}: {failure}; rebuild the pair (Megatron-LM tools/preprocess_data.py)")
    dtype = ds.index.dtype
    flat = np.memmap(get_bin_path(prefix), dtype=dtype, mode="r")
    lengths = np.asarray(ds.sequence_lengths, dtype=np.int64)
    if int(lengths.sum()) != len(flat):
        raise ValueError(f"--data-path {prefix}: the .idx describes {int(lengths.sum())} tokens, "
                         f"the .bin holds {len(flat)}")
    docs = ds.document_indices  # sequence index where each document starts, plus the end
    n_docs = len(docs) - 1
    n_valid = int(n_docs * VALID_FRACTION) if n_docs >= 2 else 0
    n_valid = max(n_valid, 1) if n_docs >= 2 else 0
    first_valid_seq = int(docs[n_docs - n_valid]) if n_valid else len(lengths)
    cut = int(lengths[:first_valid_seq].sum())
    vocab = int(flat.max()) + 1 if len(flat) else 1
    return TokenData(flat[:cut], flat[cut:], vocab,
                     f"indexed dataset {prefix} ({n_docs} documents, {n_valid} for validation)",
                     _file_sha256(get_bin_path(prefix)))


def load(data_path: Optional[str]) -> TokenData:
    """The embedded corpus (None), an indexed dataset (a prefix with .bin/.idx, or the path
    of either file), or a text file."""
    if data_path is None:
        return embedded_corpus()
    prefix = data_path[:-4] if data_path.endswith((".bin", ".idx")) else data_path
    have = {ext: os.path.isfile(prefix + ext) for ext in (".bin", ".idx")}
    if all(have.values()):
        return indexed_dataset(prefix)
    if any(have.values()) and (prefix != data_path or not os.path.isfile(data_path)):
        # a lone half of an indexed dataset is binary, not text: training on its bytes is wrong
        missing = prefix + (".idx" if have[".bin"] else ".bin")
        raise FileNotFoundError(f"--data-path {data_path}: {missing} is missing; a Megatron indexed "
                                f"dataset needs both prefix.bin and prefix.idx (to train on the raw "
                                f"bytes of a text file, give it a name not ending in .bin/.idx)")
    if os.path.isfile(data_path):
        return text_file(data_path)
    raise FileNotFoundError(f"--data-path {data_path}: neither a file nor the prefix of a "
                            f".bin/.idx pair")


class Samples:
    """Windows of `seq_length + 1` tokens over `tokens`, in a seeded order per epoch."""

    def __init__(self, tokens: np.ndarray, seq_length: int, seed: int, shuffle: bool = True):
        self.tokens = tokens
        self.seq_length = int(seq_length)
        self.count = max(0, (len(tokens) - 1) // self.seq_length)
        self.seed = int(seed)
        self.shuffle = shuffle
        self._order: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.count

    def _epoch_order(self, epoch: int) -> np.ndarray:
        order = self._order.get(epoch)
        if order is None:
            if self.shuffle:
                order = np.random.default_rng([self.seed, epoch]).permutation(self.count)
            else:
                order = np.arange(self.count)
            self._order = {epoch: order}  # one epoch at a time is enough
        return order

    def __getitem__(self, j: int) -> np.ndarray:
        """The j-th sample of the endless order (epoch j // len, reshuffled per epoch)."""
        if self.count == 0:
            raise ValueError(f"data: {too_short(len(self.tokens), self.seq_length)}")
        epoch, k = divmod(int(j), self.count)
        start = int(self._epoch_order(epoch)[k]) * self.seq_length
        return np.asarray(self.tokens[start:start + self.seq_length + 1], dtype=np.int64)


@dataclass
class Batch:
    """One micro-batch as the GPT forward step needs it ([b, s] each)."""

    tokens: torch.Tensor
    labels: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor


def micro_batch(samples: Samples, start: int, index: int, micro_batch_size: int,
                dp_rank: int, dp_size: int) -> Batch:
    """Micro-batch `index` of this data-parallel rank in the global batch that begins at
    sample `start` (see the module docstring for the layout)."""
    first = start + (index * dp_size + dp_rank) * micro_batch_size
    rows = np.stack([samples[first + i] for i in range(micro_batch_size)])
    data = torch.from_numpy(rows)
    s = samples.seq_length
    return Batch(
        tokens=data[:, :-1].contiguous(),
        labels=data[:, 1:].contiguous(),
        loss_mask=torch.ones(micro_batch_size, s, dtype=torch.float32),
        position_ids=torch.arange(s).unsqueeze(0).expand(micro_batch_size, s).contiguous(),
    )
