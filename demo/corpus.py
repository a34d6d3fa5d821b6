"""The demo's training text: the Python standard library's own source, split by file into train
and held-out text, and a byte-level BPE tokenizer trained on the train files (``tokenizers``)."""

from __future__ import annotations

import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from torch import Tensor

__all__ = [
    "Corpus",
    "Data",
    "build_corpus",
    "heldout_text",
    "train_tokenizer",
    "token_stream",
    "prepare_data",
    "EOS",
    "PAD",
    "VOCAB_SIZE",
    "SEQ_LEN",
]

EOS = "<|endoftext|>"  # id 0: bos and eos
PAD = "<|pad|>"  # id 1
VOCAB_SIZE = 1024
SEQ_LEN = 256
CORPUS_CAP_BYTES = 12_000_000  # total text taken from the standard library
MAX_FILE_BYTES = 300_000  # skips generated data modules such as pydoc_data/topics.py
HELDOUT_EVERY = 20  # every 20th selected file is held out
HELDOUT_TXT_BYTES = 256_000  # size cap of heldout.txt
SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"})


@dataclass(frozen=True)
class Corpus:
    """The selected standard-library files, split by file."""

    root: Path
    train: list[tuple[str, str]]  # (path relative to root, text)
    heldout: list[tuple[str, str]]

    @staticmethod
    def size(files: Sequence[tuple[str, str]]) -> int:
        return sum(len(text.encode("utf-8")) for _, text in files)


def build_corpus(cap_bytes: int = CORPUS_CAP_BYTES) -> Corpus:
    """Standard-library ``.py`` files in sorted order up to ``cap_bytes``, split by file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    paths = sorted(
        p
        for p in root.rglob("*.py")
        if not SKIP_DIRS.intersection(p.relative_to(root).parts[:-1]) and not p.name.startswith("test_")
    )
    selected: list[tuple[str, str]] = []
    total = 0
    for path in paths:
        try:
            raw = path.read_bytes()
            text = raw.decode("utf-8").replace("\r\n", "\n")
        except (OSError, UnicodeDecodeError):
            continue  # unreadable or not UTF-8: skipped, deterministically
        if not text.strip() or len(raw) > MAX_FILE_BYTES:
            continue
        if total + len(raw) > cap_bytes:
            break
        selected.append((path.relative_to(root).as_posix(), text))
        total += len(raw)
    if len(selected) < 2 * HELDOUT_EVERY:
        raise SystemExit(f"only {len(selected)} usable standard-library files under {root}; cannot build the corpus")
    train = [f for i, f in enumerate(selected) if i % HELDOUT_EVERY != HELDOUT_EVERY - 1]
    heldout = [f for i, f in enumerate(selected) if i % HELDOUT_EVERY == HELDOUT_EVERY - 1]
    return Corpus(root, train, heldout)


def heldout_text(files: Sequence[tuple[str, str]], cap_bytes: int = HELDOUT_TXT_BYTES) -> str:
    """Whole held-out files joined by a blank line, cut at a line boundary under ``cap_bytes``."""
    text = "\n\n".join(t.rstrip("\n") + "\n" for _, t in files)
    data = text.encode("utf-8")[:cap_bytes]
    cut = data.rfind(b"\n")
    return data[: cut + 1].decode("utf-8")


def train_tokenizer(texts: Sequence[str]) -> Tokenizer:
    """Byte-level BPE with ``<|endoftext|>`` (0) and ``<|pad|>`` (1)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=[EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    if tok.token_to_id(EOS) != 0 or tok.token_to_id(PAD) != 1 or tok.get_vocab_size() != VOCAB_SIZE:
        raise SystemExit("tokenizer training produced unexpected special-token ids or vocab size")
    return tok


def token_stream(tok: Tokenizer, texts: Sequence[str]) -> Tensor:
    """All texts tokenized and joined, each followed by ``<|endoftext|>``; int64 ``[N]``."""
    ids: list[int] = []
    for enc in tok.encode_batch(list(texts), add_special_tokens=False):
        ids.extend(enc.ids)
        ids.append(0)
    return torch.tensor(ids, dtype=torch.int64)


@dataclass(frozen=True)
class Data:
    corpus: Corpus
    heldout: str  # heldout.txt
    tokenizer: Tokenizer
    train_ids: torch.Tensor  # the training token stream
    eval_ids: torch.Tensor  # heldout.txt's tokens


def prepare_data(out: Path) -> Data:
    """The corpus split by file, heldout.txt, the BPE tokenizer and both token streams."""
    corpus = build_corpus()
    heldout = heldout_text(corpus.heldout)
    (out / "heldout.txt").write_text(heldout, encoding="utf-8")
    print(
        f"corpus {corpus.root}: {len(corpus.train)} train files ({Corpus.size(corpus.train):,} B), "
        f"{len(corpus.heldout)} held-out files ({Corpus.size(corpus.heldout):,} B); "
        f"heldout.txt {len(heldout.encode()):,} B",
        flush=True,
    )
    tok = train_tokenizer([text for _, text in corpus.train])
    tok.save(str(out / "tokenizer.json"))
    train_ids = token_stream(tok, [text for _, text in corpus.train])
    eval_ids = torch.tensor(tok.encode(heldout, add_special_tokens=False).ids, dtype=torch.int64)
    print(f"tokenizer: {len(train_ids):,} train tokens, {len(eval_ids):,} heldout.txt tokens", flush=True)
    return Data(corpus, heldout, tok, train_ids, eval_ids)
