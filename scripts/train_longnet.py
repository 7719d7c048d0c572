#!/usr/bin/env python
"""Train a LongNetLM on long-context associative recall, and compare with local attention.

The task (generated here, no download): a dictionary hidden in noise. A sequence of
``--seq-len`` tokens (8192 by default) is random filler tokens with
``--num-entries`` dictionary entries ``k:v`` at random places in its first part
(one token per entry: the vocabulary has a token for every key-value pair; keys are
distinct within a sequence, values i.i.d.), each written ``--entry-repeats`` times
in a row. The sequence ends with ``--num-queries`` questions ``k v``: the key of an
entry (each asked once, in random order), then its value. The loss is on the
answers only: at each question key the model must predict the value of that key's
entry, between ``--gap`` (T/8) and T tokens back. Chance is ``log num_values``
nats; only finding the entry beats it.

Models (the same LongNetLM, 2 layers, width 64, 4 heads, pre-LN, no position
encoding - retrieval here is by content, and a content-only model extrapolates from
the short sequences of the curriculum to 8K tokens, which rotary positions trained at
256 tokens do not):

* ``--attention dilated`` (default): branches (256, 1) and (T, 4): a local segment
  and one spanning the whole sequence with dilation rate 4. Each head of the long
  branch sees every 4th position (its offset, LongNet Eq. 13), and an entry written
  4 times in a row puts a copy in every head's view.
* ``--attention window --window W``: block-local dense attention, one segment of
  ``W`` (256) tokens at rate 1 (``jd.dilated_attention`` with ``segment_lengths=(W,)``):
  the entries are out of its reach at full length.

Training follows a length curriculum (``--curriculum``, default 150 steps at 256
tokens, 150 at 1024, 100 at 2048, then the rest - 50 steps - at the full length;
every step holds ``--batch-size`` x ``--seq-len`` = 8192 tokens: shorter stages have
proportionally larger batches, at most ``--max-batch``). Both models see the
same data. The summary reports the held-out loss and accuracy at the full length,
and at the window's length (256 tokens: within every model's reach, showing the
baseline did learn the lookup itself).

Every run writes ``--out-dir``: ``log.jsonl`` (one JSON line per step: length,
batch, loss, accuracy, gradient norm, seconds; every ``--eval-every`` steps also
``eval_loss`` / ``eval_acc`` on a fixed held-out set at full length and
``eval_short_*`` at the window's length), orbax checkpoints every ``--ckpt-every``
steps (``ckpt/<step>``: parameters, optimizer state incl. its step count, and the
step), ``summary.json``. ``--resume`` continues from the last checkpoint exactly
(the same losses as an uninterrupted run: the batch of step ``s`` is a pure function
of ``--seed`` and ``s``, so the data stream restarts at the checkpoint's step; log
lines after it are dropped). ``--stop-after N`` makes the process SIGKILL itself
right after step ``N`` (a crash test: no final checkpoint or summary).

Packed real text (issue 17): ``--corpus stdlib`` (the ``.py`` files of the running
Python's standard library: on every machine, no download) or ``--data DIR`` (every
text file under ``DIR``) trains the same LongNetLM on bytes (vocabulary 256, rotary
positions by default) packed into rows of ``--seq-len`` with segment ids
(``jax_dilated.data``: short documents whole, long ones cut into ``--seq-len``
pieces). A fraction ``--heldout-fraction`` of the documents (by a hash of the path) is
held out. The loss counts every byte of a piece but its first: no prediction across a
document boundary, none of padding. The segment ids go to the model
(``LongNetLM(tokens, segment_ids=...)``): attention stays inside each document and the
rotary / xPos positions restart at its first byte, so a packed row trains as its
documents alone would (a model without that keyword gets a warning instead).
Default branches: (256, 1) and (T, T/1024): the window baseline's segment plus one
branch over the whole row. Evaluations log held-out bits per byte (``eval_bpb``) and,
in ``summary.json``, bits per byte by the position of the predicted byte within its
piece - the context it has - in buckets 1-63, 64-127, ..., T/2-T-1
(``heldout_by_position``); ``scripts/plot_bits_per_byte.py RUN_DIR...`` draws them.
The rows of step ``s`` are a pure function of ``--seed``, ``s`` and the length, so
``--resume`` is exact here too.

Usage::

    python scripts/train_longnet.py                      # ~7 CPU-minutes (figures: docs/benchmarks.md)
    python scripts/train_longnet.py --attention window   # the local-attention baseline
    python scripts/train_longnet.py --quick              # ~1 minute smoke run (2K tokens)
    python scripts/train_longnet.py --resume             # after a kill: continue exactly
    python scripts/train_longnet.py --corpus stdlib --quick   # packed bytes, smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import inspect
import json
import math
import os
import shutil
import signal
import sys
import time

import numpy as np

# ----------------------------------------------------------------------------- task


@dataclasses.dataclass(frozen=True)
class Task:
    """The associative-recall task: vocabulary layout and sequence geometry.

    Token ids: ``[0, num_filler)`` filler, then ``num_keys`` keys, ``num_values``
    values, and ``num_keys * num_values`` dictionary entries ``k:v`` (entry
    ``(k, v)`` is ``entry0 + k * num_values + v``).

    A sequence is filler noise with ``num_entries`` entries (distinct keys, i.i.d.
    values) at random places in its first ``body_len`` tokens, each written
    ``entry_repeats`` times in a row, then ``num_queries`` questions ``k v``: a key
    of one of the entries (each asked once, in random order), then its value. No
    entry lies within ``gap`` tokens of the questions.
    """

    seq_len: int = 8192
    num_entries: int = 32
    entry_repeats: int = 4
    num_queries: int = 32
    gap: int = 1024
    num_keys: int = 32
    num_values: int = 16
    num_filler: int = 32

    def __post_init__(self):
        if not self.num_queries <= self.num_entries <= self.num_keys:
            raise ValueError(
                f"need num_queries ({self.num_queries}) <= num_entries "
                f"({self.num_entries}) <= num_keys ({self.num_keys}).")
        if self.body_len < self.num_entries * self.entry_repeats:
            raise ValueError(
                f"{self.num_entries} entries of {self.entry_repeats} tokens do not fit "
                f"the {self.body_len} tokens before the questions (seq_len - 2 "
                f"num_queries - gap).")

    @property
    def key0(self) -> int:
        return self.num_filler

    @property
    def value0(self) -> int:
        return self.num_filler + self.num_keys

    @property
    def entry0(self) -> int:
        return self.num_filler + self.num_keys + self.num_values

    @property
    def vocab_size(self) -> int:
        return self.entry0 + self.num_keys * self.num_values

    @property
    def body_len(self) -> int:
        return self.seq_len - 2 * self.num_queries - self.gap

    @property
    def chance_loss(self) -> float:
        return math.log(self.num_values)

    def sample(self, rng: np.random.Generator, batch: int):
        """``(inputs [B, T], targets [B, T], answers [B, T])``: next-token targets and
        a 0/1 mask of the question keys (whose targets are the answers)."""
        t, n, q, rep = self.seq_len, self.num_entries, self.num_queries, self.entry_repeats
        seqs = rng.integers(0, self.num_filler, size=(batch, t + 1))
        answers = np.zeros((batch, t + 1), np.float32)
        free = self.body_len - n * rep  # filler tokens of the body, between entries
        tail = t + 1 - 2 * q
        for b in range(batch):
            keys = rng.choice(self.num_keys, n, replace=False)
            values = rng.integers(0, self.num_values, n)
            starts = np.sort(rng.integers(0, free + 1, n)) + rep * np.arange(n)
            for s, k, v in zip(starts, keys, values):
                seqs[b, s:s + rep] = self.entry0 + k * self.num_values + v
            asked = rng.choice(n, q, replace=False)
            seqs[b, tail::2] = self.key0 + keys[asked]
            seqs[b, tail + 1::2] = self.value0 + values[asked]
            answers[b, tail + 1::2] = 1.0
        return seqs[:, :-1].astype(np.int32), seqs[:, 1:].astype(np.int32), answers[:, 1:]


def task_at(task: Task, seq_len: int) -> Task:
    """The same task at another length (gap scaled with it)."""
    return dataclasses.replace(task, seq_len=seq_len, gap=task.gap * seq_len // task.seq_len)


def parse_curriculum(text: str | None, seq_len: int):
    """``"512:150,2048:50"`` -> ((512, 150), (2048, 50)): steps at shorter lengths
    before the full ``seq_len``."""
    if not text:
        return ()
    stages = []
    for part in text.split(","):
        length, steps = (int(x) for x in part.split(":"))
        if not 0 < length < seq_len or steps <= 0:
            raise ValueError(f"curriculum stage {part!r}: need 0 < length < seq_len="
                             f"{seq_len} and steps > 0.")
        stages.append((length, steps))
    return tuple(stages)


def stage_of(step: int, curriculum, seq_len: int, batch: int, max_batch: int):
    """(sequence length, batch size) of training step ``step`` (1-based): the
    curriculum's stages first, then the full length. A stage keeps the tokens per
    step of the full length (batch scaled up, at most ``max_batch``)."""
    done = 0
    for length, steps in curriculum:
        done += steps
        if step <= done:
            return length, max(batch, min(max_batch, batch * seq_len // length))
    return seq_len, batch


def train_batch(task: Task, seed: int, step: int, batch: int):
    """Training batch of ``step``: a pure function of (seed, step), so a resumed run
    continues the data stream exactly."""
    return task.sample(np.random.default_rng([seed, 0, step]), batch)


def heldout_set(task: Task, seed: int, num: int, batch: int):
    """The fixed held-out batches (a separate random stream from training)."""
    return [task.sample(np.random.default_rng([seed, 1, task.seq_len, i]), batch)
            for i in range(-(-num // batch))]


# ----------------------------------------------------------------------- packed text


def position_buckets(seq_len: int):
    """Edges ``[1, 64, 128, ..., seq_len]`` of the by-position report: bucket ``k``
    holds the predicted bytes at positions ``edges[k] <= p < edges[k+1]`` of their
    piece (``p`` bytes of context; position 0 is never predicted)."""
    edges = [1]
    e = 64
    while e < seq_len:
        edges.append(e)
        e *= 2
    return edges + [seq_len]


class TextData:
    """A byte corpus split by document; training rows packed per length (cached).

    The rows of training step ``s`` (1-based) at length ``L`` with batch ``B`` are
    the rows ``k = (s-1) B ... s B - 1`` of an endless stream: row ``k`` is row
    ``k mod R`` of a permutation of the ``R`` packed rows drawn from
    ``(seed, L, k div R)`` (one permutation per epoch): a pure function of the seed,
    the step and the length, so a resumed run sees the same data."""

    vocab_size = 256

    def __init__(self, args):
        from jax_dilated import data

        self.source = args.data if args.data is not None else args.corpus
        corpus = data.load_corpus(self.source, max_bytes=args.max_corpus_bytes)
        self.train, self.heldout = corpus.split(args.heldout_fraction)
        if not len(self.train) or not len(self.heldout):
            raise ValueError(
                f"--heldout-fraction {args.heldout_fraction} leaves {len(self.train)} "
                f"training and {len(self.heldout)} held-out documents of {len(corpus)}: "
                f"need at least one of each.")
        self.info = {"source": self.source, "root": corpus.root,
                     "python": sys.version.split()[0], "fingerprint": corpus.fingerprint(),
                     "documents": len(corpus), "bytes": corpus.num_bytes,
                     "train_documents": len(self.train), "train_bytes": self.train.num_bytes,
                     "heldout_documents": len(self.heldout),
                     "heldout_bytes": self.heldout.num_bytes, "packing": args.packing}
        self.seed, self.mode, self.seq_len = args.seed, args.packing, args.seq_len
        self._packed = {}
        self._pack = data.pack
        # held-out rows at the full length, documents in name order (fixed)
        rows = data.pack(self.heldout.docs, self.seq_len, mode=self.mode)
        self.eval_rows = rows.rows(slice(0, args.eval_sequences))
        self.eval_batch = args.batch_size

    def packed(self, length):
        if length not in self._packed:
            order = np.random.default_rng([self.seed, 3]).permutation(len(self.train))
            self._packed[length] = self._pack(self.train.docs, length, mode=self.mode,
                                              order=order)
        return self._packed[length]

    def batch(self, step: int, length: int, batch: int):
        """``(inputs, targets, weights, segment_ids)`` [B, L] of training step ``step``."""
        rows = self.packed(length)
        k = (step - 1) * batch + np.arange(batch)
        epochs = k // rows.num_rows
        perms = {int(e): np.random.default_rng([self.seed, 4, length, int(e)]).permutation(
            rows.num_rows) for e in np.unique(epochs)}
        picked = rows.rows(np.array([perms[int(e)][i] for e, i in
                                     zip(epochs, k % rows.num_rows)]))
        return as_batch(picked)

    def eval_batches(self):
        r = self.eval_rows
        return [(as_batch(r.rows(slice(i, i + self.eval_batch))),
                 r.positions[i:i + self.eval_batch])
                for i in range(0, r.num_rows, self.eval_batch)]


def as_batch(rows):
    """``(inputs, targets, weights, segment_ids)`` of packed rows (see
    ``Packed.loss_weights``: no target across a document boundary or at padding)."""
    return (rows.tokens, rows.targets(), rows.loss_weights(), rows.segment_ids)


def bits_by_position(nll, weights, positions, edges):
    """Sums per bucket of the predicted byte's position: ``(nats [K], count [K])``.
    ``nll``, ``weights``, ``positions`` are [B, T]; the byte predicted at ``t`` is at
    ``positions[:, t + 1]`` of its piece."""
    w = weights[:, :-1].reshape(-1)
    pos = positions[:, 1:].reshape(-1)
    k = np.clip(np.searchsorted(edges, pos, side="right") - 1, 0, len(edges) - 2)
    nats = np.bincount(k, weights=nll[:, :-1].reshape(-1) * w, minlength=len(edges) - 1)
    return nats, np.bincount(k, weights=w, minlength=len(edges) - 1)


# ---------------------------------------------------------------------------- config


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--corpus", choices=("synthetic", "stdlib"), default=None,
                   help="synthetic: the recall task; stdlib: packed bytes of the Python "
                   "standard library's .py files (default: synthetic, or the --data dir)")
    p.add_argument("--data", type=str, default=None,
                   help="train on packed bytes of every text file under this directory")
    p.add_argument("--max-corpus-bytes", type=int, default=None,
                   help="read at most this many bytes of the corpus (a fixed sample)")
    p.add_argument("--heldout-fraction", type=float, default=0.05,
                   help="documents held out (by a hash of their path)")
    p.add_argument("--packing", choices=("fit", "concat"), default="fit",
                   help="fit: short documents whole (padding); concat: one stream")
    p.add_argument("--attention", choices=("dilated", "window"), default="dilated")
    p.add_argument("--window", type=int, default=256,
                   help="segment of the --attention window baseline")
    p.add_argument("--segment-lengths", type=str, default=None,
                   help="dilated branches, e.g. 256,8192 (default: local-segment,seq-len)")
    p.add_argument("--dilation-rates", type=str, default=None,
                   help="e.g. 1,4 (default: 1,entry-repeats; text: 1,seq-len/1024)")
    p.add_argument("--local-segment", type=int, default=256)
    p.add_argument("--seq-len", type=int, default=8192)
    p.add_argument("--num-entries", type=int, default=16)
    p.add_argument("--entry-repeats", type=int, default=4)
    p.add_argument("--num-queries", type=int, default=16)
    p.add_argument("--gap", type=int, default=None,
                   help="tokens between the last entry and the questions (default T/8)")
    p.add_argument("--num-keys", type=int, default=16)
    p.add_argument("--num-values", type=int, default=8)
    p.add_argument("--num-filler", type=int, default=32)
    p.add_argument("--embed-dim", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--ffn-dim", type=int, default=128)
    p.add_argument("--positions", choices=("rotary", "xpos", "none"), default=None,
                   help="default: none (synthetic), rotary (text)")
    p.add_argument("--norm", choices=("pre", "sub"), default="pre")
    p.add_argument("--remat", action="store_true")
    p.add_argument("--batch-size", type=int, default=1,
                   help="sequences per step at the full length")
    p.add_argument("--curriculum", type=str, default=None,
                   help="shorter sequences first: LENGTH:STEPS,... ('' for none; default "
                   "256:150,1024:150,2048:100 on the synthetic task, none on text)")
    p.add_argument("--max-batch", type=int, default=32,
                   help="largest batch of a curriculum stage")
    p.add_argument("--steps", type=int, default=450)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--eval-every", type=int, default=25)
    p.add_argument("--eval-sequences", type=int, default=16)
    p.add_argument("--ckpt-every", type=int, default=50)
    p.add_argument("--keep-checkpoints", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out-dir", type=str, default=None,
                   help="default runs/longnet_<attention>")
    p.add_argument("--resume", action="store_true",
                   help="continue from the last checkpoint in --out-dir")
    p.add_argument("--stop-after", type=int, default=None,
                   help="crash test: SIGKILL this process right after this step")
    p.add_argument("--quick", action="store_true",
                   help="~1 minute smoke run: 2048 tokens, 150 steps")
    p.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args = p.parse_args(argv)
    if args.data is not None and args.corpus is not None:
        p.error("give --corpus or --data, not both.")
    if args.corpus is None:
        args.corpus = "synthetic" if args.data is None else "data"
    text = args.corpus != "synthetic"
    if args.quick:
        quick = dict(seq_len=2048, steps=150, curriculum="256:100,1024:30", eval_every=50,
                     batch_size=4)
        for k, v in quick.items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    if args.curriculum is None:
        args.curriculum = "" if text else "256:150,1024:150,2048:100"
    if args.positions is None:
        args.positions = "rotary" if text else "none"
    if args.gap is None:
        args.gap = args.seq_len // 8
    if args.out_dir is None:
        args.out_dir = os.path.join(
            "runs", f"longnet_{args.attention}" if not text else
            f"longnet_{args.corpus}_{args.attention}")
    return args


def _ints(text):
    return tuple(int(x) for x in text.split(","))


def make_task(args) -> Task:
    return Task(seq_len=args.seq_len, num_entries=args.num_entries,
                entry_repeats=args.entry_repeats, num_queries=args.num_queries,
                gap=args.gap, num_keys=args.num_keys,
                num_values=args.num_values, num_filler=args.num_filler)


def make_config(args, vocab_size: int):
    import jax_dilated as jd

    if args.attention == "window":
        segs, rates = (args.window,), (1,)
    else:
        segs = _ints(args.segment_lengths) if args.segment_lengths else (
            args.local_segment, args.seq_len)
        # the long branch: every 4th token on the task (an entry is written 4 times),
        # 1024 keys per query on text
        long_rate = (args.entry_repeats if args.corpus == "synthetic"
                     else max(1, args.seq_len // 1024))
        rates = _ints(args.dilation_rates) if args.dilation_rates else (1, long_rate)
    return jd.models.LongNetConfig(
        vocab_size=vocab_size, embed_dim=args.embed_dim, num_layers=args.layers,
        num_heads=args.heads, ffn_dim=args.ffn_dim, segment_lengths=segs,
        dilation_rates=rates, positions=args.positions, norm=args.norm,
        max_len=args.seq_len, remat=args.remat)


# ----------------------------------------------------------------------------- train


@functools.cache
def make_tx(lr: float, warmup: int, steps: int, weight_decay: float):
    """The optimizer: clipping, AdamW on a warmup-cosine schedule. One object per
    setting, so that the optimizer's graph (which holds it) is the same for a second
    ``main`` in the same process and the jitted steps are not compiled again."""
    import optax

    schedule = optax.warmup_cosine_decay_schedule(
        0.0, lr, max(warmup, 1), max(steps, warmup + 1), lr * 0.1)
    return optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, b2=0.98, weight_decay=weight_decay))


@functools.cache
def model_takes_segment_ids() -> bool:
    """Whether ``LongNetLM.__call__`` accepts ``segment_ids=`` (packed documents)."""
    import jax_dilated as jd

    return "segment_ids" in inspect.signature(jd.models.LongNetLM.__call__).parameters


@functools.cache
def make_steps(use_segment_ids: bool = False):
    """The jitted training step (loss, gradient, optimizer update), eval step and
    per-token step (negative log-likelihood and hits [B, T], for the by-position
    report). With ``use_segment_ids`` the model gets ``segment_ids=`` (the steps'
    last argument; ignored otherwise).

    One set per process: a second ``main`` in the same process (a resume, another
    run of a notebook) reuses their compilations where the model is the same."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    import jax_dilated as jd

    grad_norm = optax.tree.norm if hasattr(optax, "tree") else optax.global_norm

    def answer_metrics(logits, targets, answers):
        loss = jd.models.cross_entropy(logits, targets, answers)
        hits = (jnp.argmax(logits, -1) == targets).astype(jnp.float32)
        acc = jnp.sum(hits * answers) / jnp.maximum(jnp.sum(answers), 1.0)
        return loss, acc

    def forward(model, inputs, segment_ids):
        if use_segment_ids:
            return model(inputs, segment_ids=segment_ids, deterministic=True)
        return model(inputs, deterministic=True)

    def objective(model, inputs, targets, answers, segment_ids):
        return answer_metrics(forward(model, inputs, segment_ids), targets, answers)

    @nnx.jit
    def train_step(model, optimizer, inputs, targets, answers, segment_ids=None):
        (loss, acc), grads = nnx.value_and_grad(objective, has_aux=True)(
            model, inputs, targets, answers, segment_ids)
        optimizer.update(model, grads)
        return loss, acc, grad_norm(grads)

    @nnx.jit
    def eval_step(model, inputs, targets, answers, segment_ids=None):
        loss, acc = answer_metrics(forward(model, inputs, segment_ids), targets, answers)
        count = jnp.sum(answers)
        return loss * count, acc * count, count

    @nnx.jit
    def token_step(model, inputs, targets, segment_ids=None):
        logits = forward(model, inputs, segment_ids)
        logp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]
        return nll, jnp.argmax(logits, -1) == targets

    return train_step, eval_step, token_step


def evaluate(eval_step, model, batches):
    import jax.numpy as jnp

    loss = acc = count = 0.0
    for inputs, targets, answers in batches:
        l, a, c = eval_step(model, jnp.asarray(inputs), jnp.asarray(targets),
                            jnp.asarray(answers))
        loss, acc, count = loss + float(l), acc + float(a), count + float(c)
    return loss / count, acc / count


def evaluate_text(token_step, model, data: TextData, edges):
    """Held-out metrics of packed text: loss (nats per predicted byte), bits per
    byte, next-byte accuracy, and bits per byte per position bucket (None where a
    bucket has no byte) with the bytes counted."""
    import jax.numpy as jnp

    nats = np.zeros(len(edges) - 1)
    count = np.zeros(len(edges) - 1)
    hits = 0.0
    for (inputs, targets, weights, seg), positions in data.eval_batches():
        nll, hit = token_step(model, jnp.asarray(inputs), jnp.asarray(targets),
                              jnp.asarray(seg))
        n, c = bits_by_position(np.asarray(nll, np.float64), weights, positions, edges)
        nats, count = nats + n, count + c
        hits += float((np.asarray(hit) * weights).sum())
    total = max(count.sum(), 1.0)
    return {"eval_loss": nats.sum() / total, "eval_bpb": nats.sum() / total / math.log(2),
            "eval_acc": hits / total,
            "eval_bpb_by_position": [n / c / math.log(2) if c else None
                                     for n, c in zip(nats, count)],
            "eval_bytes_by_position": [int(c) for c in count]}


def _read_log(path, upto_step):
    """Lines of the loss log up to ``upto_step`` (a resumed run drops later ones)."""
    if not os.path.exists(path):
        return []
    keep = []
    with open(path) as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            row = json.loads(line)
            if row.get("step", 0) <= upto_step:
                keep.append(row)
    return keep


def main(argv=None, *, hard_stop: bool = False) -> dict:
    """Run training; returns the summary (also written to ``out_dir/summary.json``).

    ``--stop-after N``: with ``hard_stop`` (the command line) the process kills
    itself with SIGKILL after step ``N`` - no final checkpoint, no summary, an
    asynchronous checkpoint still being written is lost, as in a real crash;
    otherwise ``main`` returns ``{"stopped_at": N}`` at that point."""
    args = parse_args(argv)
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    from flax import nnx

    import jax_dilated as jd

    text = args.corpus != "synthetic"
    if text:
        task, data = None, TextData(args)
        vocab_size, seq_len = data.vocab_size, args.seq_len
    else:
        task, data = make_task(args), None
        vocab_size, seq_len = task.vocab_size, task.seq_len
    config = make_config(args, vocab_size)
    use_segment_ids = text and model_takes_segment_ids()
    if text and not use_segment_ids:
        print("[train_longnet] WARNING: LongNetLM.__call__ takes no segment_ids yet: "
              "attention crosses document boundaries within a packed row (the loss "
              "does not); results are not those of document-masked attention.",
              file=sys.stderr, flush=True)
    out_dir = os.path.abspath(args.out_dir)
    ckpt_dir = os.path.join(out_dir, "ckpt")
    log_path = os.path.join(out_dir, "log.jsonl")
    if not args.resume and os.path.exists(out_dir):
        shutil.rmtree(out_dir)
    os.makedirs(out_dir, exist_ok=True)

    model = jd.models.LongNetLM(config, rngs=nnx.Rngs(args.seed))
    tx = make_tx(args.lr, args.warmup, args.steps, args.weight_decay)
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    train_step, eval_step, token_step = make_steps(use_segment_ids)

    manager = ocp.CheckpointManager(
        ckpt_dir, options=ocp.CheckpointManagerOptions(max_to_keep=args.keep_checkpoints,
                                                       create=True))
    start = 0
    if args.resume and manager.latest_step() is not None:
        start = manager.latest_step()
        target = {"model": nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                  "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}
        abstract = jax.tree.map(ocp.utils.to_shape_dtype_struct, target)
        restored = manager.restore(start, args=ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        if restored["meta"]["step"] != start:
            raise RuntimeError(f"checkpoint {start} holds step {restored['meta']['step']}.")
        for module, name in ((model, "model"), (optimizer, "optimizer")):
            state = nnx.state(module, nnx.Param) if name == "model" else nnx.state(module)
            nnx.replace_by_pure_dict(state, restored["state"][name])
            nnx.update(module, state)
    rows = _read_log(log_path, start) if args.resume else []
    with open(log_path, "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")

    curriculum = parse_curriculum(args.curriculum, seq_len)
    max_batch = max(args.batch_size, args.max_batch)
    n_params = sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
    if text:
        edges = position_buckets(seq_len)
        info = data.info
        print(f"[train_longnet] corpus={info['source']} ({info['train_documents']} "
              f"training documents, {info['train_bytes']} bytes; {info['heldout_documents']}"
              f" held out, {data.eval_rows.num_rows} rows evaluated) "
              f"attention={args.attention} segments={config.segment_lengths} "
              f"rates={config.dilation_rates} positions={args.positions} T={seq_len} "
              f"params={n_params} segment_ids={'to the model' if use_segment_ids else 'no'}"
              f" curriculum={curriculum} out={out_dir}"
              + (f" resumed at step {start}" if start else ""), flush=True)
    else:
        heldout = heldout_set(task, args.seed, args.eval_sequences, args.batch_size)
        # the task at the window's length: within reach of every model (if it fits there)
        try:
            short_task = task_at(task, min(args.window, task.seq_len))
            heldout_short = heldout_set(short_task, args.seed, args.eval_sequences,
                                        max_batch)
        except ValueError:
            short_task, heldout_short = None, None
        tasks = {task.seq_len: task}
        print(f"[train_longnet] attention={args.attention} segments={config.segment_lengths} "
              f"rates={config.dilation_rates} T={task.seq_len} params={n_params} "
              f"chance={task.chance_loss:.3f} nats curriculum={curriculum} out={out_dir}"
              + (f" resumed at step {start}" if start else ""), flush=True)

    bar = None
    if not args.no_progress:
        from tqdm import tqdm

        bar = tqdm(total=args.steps, initial=start, desc=f"train[{args.attention}]",
                   dynamic_ncols=True)
    t_start = time.time()
    log = open(log_path, "a")
    for step in range(start + 1, args.steps + 1):
        length, batch_size = stage_of(step, curriculum, seq_len, args.batch_size,
                                      max_batch)
        if text:
            batch = data.batch(step, length, batch_size)
        else:
            if length not in tasks:
                tasks[length] = task_at(task, length)
            batch = train_batch(tasks[length], args.seed, step, batch_size)
        t0 = time.time()
        out = train_step(model, optimizer, *(jnp.asarray(x) for x in batch))
        loss, acc, gnorm = (float(x) for x in out)
        row = {"step": step, "seq_len": length, "batch": batch_size, "loss": loss,
               "acc": acc, "grad_norm": gnorm, "seconds": round(time.time() - t0, 4)}
        if text:
            row["bpb"] = loss / math.log(2)
        if step % args.eval_every == 0 or step == args.steps:
            if text:
                row.update(evaluate_text(token_step, model, data, edges))
            else:
                row["eval_loss"], row["eval_acc"] = evaluate(eval_step, model, heldout)
                if heldout_short is not None:
                    row["eval_short_loss"], row["eval_short_acc"] = evaluate(
                        eval_step, model, heldout_short)
        log.write(json.dumps(row) + "\n")
        log.flush()
        if step % args.ckpt_every == 0 or step == args.steps:
            state = {"model": nnx.to_pure_dict(nnx.state(model, nnx.Param)),
                     "optimizer": nnx.to_pure_dict(nnx.state(optimizer))}
            manager.save(step, args=ocp.args.Composite(
                state=ocp.args.StandardSave(state),
                meta=ocp.args.JsonSave({"step": step, "args": vars(args)})))
        if bar is not None:
            post = {"loss": f"{loss:.3f}", "acc": f"{acc:.2f}"}
            if "eval_loss" in row:
                post["eval"] = f"{row['eval_loss']:.3f}"
            bar.set_postfix(post)
            bar.update(1)
        if args.stop_after is not None and step >= args.stop_after:
            if hard_stop:
                os.kill(os.getpid(), signal.SIGKILL)
            log.close()
            if bar is not None:
                bar.close()
            manager.wait_until_finished()
            print(f"[train_longnet] --stop-after {args.stop_after}: stopping abruptly",
                  flush=True)
            return {"stopped_at": step}
    log.close()
    if bar is not None:
        bar.close()
    manager.wait_until_finished()
    wall = time.time() - t_start
    if text:
        return _text_summary(args, config, data, token_step, model, edges, n_params,
                             curriculum, use_segment_ids, wall, start, out_dir)

    eval_loss, eval_acc = evaluate(eval_step, model, heldout)
    short_loss, short_acc = (evaluate(eval_step, model, heldout_short)
                             if heldout_short is not None else (None, None))
    summary = {
        "attention": args.attention, "segment_lengths": list(config.segment_lengths),
        "dilation_rates": list(config.dilation_rates), "seq_len": task.seq_len,
        "steps": args.steps, "params": int(n_params), "heldout_sequences": args.eval_sequences,
        "heldout_answers": int(sum(a.sum() for _, _, a in heldout)),
        "heldout_loss": eval_loss, "heldout_acc": eval_acc,
        "chance_loss": task.chance_loss, "chance_acc": 1.0 / task.num_values,
        "short_seq_len": short_task and short_task.seq_len,
        "short_heldout_loss": short_loss,
        "short_heldout_acc": short_acc, "curriculum": [list(c) for c in curriculum],
        "train_seconds": round(wall, 1), "resumed_from": start,
    }
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"[train_longnet] {args.attention}: held-out loss {eval_loss:.3f} nats vs chance "
          f"{task.chance_loss:.3f}; accuracy {eval_acc:.1%} vs chance "
          f"{1 / task.num_values:.1%} ({summary['heldout_answers']} answers); "
          f"{args.steps - start} steps in {wall:.0f} s", flush=True)
    if short_task is not None:
        print(f"[train_longnet] at length {short_task.seq_len} (within every model's "
              f"reach): held-out loss {short_loss:.3f}, accuracy {short_acc:.1%}",
              flush=True)
    return summary


def _text_summary(args, config, data, token_step, model, edges, n_params, curriculum,
                  use_segment_ids, wall, start, out_dir):
    """The final held-out evaluation of a packed-text run, written to summary.json."""
    ev = evaluate_text(token_step, model, data, edges)
    summary = {
        "corpus": data.info, "attention": args.attention,
        "segment_lengths": list(config.segment_lengths),
        "dilation_rates": list(config.dilation_rates), "positions": args.positions,
        "seq_len": args.seq_len, "steps": args.steps, "params": int(n_params),
        "segment_ids_to_model": use_segment_ids,
        "heldout_rows": data.eval_rows.num_rows,
        "heldout_bytes_predicted": int(sum(ev["eval_bytes_by_position"])),
        "heldout_loss": ev["eval_loss"], "heldout_bpb": ev["eval_bpb"],
        "heldout_acc": ev["eval_acc"], "position_edges": edges,
        "heldout_by_position": [
            {"lo": lo, "hi": hi, "bits_per_byte": b, "bytes": n}
            for lo, hi, b, n in zip(edges[:-1], edges[1:], ev["eval_bpb_by_position"],
                                    ev["eval_bytes_by_position"])],
        "curriculum": [list(c) for c in curriculum],
        "train_seconds": round(wall, 1), "resumed_from": start,
    }
    with open(os.path.join(out_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    by_pos = ", ".join(f"{b['lo']}-{b['hi'] - 1}: {b['bits_per_byte']:.3f}"
                       for b in summary["heldout_by_position"] if b["bytes"])
    print(f"[train_longnet] {args.attention} on {data.info['source']}: held-out "
          f"{ev['eval_bpb']:.3f} bits/byte ({summary['heldout_bytes_predicted']} bytes); by "
          f"position in the piece (= bytes of context): {by_pos}; {args.steps - start} steps in {wall:.0f} s",
          flush=True)
    return summary


if __name__ == "__main__":
    main(hard_stop=True)
