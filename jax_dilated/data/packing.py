"""Byte-level corpora packed into fixed-length rows with document ids (pure NumPy).

A long-context model trains on rows of ``seq_len`` tokens, but real documents have
every length. Packing fills each row with whole short documents and cuts long ones
into pieces, and records for every token which document piece it belongs to
(``segment_ids``), so that attention and the loss can stay inside a document
(issue 17; a document is a maximal run of equal ids in a row).

Tokens are bytes (:data:`BYTE_VOCAB` = 256 ids): no tokenizer, nothing to download.
There is no separator or BOS token: boundaries are carried by ``segment_ids``, the
first byte of a piece is never a target (:meth:`Packed.loss_weights`), and padding
(token id ``pad_id``, segment id 0) only ever ends a row, so under causal attention no
real token sees it.

Corpora (:func:`load_corpus`):

* ``"stdlib"``: the ``.py`` files of the running Python's standard library
  (``sysconfig.get_paths()["stdlib"]``), without installed packages
  (``site-packages``, ``dist-packages``), without the test suites (``test/``,
  ``tests/``, ``idle_test/``) and without the machine's build configuration
  (``_sysconfigdata_*.py``). On CPython 3.11: 730 files, 12 MB, median 8 KB, half
  above 8 KB, a quarter above 16 KB, the longest 740 KB (3.12: 682 files, 11.5 MB).
  Tests are left out because Debian and Ubuntu ship them in a separate package (the
  corpus would differ between machines with the same Python), because they hold
  deliberately malformed files and generated data tables, and because they would be
  60% of the bytes. The corpus depends on the Python version;
  :meth:`Corpus.fingerprint` names the exact one in a run's log.
* a directory: every regular file under it, recursively, that is not hidden (no
  name component starting with ``.``) and holds no NUL byte (binary files).

Layout of :func:`pack`'s result, every array ``[rows, seq_len]``:

* ``tokens`` int32: bytes, ``pad_id`` at padding;
* ``segment_ids`` int32: ``1, 2, 3, ...`` for the pieces of a row in order, ``0`` for
  padding (always at the end of a row);
* ``positions`` int32: position within the piece (0 at its first byte) - the context
  a model with attention blocked at piece boundaries has, which is what the
  by-position evaluation buckets;
* ``doc_positions`` int32: position within the whole document (``positions`` plus
  the offset of the piece in its document: equal for a document's first piece);
* ``document`` int32: index of the document in the list packed, ``-1`` for padding.

Example:
  >>> import numpy as np
  >>> from jax_dilated.data import pack
  >>> docs = [np.frombuffer(b"abcdef", np.uint8), np.frombuffer(b"xy", np.uint8)]
  >>> p = pack(docs, 4, mode="fit")
  >>> p.tokens.tolist() == [list(b"abcd"), list(b"efxy")]   # "ef" + "xy": first fit
  True
  >>> p.segment_ids.tolist()
  [[1, 1, 1, 1], [1, 1, 2, 2]]
  >>> p.doc_positions.tolist()
  [[0, 1, 2, 3], [4, 5, 0, 1]]
  >>> p.loss_weights().tolist()     # targets inside a piece only
  [[1.0, 1.0, 1.0, 0.0], [1.0, 0.0, 1.0, 0.0]]
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import sysconfig
from typing import Literal, Sequence, get_args

import numpy as np
import numpy.typing as npt

# how pack() cuts documents into rows
PackMode = Literal["fit", "concat"]

__all__ = ["BYTE_VOCAB", "Corpus", "Packed", "heldout_mask", "load_corpus", "pack",
           "stdlib_root"]

BYTE_VOCAB = 256

# directory names left out of the "stdlib" corpus (see the module docstring)
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests",
                               "idle_test", "__pycache__"})


def stdlib_root() -> str:
    """The running Python's standard-library directory."""
    return sysconfig.get_paths()["stdlib"]


def _hash_unit(text: str) -> float:
    """A deterministic number in [0, 1) from ``text`` (BLAKE2b, same on every machine
    and Python version - unlike ``hash()``)."""
    digest = hashlib.blake2b(text.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0 ** 64


def heldout_mask(names: Sequence[str], fraction: float, salt: str = "heldout") -> np.ndarray:
    """bool [len(names)]: True for the documents of the held-out split.

    A document is held out when ``blake2b(salt, name)`` (as a number in [0, 1)) is
    below ``fraction``: the split is by document, deterministic, the same on every
    machine, and a document keeps its side when others are added or removed.
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction must be in [0, 1], got {fraction!r}.")
    return np.array([_hash_unit(f"{salt}\0{n}") < fraction for n in names], bool)


@dataclasses.dataclass(frozen=True, eq=False)
class Corpus:
    """Documents as bytes. ``names[i]`` is the path of ``docs[i]`` relative to
    ``root`` ('/'-separated); names are sorted."""

    root: str
    names: tuple
    docs: tuple  # of uint8 arrays [len_i]

    def __len__(self) -> int:
        return len(self.docs)

    @property
    def num_bytes(self) -> int:
        return int(sum(d.size for d in self.docs))

    def subset(self, keep: npt.ArrayLike) -> Corpus:
        keep = np.asarray(keep, bool)
        return Corpus(self.root, tuple(n for n, k in zip(self.names, keep) if k),
                      tuple(d for d, k in zip(self.docs, keep) if k))

    def split(self, heldout_fraction: float, salt: str = "heldout") -> tuple[Corpus, Corpus]:
        """``(train, heldout)``: disjoint by document (:func:`heldout_mask`)."""
        held = heldout_mask(self.names, heldout_fraction, salt)
        return self.subset(~held), self.subset(held)

    def fingerprint(self) -> str:
        """A short hash of the names and contents: two runs read the same corpus
        exactly when their fingerprints agree."""
        h = hashlib.blake2b(digest_size=8)
        for name, doc in zip(self.names, self.docs):
            h.update(name.encode("utf-8", "surrogateescape") + b"\0")
            h.update(hashlib.blake2b(doc.tobytes(), digest_size=8).digest())
        return h.hexdigest()


def _list_files(root: str, stdlib: bool) -> list:
    """Sorted relative paths of the corpus's candidate files under ``root``."""
    out = []
    for here, dirs, files in os.walk(root):
        dirs[:] = [d for d in dirs if not d.startswith(".")
                   and not (stdlib and d in _STDLIB_SKIP_DIRS)]
        rel = os.path.relpath(here, root)
        for f in files:
            if f.startswith("."):
                continue
            if stdlib and (not f.endswith(".py") or f.startswith("_sysconfigdata")):
                continue
            path = f if rel == "." else os.path.join(rel, f)
            if os.path.isfile(os.path.join(root, path)):
                out.append(path.replace(os.sep, "/"))
    return sorted(out)


def load_corpus(source: str = "stdlib", *, max_bytes: int | None = None) -> Corpus:
    """Read a corpus (see the module docstring).

    Args:
      source: ``"stdlib"`` or a directory.
      max_bytes: read at most this many bytes: files are taken in a fixed
        pseudo-random order (hash of the name) while they fit, so a capped corpus is
        a deterministic sample of the whole, not its alphabetical beginning.

    Returns:
      a :class:`Corpus` (empty files and files with a NUL byte left out).
    """
    if source == "stdlib":
        root, stdlib = stdlib_root(), True
    else:
        root, stdlib = os.fspath(source), False
        if not os.path.isdir(root):
            raise ValueError(f"source must be 'stdlib' or a directory, got {source!r} "
                             f"(not a directory).")
    names = _list_files(root, stdlib)
    if max_bytes is not None:
        if max_bytes <= 0:
            raise ValueError(f"max_bytes must be None or > 0, got {max_bytes!r}.")
        total, keep = 0, []
        for name in sorted(names, key=lambda n: _hash_unit(f"sample\0{n}")):
            size = os.path.getsize(os.path.join(root, name))
            if total + size <= max_bytes:
                keep.append(name)
                total += size
        names = sorted(keep)
    kept_names, docs = [], []
    for name in names:
        with open(os.path.join(root, name), "rb") as f:
            data = f.read()
        if not data or b"\0" in data:
            continue
        kept_names.append(name)
        docs.append(np.frombuffer(data, np.uint8))
    if not docs:
        raise ValueError(f"no text files found in {root!r}"
                         + (f" within max_bytes={max_bytes}" if max_bytes else "") + ".")
    return Corpus(root, tuple(kept_names), tuple(docs))


@dataclasses.dataclass(frozen=True, eq=False)
class Packed:
    """Packed rows (see the module docstring for every field); arrays [rows, seq_len]."""

    tokens: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    doc_positions: np.ndarray
    document: np.ndarray
    pad_id: int = 0

    @property
    def mask(self) -> np.ndarray:
        """bool [rows, seq_len]: True at real tokens, False at padding."""
        return self.segment_ids > 0

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1]

    def utilization(self) -> float:
        """Fraction of the slots holding real tokens."""
        return float(self.mask.mean()) if self.tokens.size else 0.0

    def rows(self, index: int | slice | npt.ArrayLike) -> Packed:
        """The rows ``index`` (an int array or slice) as a new :class:`Packed`."""
        return Packed(self.tokens[index], self.segment_ids[index], self.positions[index],
                      self.doc_positions[index], self.document[index], self.pad_id)

    def targets(self) -> np.ndarray:
        """int32 [rows, seq_len]: the next token (``pad_id`` in the last column)."""
        out = np.full_like(self.tokens, self.pad_id)
        out[:, :-1] = self.tokens[:, 1:]
        return out

    def loss_weights(self) -> np.ndarray:
        """float32 [rows, seq_len]: 1 where the next token is a real token of the same
        piece - never across a boundary (the first byte of a piece is not predicted
        from the piece before), never a padding target, 0 in the last column."""
        seg = self.segment_ids
        out = np.zeros(seg.shape, np.float32)
        out[:, :-1] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, 1:] > 0)
        return out


_FIT_SEARCH = 512  # open rows searched by first fit (the most recent ones)


def _pieces(lengths, seq_len: int, mode: PackMode):
    """Placement of every piece: arrays ``(doc, start, length, row, col)`` and the
    number of rows."""
    doc, start, length, row, col = [], [], [], [], []
    if mode == "concat":
        # one stream, cut every seq_len tokens
        pos = 0
        for i, n in enumerate(lengths):
            s = 0
            while s < n:
                r, c = divmod(pos, seq_len)
                take = min(n - s, seq_len - c)
                doc.append(i), start.append(s), length.append(take)
                row.append(r), col.append(c)
                s += take
                pos += take
        num_rows = -(-pos // seq_len)
    else:  # "fit": a piece is never cut by a row boundary; first fit among open rows
        free = np.zeros(max(1, sum(-(-n // seq_len) for n in lengths)), np.int64)
        num_rows = 0
        for i, n in enumerate(lengths):
            for s in range(0, n, seq_len):
                take = min(seq_len, n - s)
                lo = max(0, num_rows - _FIT_SEARCH)  # bounded search: linear time
                fits = np.flatnonzero(free[lo:num_rows] >= take)
                if fits.size:
                    r = lo + int(fits[0])
                else:
                    r, num_rows = num_rows, num_rows + 1
                    free[r] = seq_len
                doc.append(i), start.append(s), length.append(take)
                row.append(r), col.append(seq_len - int(free[r]))
                free[r] -= take
    return [np.asarray(a, np.int64) for a in (doc, start, length, row, col)], num_rows


def pack(docs: Sequence[npt.ArrayLike], seq_len: int, *, mode: PackMode = "fit",
         pad_id: int = 0, order: npt.ArrayLike | None = None) -> Packed:
    """Pack documents into rows of ``seq_len`` tokens.

    Args:
      docs: 1-D integer arrays (bytes of each document); empty ones are skipped.
      seq_len: tokens per row.
      mode: ``"fit"`` (default): a document of at most ``seq_len`` tokens is never
        split; longer ones are cut into ``seq_len``-token pieces from their start (the
        last piece shorter); each piece goes to the first of the recent rows it fits
        in (first fit), else opens a row; rows end in padding where nothing fitted.
        ``"concat"``: the documents as one stream cut every ``seq_len`` tokens (no
        padding but at the end; a document is split wherever a row ends).
      pad_id: token id of padding (0; the byte 0 never occurs in a loaded corpus).
      order: optional permutation of ``range(len(docs))``: the order documents are
        packed in (``document`` still indexes ``docs``).

    Returns:
      :class:`Packed`. Every token of every document appears exactly once; the
      pieces of a document appear in order (in increasing rows with ``"concat"``).
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, (int, np.integer)) or seq_len < 2:
        raise ValueError(f"seq_len must be an int >= 2, got {seq_len!r}.")
    if mode not in get_args(PackMode):
        raise ValueError(f"mode must be 'fit' or 'concat', got {mode!r}.")
    seq_len = int(seq_len)
    order = np.arange(len(docs)) if order is None else np.asarray(order)
    if sorted(order.tolist()) != list(range(len(docs))):
        raise ValueError(f"order must be a permutation of range({len(docs)}).")
    order = np.asarray([i for i in order if len(docs[i])], np.int64)
    lengths = [len(docs[i]) for i in order]
    (doc, start, length, row, col), num_rows = _pieces(lengths, seq_len, mode)
    doc = order[doc] if doc.size else doc

    flat = np.full(num_rows * seq_len, pad_id, np.int32)
    real = np.zeros(num_rows * seq_len, bool)
    first = np.zeros(num_rows * seq_len, bool)  # first token of a piece
    doc_at = np.zeros(num_rows * seq_len, np.int32)
    off_at = np.zeros(num_rows * seq_len, np.int32)
    at = row * seq_len + col
    for d, s, n, a in zip(doc.tolist(), start.tolist(), length.tolist(), at.tolist()):
        flat[a:a + n] = docs[d][s:s + n]
        real[a:a + n] = True
    first[at] = True
    doc_at[at] = doc
    off_at[at] = start

    # every row begins with a piece; carry each piece's start index to its tokens
    idx = np.arange(flat.size)
    head = np.maximum.accumulate(np.where(first, idx, 0)) if flat.size else idx
    positions = np.where(real, idx - head, 0).astype(np.int32)
    shape = (num_rows, seq_len)
    segment_ids = np.where(real.reshape(shape), np.cumsum(first.reshape(shape), axis=1),
                           0).astype(np.int32)
    return Packed(
        tokens=flat.reshape(shape),
        segment_ids=segment_ids,
        positions=positions.reshape(shape),
        doc_positions=np.where(real, off_at[head] + positions, 0).astype(np.int32).reshape(shape),
        document=np.where(real, doc_at[head], -1).astype(np.int32).reshape(shape),
        pad_id=pad_id)
