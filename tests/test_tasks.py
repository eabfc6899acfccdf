"""Downstream tasks (evals/tasks.py) scored on the mesh (evals/scoring.py) and bits per byte: each continuation's
log-likelihood equals a by-hand log_softmax over the unpadded sequence, the same on every mesh (the
pipeline and its circular schedule included) in fp32, and acc / acc_norm / bpb follow from it as
lm-evaluation-harness defines them; val bits per byte count the bytes of the text the targets spell."""
import json
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import dataset
import metrics_schema
import pipeline
import sharding
import trainer
import utils
from ceiling import CEILING_S
from collectives import Axes
from data import tokenizer as tok
from data_util import corpus_documents
from engine import engine_for
from evals import scoring, tasks
from model_util import CFG, CIRCULAR, EP, KEY, ROUTER_BIAS, rel_err, with_model
from run_util import REPO, TINY_FLAGS


def random_rows(n, T, vocab, seed=0):
    """Rows as task_rows lays them out, of random tokens: a prefix of random length, its last targets the
    continuation, eot padding after."""
    rng = np.random.default_rng(seed)
    x, y = np.full((2, n, T), 0, np.int32)
    mask = np.zeros((n, T), np.int32)
    for r in range(n):
        length = int(rng.choice([3, T // 2, T]))          # a few lengths: by_hand compiles each
        ids = rng.integers(0, vocab, length + 1)
        x[r, :length], y[r, :length] = ids[:-1], ids[1:]
        mask[r, length - int(rng.integers(1, length + 1)):length] = 1
    return scoring.Rows(x, y, mask, 0)


def by_hand(params, rows, cfg):
    """Each row's summed nats over its continuation, whether every continuation token is the argmax, and the
    argmax at every position [R, T], the rows of each length run at that length (no padding, no mesh), from
    log_softmax over the whole vocabulary."""
    params = sharding.with_router_bias(params, ROUTER_BIAS)

    @jax.jit
    def log_probs(params, x_BL):
        transformer, axes = sharding.build(sharding.model_order(params), cfg), Axes(engine=engine_for(cfg))
        h_BLD = transformer(x_BL, axes, ctx={"train": False, "key": KEY, "seq_ids": jnp.arange(len(x_BL))})[0]
        table_VD = transformer.output_table(axes, transformer.embed.gathered(axes))[:cfg.vocab_size]
        return jax.nn.log_softmax(jnp.einsum("bld,vd->blv", h_BLD, table_VD, precision="highest"), axis=-1)

    lengths = np.array([np.nonzero(m)[0][-1] + 1 for m in rows.mask])
    nats, greedy, argmax = np.zeros(len(lengths)), np.zeros(len(lengths), bool), np.zeros(rows.y.shape, np.int32)
    for L in set(lengths):
        rows_of = np.nonzero(lengths == L)[0]
        log_p_BLV = np.asarray(log_probs(params, jnp.asarray(rows.x[rows_of, :L])))
        target_BL = np.take_along_axis(log_p_BLV, rows.y[rows_of, :L, None], axis=-1)[..., 0]
        nats[rows_of] = -np.sum(target_BL * rows.mask[rows_of, :L], axis=1)
        argmax[rows_of, :L] = log_p_BLV.argmax(-1)
        greedy[rows_of] = np.all((argmax[rows_of, :L] == rows.y[rows_of, :L]) | (rows.mask[rows_of, :L] == 0), 1)
    return nats, greedy, argmax


@pytest.fixture(scope="module")
def params():
    return sharding.init_params(CFG, KEY)


@pytest.fixture(scope="module")
def rows(params):
    """Random rows, every other one's continuation the model's greedy one (the targets change no score but
    their own)."""
    rows = random_rows(20, CFG.T, CFG.vocab_size)
    argmax = by_hand(params, rows, CFG)[2]
    y = rows.y.copy()
    y[::2] = np.where(rows.mask[::2] > 0, argmax[::2], y[::2])
    return scoring.Rows(rows.x, y, rows.mask, 0)


@pytest.fixture(scope="module")
def expected(params, rows):
    return by_hand(params, rows, CFG)


def test_one_device_token_scores_equal_a_log_softmax_by_hand(params, rows, expected):
    """The ground truth the meshes are held to: one device, both engines, padded rows, against each row alone."""
    nats, greedy, _ = expected
    assert 0 < greedy.sum() < len(greedy)
    for engine in ("fast", "reference"):
        cfg = with_model(CFG, engine=engine)
        nats_BT, greedy_BT = pipeline.one_device_token_scores(sharding.with_router_bias(params, ROUTER_BIAS),
                                                              jnp.asarray(rows.x), jnp.asarray(rows.y), cfg)
        assert rel_err(np.sum(np.asarray(nats_BT) * rows.mask, axis=1), nats) < 1e-5, engine
        np.testing.assert_array_equal(np.all(np.asarray(greedy_BT) | (rows.mask == 0), axis=1), greedy, engine)


def on_the_mesh(params, shape, n_micro, changes):
    """(trainer, state) of CFG with `changes` on mesh `shape`, n_micro micro-batches, 8 rows a batch."""
    cfg = utils.override(utils.Config(model=with_model(CFG, **changes)), n_device_axis=shape, micro_batch_size=n_micro,
                         val_batch_size=8)
    mesh = sharding.make_mesh(shape)
    stored = sharding.Layout(cfg.model.pipeline_repeats).store(params)
    return trainer.build_trainer(cfg, mesh), {
        "params": jax.device_put(stored, sharding.param_shardings(stored, mesh, cfg.model.expert_parallel)),
        "router_bias": ROUTER_BIAS}


@pytest.mark.parametrize("shape,n_micro,changes", [((1, 1, 1), 1, {}), ((2, 2, 2), 2, EP),
                                                   ((1, 4, 1), 4, CIRCULAR), ((2, 2, 2), 4, EP | CIRCULAR)])
def test_rows_score_the_same_on_every_mesh(params, rows, expected, shape, n_micro, changes):
    """trainer.score_step on the mesh, 8 rows a batch (the last padded), each batch as narrow as its longest
    row allows (widths 4, 8 and 16 of T = 16, with capacity factor 1: drops happen), equals the by-hand scores
    in fp32, and says which rows' continuations are greedy."""
    nats, greedy = scoring.row_scores(*on_the_mesh(params, shape, n_micro, changes), rows, 8, min_width=4)
    assert nats.shape == (20,) and rel_err(nats, expected[0]) < 1e-5
    np.testing.assert_array_equal(greedy, expected[1])


@pytest.mark.parametrize("shape,n_micro,changes", [((1, 1, 1), 1, {}), ((2, 2, 2), 4, EP | CIRCULAR)])
def test_short_continuations_reach_the_output_layer_alone(params, shape, n_micro, changes):
    """Continuations of at most 3 tokens in rows of up to 16: the output layer sees each row's last 8 positions
    (the window), not 16, and the scores stay the by-hand ones, rows shorter than the window included (their
    continuation starts at position 0: counted once)."""
    rows = random_rows(16, CFG.T, CFG.vocab_size, seed=1)
    lengths = np.array([np.nonzero(m)[0][-1] + 1 for m in rows.mask])
    mask = np.zeros_like(rows.mask)
    for r, n in enumerate(lengths):
        mask[r, max(0, n - 3):n] = 1
    rows = scoring.Rows(rows.x, rows.y, mask, 0)
    assert {3, CFG.T} <= set(lengths)
    nats, greedy, _ = by_hand(params, rows, CFG)
    scored, scored_greedy = scoring.row_scores(*on_the_mesh(params, shape, n_micro, changes), rows, 8,
                                               min_width=CFG.T)
    assert rel_err(scored, nats) < 1e-5
    np.testing.assert_array_equal(scored_greedy, greedy)


def test_the_bundled_task_is_held_out_verses_with_their_true_endings():
    """kjv_endings: every third held-out verse of 8 words or more, once, split at its middle word; the gold
    choice is its ending, the others other verses' endings, all different; the same task every time."""
    task = tasks.kjv_endings()
    verses = [v for doc in corpus_documents("val") for v in doc.split("\n") if len(v.split()) >= 8][::3]
    assert len(task.examples) == len(verses) == 207 and task.chance == 0.25
    for e, verse in zip(task.examples, verses):
        assert e.context + " " + e.choices[e.gold] == verse and len(set(e.choices)) == 4
        assert all(c and not c.startswith(" ") for c in e.choices)
    assert tasks.kjv_endings() == task
    assert np.bincount([e.gold for e in task.examples], minlength=4).min() > len(verses) / 4 * 0.8


def test_task_scores_follow_the_harness_definitions_by_hand():
    """A cl100k model on a few of the bundled task's examples, with a --T short enough to cut some on the left:
    each choice's log-likelihood by hand (its ids from the tokenizer after <|endoftext|>, cut to T + 1 on the
    left, run alone), then acc, acc_norm (log-likelihood per character, the delimiter not counted) and bpb
    (the gold's nats / ln 2 / its UTF-8 bytes)."""
    cfg = with_model(CFG, vocab_size=tok.VOCAB_SIZE, T=20)
    params = sharding.init_params(cfg, KEY)
    task = tasks.MultipleChoiceTask("few", tasks.kjv_endings().examples[:6])
    enc = tok.get_tokenizer()
    rows = scoring.task_rows(task, enc, cfg.T)
    hand_rows, cut = [], 0
    for e in task.examples:
        for choice in e.choices:
            context, continuation = [tok.EOT_ID] + enc.encode_ordinary(e.context), enc.encode_ordinary(" " + choice)
            ids = (context + continuation)[-(cfg.T + 1):]
            cut += len(ids) < len(context) + len(continuation)
            (x, y), mask = np.full((2, cfg.T), tok.EOT_ID, np.int32), np.zeros(cfg.T, np.int32)
            x[:len(ids) - 1], y[:len(ids) - 1] = ids[:-1], ids[1:]
            mask[max(0, len(ids) - 1 - len(continuation)):len(ids) - 1] = 1    # all targets when it is longer
            hand_rows.append((x, y, mask))
    hand = scoring.Rows(*map(np.stack, zip(*hand_rows)), cut)
    for name in ("x", "y", "mask"):
        np.testing.assert_array_equal(getattr(rows, name), getattr(hand, name), name)
    assert 0 < cut == rows.cut < len(hand_rows)
    nats = by_hand(params, hand, cfg)[0]
    mesh_cfg = utils.override(utils.Config(model=cfg), n_device_axis=(2, 1, 2), micro_batch_size=1, val_batch_size=8)
    mesh = sharding.make_mesh((2, 1, 2))
    state = {"params": jax.device_put(params, sharding.param_shardings(params, mesh, False)), "router_bias": ROUTER_BIAS}
    scored, greedy = scoring.row_scores(trainer.build_trainer(mesh_cfg, mesh), state, rows, 8, min_width=4)
    assert rel_err(scored, nats) < 1e-5
    record = scoring.scores(task, scored, greedy, rows.cut, 1.5)
    ll = -nats.reshape(6, 4)
    chars = np.array([[len(c) for c in e.choices] for e in task.examples])
    gold = np.array([e.gold for e in task.examples])
    assert record["acc"] == np.mean(ll.argmax(1) == gold)
    assert record["acc_norm"] == np.mean((ll / chars).argmax(1) == gold)
    gold_bytes = sum(len((" " + e.choices[e.gold]).encode()) for e in task.examples)
    assert abs(record["bpb"] - -ll[np.arange(6), gold].sum() / np.log(2) / gold_bytes) < 1e-5 * record["bpb"]
    assert (record["examples"], record["cut_on_the_left"], record["chance"]) == (6, cut, 0.25)


def test_val_bits_per_byte_count_the_bytes_the_targets_spell(bundled_shards):
    """Token byte lengths add up to the val documents' UTF-8 bytes (the special tokens spell none), and the
    validation set's bytes per token is its targets' text, decoded, over their count."""
    val = dataset.TokenDataset(bundled_shards, "val", tok.VOCAB_SIZE)
    all_tokens = val.read(0, val.n_tokens)
    assert tok.token_bytes()[all_tokens].sum() == sum(len(d.encode()) for d in corpus_documents("val"))
    T, batch, n = 64, 16, 3
    ids = dataset.validation_window_ids(val, T, batch, n).reshape(-1)
    enc = tok.get_tokenizer()
    text_bytes = sum(len(enc.decode_bytes([t for t in w[1:] if t != tok.EOT_ID]))
                     for w in dataset.read_windows(val, T, ids))
    assert dataset.validation_bytes_per_token(val, T, batch, n) == text_bytes / (len(ids) * T)
    assert metrics_schema.bits_per_byte(2 * np.log(2), 0.5) == pytest.approx(4.0)


def test_an_unknown_task_exits_2_naming_the_flag_and_the_tasks(cpu_env, tmp_path):
    proc = subprocess.run([sys.executable, "main.py", "--eval_tasks", "kjv_endings,arc_easyy", "--output_dir",
                           str(tmp_path)], cwd=REPO, env=cpu_env, capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 2, proc.stderr
    with pytest.raises(tasks.TaskError) as refusal:         # its words: test_harness_tasks.py, with and without it
        scoring.load_tasks("kjv_endings,arc_easyy")
    assert proc.stderr.strip().splitlines()[-1] == f"error: {refusal.value}"
    assert not os.listdir(tmp_path)


def test_each_tasks_numbers_go_to_wandb_under_its_name():
    from rundir import wandb_scalars
    record = metrics_schema.metrics_record("tasks", 360, task="kjv_endings", acc=0.3, acc_norm=0.25, bpb=1.7, examples=207,
                                  cut_on_the_left=0, chance=0.25, seconds=4.0)
    assert wandb_scalars(record) == {f"tasks/kjv_endings/{name}": record[name] for name in
                                     ("acc", "acc_norm", "bpb", "examples", "cut_on_the_left", "chance", "seconds")}


def test_evaluate_scores_a_checkpoint_on_another_mesh_as_the_run_did(cpu_env, tmp_path):
    """--evaluate on (2,2,2) of a run trained on (1,1,1), both with --pipeline_repeats 2 (so a circular pipeline
    over pp = 2): the val cross-entropy and bits per byte and each task's scores the run recorded at that step,
    in fp32, the harness's tasks included (its multiple-choice one the bundled task's first 12 examples: the
    same scores); one JSON file more in the run directory, with every request's log-likelihood."""
    pytest.importorskip("lm_eval", reason="lm-evaluation-harness: pip install -r requirements-eval.txt")
    flags = [*TINY_FLAGS, "--eval_tasks", "kjv_endings,tests/harness_tasks/kjv_choice.yaml,tests/harness_tasks/kjv_next.yaml",
             "--eval_tasks_limit", "12", "--val_batch_size", "4", "--blocks", "4", "--layers_per_block", "1",
             "--pipeline_repeats", "2", "--output_dir", str(tmp_path), "--name", "run"]
    main_py = lambda *args: subprocess.run([sys.executable, "main.py", *flags, *args], cwd=REPO, env=cpu_env,
                                           capture_output=True, text=True, timeout=CEILING_S)
    trained = main_py("--training_steps", "2", "--n_device_axis", "1", "1", "1", "--train_batch_size", "4")
    assert trained.returncode == 0, trained.stderr[-3000:]
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    in_the_loop = [r for r in records if r.get("task")]
    assert [r["task"] for r in in_the_loop] == ["kjv_endings", "kjv_choice", "kjv_next"]
    assert {k: v for k, v in in_the_loop[0].items() if k not in ("task", "seconds", "time")} == {
        k: v for k, v in in_the_loop[1].items() if k not in ("task", "seconds", "time")}
    [final] = [r for r in records if "final_val_loss" in r]
    before = sorted(str(p) for p in (tmp_path / "run").rglob("*"))
    evaluated = main_py("--evaluate", "--n_device_axis", "2", "2", "2", "--cpu_devices", "8")
    assert evaluated.returncode == 0, evaluated.stderr[-3000:]
    result = json.loads((tmp_path / "run" / "evaluation-2.json").read_text())
    assert sorted(str(p) for p in (tmp_path / "run").rglob("*")) == sorted(before + [str(tmp_path / "run" /
                                                                                         "evaluation-2.json")])
    assert (result["step"], result["mesh"], in_the_loop[0]["step"]) == (2, [2, 2, 2], 2)
    assert result["checkpoint"] == f"{tmp_path}/run/checkpoints/2"
    assert abs(result["val_loss"] - final["final_val_loss"]) <= 1e-5 * final["final_val_loss"]
    assert abs(result["val_bpb"] - final["final_val_bpb"]) <= 1e-5 * final["final_val_bpb"]
    fields = ("task", "acc", "acc_norm", "examples", "cut_on_the_left", "chance")
    for scored, task in zip(result["tasks"], in_the_loop, strict=True):
        assert {k: scored[k] for k in fields} == {k: task[k] for k in fields}
        assert abs(scored["bpb"] - task["bpb"]) <= 1e-5 * task["bpb"]
    endings, choice, following = result["tasks"]
    assert [len(t["requests"]) for t in result["tasks"]] == [48, 48, 12]
    assert endings["requests"] == choice["requests"]
    assert following["requests"][0]["continuation"] == " " + json.loads(open(
        f"{REPO}/tests/harness_tasks/kjv_next.jsonl").readline())["ending"]
    assert f"written to {tmp_path}/run/evaluation-2.json" in evaluated.stdout


def test_a_vocabulary_too_small_for_the_tasks_text_exits_2_naming_both_flags(cpu_env, tmp_path):
    proc = subprocess.run([sys.executable, "main.py", "--vocab_size", "1000", "--output_dir", str(tmp_path)], cwd=REPO,
                          env=cpu_env, capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 2, proc.stderr
    assert re.fullmatch(r"error: --eval_tasks kjv_endings: its text is cl100k_base ids up to \d+, beyond --vocab_size "
                        r"1000; raise --vocab_size to 100277 or pass --eval_tasks ''", proc.stderr.strip().splitlines()[-1])
    assert not os.listdir(tmp_path)
