"""``scripts/train_longnet.py``: a tiny run writes its loss log, evaluations,
checkpoints and summary; a run killed with SIGKILL (a real crash, in a subprocess)
and resumed with ``--resume`` reproduces the uninterrupted run's losses exactly."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys

import jax
import numpy as np
import pytest

pytest.importorskip("optax")
pytest.importorskip("orbax.checkpoint")
pytest.importorskip("tqdm")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "train_longnet.py")

# 64 tokens (32 in a first curriculum stage), 1 layer of width 16: milliseconds a step
TINY = ["--seq-len", "64", "--window", "32", "--local-segment", "16", "--num-entries", "4",
        "--num-queries", "4", "--gap", "8", "--num-keys", "8", "--num-values", "4",
        "--num-filler", "8", "--embed-dim", "16", "--layers", "1", "--heads", "4",
        "--ffn-dim", "32", "--batch-size", "2", "--max-batch", "4", "--steps", "7",
        "--curriculum", "32:3", "--eval-every", "3", "--eval-sequences", "2",
        "--ckpt-every", "2", "--keep-checkpoints", "2", "--no-progress"]


def _script():
    spec = importlib.util.spec_from_file_location("train_longnet", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def _log(out_dir):
    with open(os.path.join(out_dir, "log.jsonl")) as f:
        return [json.loads(line) for line in f if line.strip()]


def _ckpt_steps(out_dir):
    names = os.listdir(os.path.join(out_dir, "ckpt"))
    return sorted(int(n) for n in names if n.isdigit())


def test_task_layout():
    train = _script()
    task = train.Task(seq_len=64, num_entries=4, entry_repeats=4, num_queries=4, gap=8,
                      num_keys=8, num_values=4, num_filler=8)
    x, y, answers = task.sample(np.random.default_rng(0), 3)
    assert x.shape == y.shape == answers.shape == (3, 64)
    np.testing.assert_array_equal(x[:, 1:], y[:, :-1])
    for b in range(3):
        at = np.nonzero(answers[b])[0]
        assert len(at) == 4 and at.min() >= 64 - 8
        for p in at:  # question key -> the value of its entry, written 4 times earlier
            key, value = x[b, p] - task.key0, y[b, p] - task.value0
            entry = task.entry0 + key * task.num_values + value
            where = np.nonzero(x[b] == entry)[0]
            assert len(where) == 4 and np.all(np.diff(where) == 1)
            assert where.max() < task.body_len
    with pytest.raises(ValueError, match="do not fit"):
        train.Task(seq_len=32, num_entries=8, entry_repeats=4, num_queries=4, gap=4,
                   num_keys=8)
    assert train.stage_of(2, ((32, 3),), 64, 2, 4) == (32, 4)
    assert train.stage_of(4, ((32, 3),), 64, 2, 4) == (64, 2)


def test_log_checkpoints_and_exact_resume_after_sigkill(tmp_path):
    train = _script()
    ref_dir, crash_dir = str(tmp_path / "ref"), str(tmp_path / "crash")
    summary = train.main(TINY + ["--out-dir", ref_dir])
    ref = _log(ref_dir)
    assert [r["step"] for r in ref] == list(range(1, 8))
    assert [r["seq_len"] for r in ref] == [32] * 3 + [64] * 4
    assert all(np.isfinite(r["loss"]) for r in ref)
    assert [r["step"] for r in ref if "eval_loss" in r] == [3, 6, 7]
    assert _ckpt_steps(ref_dir) == [6, 7]  # every 2 steps and the last, 2 kept
    assert os.path.exists(os.path.join(ref_dir, "summary.json"))
    assert summary["steps"] == 7 and summary["heldout_answers"] == 8
    assert summary["chance_loss"] == pytest.approx(np.log(4))

    # a real crash: the script SIGKILLs itself right after step 5 (checkpoints 2, 4)
    # (in this process's JAX configuration - conftest.py - so that numbers match)
    env = dict(os.environ, JAX_ENABLE_X64=str(jax.config.jax_enable_x64),
               JAX_NUM_CPU_DEVICES=str(jax.config.jax_num_cpu_devices))
    if jax.config.jax_default_matmul_precision is not None:  # "highest" on a GPU
        env["JAX_DEFAULT_MATMUL_PRECISION"] = str(jax.config.jax_default_matmul_precision)
    proc = subprocess.run([sys.executable, SCRIPT, *TINY, "--out-dir", crash_dir,
                           "--stop-after", "5"], capture_output=True, text=True,
                          timeout=300, cwd=ROOT, env=env)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    assert [r["step"] for r in _log(crash_dir)] == [1, 2, 3, 4, 5]
    assert not os.path.exists(os.path.join(crash_dir, "summary.json"))
    last = max(_ckpt_steps(crash_dir))
    assert last in (2, 4)  # 4 unless its asynchronous write was cut by the kill

    resumed = train.main(TINY + ["--out-dir", crash_dir, "--resume"])
    assert resumed["resumed_from"] == last
    got = _log(crash_dir)
    assert [r["step"] for r in got] == list(range(1, 8))
    for a, b in zip(got, ref):
        for key in ("loss", "acc", "grad_norm", "eval_loss", "eval_acc"):
            assert a.get(key) == b.get(key), (a["step"], key, a.get(key), b.get(key))
    assert resumed["heldout_loss"] == summary["heldout_loss"]


def _text_dir(root):
    """Files of made-up words, 30 bytes to 3 KB: documents of varied length."""
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "def", "return", "class", "(", ")", "\n"]
    for i in range(24):
        n = int(rng.integers(5, 500))
        os.makedirs(os.path.join(root, f"d{i % 3}"), exist_ok=True)
        with open(os.path.join(root, f"d{i % 3}", f"f{i}.txt"), "w") as f:
            f.write(" ".join(rng.choice(words, n)))
    return root


TEXT = ["--heldout-fraction", "0.25", "--seq-len", "256", "--window", "32",
        "--local-segment", "32", "--embed-dim", "16", "--layers", "1", "--heads", "2",
        "--ffn-dim", "32", "--batch-size", "2", "--steps", "5", "--eval-every", "2",
        "--eval-sequences", "2", "--ckpt-every", "2", "--keep-checkpoints", "2",
        "--no-progress"]


def test_packed_text_run_by_position_and_exact_resume(tmp_path):
    train = _script()
    assert train.position_buckets(512) == [1, 64, 128, 256, 512]
    # bucket sums: the byte predicted at t sits at positions[:, t + 1]
    nll = np.arange(8.0)[None]
    pos = np.array([[0, 1, 62, 63, 64, 0, 1, 2]])
    w = np.array([[1, 1, 1, 1, 0, 1, 1, 0]], np.float32)
    nats, count = train.bits_by_position(nll, w, pos, [1, 64, 128])
    np.testing.assert_array_equal(count, [5, 1])
    np.testing.assert_array_equal(nats, [0 + 1 + 2 + 5 + 6, 3])

    data = _text_dir(str(tmp_path / "data"))
    ref_dir, cut_dir = str(tmp_path / "ref"), str(tmp_path / "cut")
    summary = train.main(TEXT + ["--data", data, "--out-dir", ref_dir])
    ref = _log(ref_dir)
    assert [r["step"] for r in ref if "eval_bpb" in r] == [2, 4, 5]
    assert all(len(r["eval_bpb_by_position"]) == 3 for r in ref if "eval_bpb" in r)
    assert summary["corpus"]["source"] == data and summary["corpus"]["heldout_documents"] > 0
    assert summary["segment_ids_to_model"] == train.model_takes_segment_ids()
    assert summary["position_edges"] == [1, 64, 128, 256]
    assert summary["heldout_bytes_predicted"] == sum(
        b["bytes"] for b in summary["heldout_by_position"]) > 0
    assert np.isfinite(summary["heldout_bpb"]) and summary["heldout_bpb"] > 0

    assert train.main(TEXT + ["--data", data, "--out-dir", cut_dir,
                              "--stop-after", "3"]) == {"stopped_at": 3}
    resumed = train.main(TEXT + ["--data", data, "--out-dir", cut_dir, "--resume"])
    assert resumed["resumed_from"] == 2
    for a, b in zip(_log(cut_dir), ref, strict=True):
        for key in ("loss", "grad_norm", "eval_bpb", "eval_bpb_by_position"):
            assert a.get(key) == b.get(key), (a["step"], key)
    assert resumed["heldout_by_position"] == summary["heldout_by_position"]
