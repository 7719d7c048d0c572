"""``jax_dilated.data``: packing documents into rows with segment ids, byte corpora and
the held-out split by document.

The packed rows are checked by a plain loop over every row (independent of the
vectorised packer): every token of every document appears exactly once and in order,
segment ids are ``1, 2, ...`` per piece and 0 for trailing padding, positions restart
at each piece and continue the document in ``doc_positions``."""

from __future__ import annotations

import doctest
import os

import numpy as np
import pytest

from jax_dilated import data
from jax_dilated.data import packing


def _runs(row_ids):
    """[(start, stop, id)] of the maximal runs of equal values in a 1-D array."""
    out, start = [], 0
    for t in range(1, len(row_ids) + 1):
        if t == len(row_ids) or row_ids[t] != row_ids[start]:
            out.append((start, t, int(row_ids[start])))
            start = t
    return out


def _check(p, docs, seq_len):
    """Everything the packing promises, by brute force; returns the pieces
    ``{doc: [(doc_start, length, row), ...]}``."""
    assert p.tokens.shape == p.segment_ids.shape == p.positions.shape == (p.num_rows, seq_len)
    for a in (p.tokens, p.segment_ids, p.positions, p.doc_positions, p.document):
        assert a.dtype == np.int32
    pieces = {}
    for r in range(p.num_rows):
        runs = _runs(p.segment_ids[r])
        ids = [i for _, _, i in runs]
        if ids[-1] == 0:  # padding: one run, at the end, token pad_id
            s, e, _ = runs.pop()
            assert s > 0 and np.all(p.tokens[r, s:e] == p.pad_id)
            assert np.all(p.document[r, s:e] == -1)
            ids.pop()
        assert ids == list(range(1, len(ids) + 1)), ids
        for s, e, _ in runs:
            d = int(p.document[r, s])
            assert np.all(p.document[r, s:e] == d)
            np.testing.assert_array_equal(p.positions[r, s:e], np.arange(e - s))
            off = int(p.doc_positions[r, s])
            np.testing.assert_array_equal(p.doc_positions[r, s:e], off + np.arange(e - s))
            np.testing.assert_array_equal(p.tokens[r, s:e], np.asarray(docs[d][off:off + e - s]))
            pieces.setdefault(d, []).append((off, e - s, r))
    # no token lost or duplicated: each document's pieces, in order, tile it exactly
    nonempty = {i for i, d in enumerate(docs) if len(d)}
    assert set(pieces) == nonempty
    for d, ps in pieces.items():
        ps.sort()
        assert [o for o, _, _ in ps] == list(np.cumsum([0] + [n for _, n, _ in ps[:-1]]))
        assert sum(n for _, n, _ in ps) == len(docs[d])
        assert all(n <= seq_len for _, n, _ in ps)
    return pieces


def _docs(rng, lengths):
    return [rng.integers(1, 256, n).astype(np.uint8) for n in lengths]


T = 16
LENGTHS = [0, 1, 5, T - 1, T, T + 1, 3 * T + 5, 2, 3, 7, 9, 4, 11, 1, 40]


@pytest.mark.parametrize("mode", ["fit", "concat"])
def test_pack_roundtrip_and_ids(mode):
    rng = np.random.default_rng(0)
    docs = _docs(rng, LENGTHS)
    order = rng.permutation(len(docs))
    p = data.pack(docs, T, mode=mode, order=order)
    pieces = _check(p, docs, T)
    total = sum(LENGTHS)
    assert int(p.mask.sum()) == total
    if mode == "concat":  # one stream cut every T tokens: padding only in the last row
        assert p.num_rows == -(-total // T)
        assert p.mask[:-1].all()
        stream = np.concatenate([docs[i] for i in order])
        np.testing.assert_array_equal(p.tokens.reshape(-1)[:total], stream)
    else:  # short documents whole; long ones cut into T-token pieces from their start
        for d, ps in pieces.items():
            n = len(docs[d])
            assert [o for o, _, _ in ps] == list(range(0, n, T))
        assert p.num_rows < len([n for n in LENGTHS if n])  # short ones share rows
        assert p.utilization() > 0.8


def test_targets_and_loss_weights():
    rng = np.random.default_rng(1)
    docs = _docs(rng, [3, 20, 1, 6, 9])
    p = data.pack(docs, 8, mode="fit")
    _check(p, docs, 8)
    y, w = p.targets(), p.loss_weights()
    assert w.dtype == np.float32
    for r in range(p.num_rows):
        for t in range(8):
            same = (t + 1 < 8 and p.segment_ids[r, t] > 0
                    and p.segment_ids[r, t + 1] == p.segment_ids[r, t])
            assert w[r, t] == float(same), (r, t)
            if t + 1 < 8:
                assert y[r, t] == p.tokens[r, t + 1]
    # predicted bytes per piece = its length - 1 (the first byte has no context)
    assert w.sum() == sum(len(d) for d in docs) - p.segment_ids.max(axis=1).sum()


def test_many_small_documents_fast_and_exact():
    rng = np.random.default_rng(2)
    lengths = rng.integers(0, 300, 3000)
    docs = _docs(rng, lengths)
    p = data.pack(docs, 1024, mode="fit", order=rng.permutation(len(docs)))
    assert int(p.mask.sum()) == lengths.sum() and p.utilization() > 0.95
    # spot-check of the pieces through the document index (the full check is above)
    for d in rng.choice(np.flatnonzero(lengths), 20, replace=False):
        where = p.document == d
        got = p.tokens[where][np.argsort(p.doc_positions[where], kind="stable")]
        np.testing.assert_array_equal(got, docs[d])


def _write_tree(root):
    files = {"a.txt": b"hello world\n" * 30, "sub/b.py": b"x = 1\n" * 500,
             "sub/deep/c.md": b"# title\n", "sub/empty.txt": b"",
             "bin.dat": b"\x00\x01\x02binary", ".hidden": b"secret", ".git/config": b"x",
             **{f"many/f{i:02d}.txt": bytes(f"file {i}\n", "ascii") * (i + 1)
                for i in range(40)}}
    for name, content in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, name)) or root, exist_ok=True)
        with open(os.path.join(root, name), "wb") as f:
            f.write(content)
    return files


def test_directory_corpus_and_split(tmp_path):
    files = _write_tree(str(tmp_path))
    c = data.load_corpus(str(tmp_path))
    expect = sorted(n for n, v in files.items()
                    if v and b"\0" not in v and not any(p.startswith(".") for p in n.split("/")))
    assert list(c.names) == expect
    for name, doc in zip(c.names, c.docs):
        assert doc.tobytes() == files[name]
    assert c.num_bytes == sum(len(files[n]) for n in expect)

    train, held = c.split(0.25)
    assert set(train.names).isdisjoint(held.names)
    assert sorted(train.names + held.names) == expect
    assert 0 < len(held) < len(c)
    again = data.load_corpus(str(tmp_path)).split(0.25)[1]
    assert again.names == held.names  # deterministic
    # a document keeps its side when others are removed
    mask = data.heldout_mask(c.names[::2], 0.25)
    assert [n for n, m in zip(c.names[::2], mask) if m] == [n for n in held.names
                                                            if n in c.names[::2]]
    assert c.fingerprint() == data.load_corpus(str(tmp_path)).fingerprint()
    assert train.fingerprint() != c.fingerprint()

    capped = data.load_corpus(str(tmp_path), max_bytes=1500)
    assert 0 < capped.num_bytes <= 1500 and set(capped.names) <= set(expect)
    assert capped.names == data.load_corpus(str(tmp_path), max_bytes=1500).names
    _check(data.pack(c.docs, 64), c.docs, 64)


def test_stdlib_corpus_slice():
    c = data.load_corpus("stdlib", max_bytes=100_000)
    assert c.root == data.stdlib_root() and 0 < c.num_bytes <= 100_000
    for name in c.names:
        parts = name.split("/")
        assert name.endswith(".py") and not parts[-1].startswith("_sysconfigdata")
        assert not set(parts[:-1]) & {"site-packages", "dist-packages", "test", "tests",
                                      "idle_test"}
    p = data.pack(c.docs, 2048, order=np.random.default_rng(0).permutation(len(c)))
    _check(p, c.docs, 2048)
    assert int(p.mask.sum()) == c.num_bytes and p.tokens.max() < data.BYTE_VOCAB


def test_errors_and_docstring(tmp_path):
    with pytest.raises(ValueError, match="seq_len"):
        data.pack([np.ones(3, np.uint8)], 1)
    with pytest.raises(ValueError, match="mode"):
        data.pack([np.ones(3, np.uint8)], 4, mode="best")
    with pytest.raises(ValueError, match="permutation"):
        data.pack([np.ones(3, np.uint8)] * 2, 4, order=[0, 0])
    with pytest.raises(ValueError, match="not a directory"):
        data.load_corpus(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="no text files"):
        data.load_corpus(str(tmp_path))
    with pytest.raises(ValueError, match="fraction"):
        data.heldout_mask(["a"], 1.5)
    result = doctest.testmod(packing, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
