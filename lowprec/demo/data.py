"""A real local corpus with no download: the Python standard library's own source, as bytes."""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass

import torch
from torch.utils.data import Dataset

VOCAB_SIZE = 256  # byte-level: every token is one byte of source text
# How the byte stream becomes tokens -> vocabulary size. "pairs" reads two bytes as one token (65536 ids,
# most of them rare, as in a real tokenizer's vocabulary): the output head is then a GEMM the size of a
# production LLM's (d x 64K), which matters where FP8 in that head is being judged.
TOKENIZATIONS = {"bytes": VOCAB_SIZE, "pairs": VOCAB_SIZE**2}


@dataclass
class Corpus:
    train: torch.Tensor  # uint8 token stream
    heldout: torch.Tensor
    files: int
    root: str


def _source_files(root: str) -> list[str]:
    paths = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        paths += [os.path.join(dirpath, f) for f in sorted(filenames) if f.endswith(".py")]
    return paths


def stdlib_corpus(max_bytes: int = 16 * 2**20, heldout_every: int = 20) -> Corpus:
    """Read the running interpreter's standard library source (deterministic order).

    About 1 file in `heldout_every` (chosen by a hash of its path, so the split does not depend on
    the Python version's file list) goes to the held-out split, never seen in training.
    """
    root = sysconfig.get_paths()["stdlib"]
    train, heldout, files, size = [], [], 0, 0
    for path in _source_files(root):
        try:
            with open(path, "rb") as fh:
                data = fh.read()
        except OSError:
            continue
        rel = os.path.relpath(path, root).encode()
        bucket = heldout if int(hashlib.sha1(rel).hexdigest(), 16) % heldout_every == 0 else train
        bucket.append(data)
        files += 1
        size += len(data)
        if size >= max_bytes:
            break
    if not train or not heldout:
        raise RuntimeError(f"found too little Python source under {root} to build a corpus")

    def stream(chunks: list[bytes]) -> torch.Tensor:
        return torch.frombuffer(bytearray(b"".join(chunks)), dtype=torch.uint8).clone()

    return Corpus(stream(train), stream(heldout), files, root)


def tokenize(stream: torch.Tensor, tokenization: str = "bytes") -> torch.Tensor:
    """The token stream of a uint8 byte stream: itself ("bytes"), or non-overlapping byte pairs read as
    one id each, first byte high ("pairs"; a trailing odd byte is dropped)."""
    if tokenization not in TOKENIZATIONS:
        raise ValueError(f"tokenization={tokenization!r} is not one of {', '.join(map(repr, TOKENIZATIONS))}")
    if tokenization == "bytes":
        return stream
    pairs = stream[: stream.numel() // 2 * 2].view(-1, 2).to(torch.int32)
    return pairs[:, 0] * VOCAB_SIZE + pairs[:, 1]


class Windows(Dataset):
    """`count` windows of `seq_len` tokens at seeded random offsets: the same data for every run."""

    def __init__(self, tokens: torch.Tensor, seq_len: int, count: int, seed: int):
        if tokens.numel() <= seq_len:
            raise ValueError(f"corpus of {tokens.numel()} tokens is shorter than seq_len={seq_len}")
        generator = torch.Generator().manual_seed(seed)
        self.tokens = tokens
        self.seq_len = seq_len
        self.offsets = torch.randint(0, tokens.numel() - seq_len, (count,), generator=generator)

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> torch.Tensor:
        start = int(self.offsets[i])
        return self.tokens[start : start + self.seq_len].long()
