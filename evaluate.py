"""Scoring downstream tasks (tasks.py) on the training mesh, as lm-evaluation-harness scores a
multiple-choice task from its loglikelihood requests: each candidate continuation's log-likelihood given
its context, summed over the continuation's tokens; per task

  acc       the share of examples whose gold continuation has the highest log-likelihood,
  acc_norm  the same with each log-likelihood divided by its continuation's length in characters,
  bpb       the gold continuations' summed nats / (ln 2 x their UTF-8 bytes): bits per byte.

Every (example, choice) is one row of --T tokens: the context's and the continuation's ids, cut on the left
to T + 1 as the harness cuts them (counted), inputs x = ids[:-1], targets y = ids[1:], padded on the right
(causal attention and per-sequence routing in position order: padding changes no real token's score). Rows
go through the eval-mode model --val_batch_size at a time (trainer.score_step); every process builds the
same rows and reads the same replicated sums, so all agree on one result.
"""
import dataclasses
import time

import jax
import numpy as np

from tasks import TaskError
from utils import bits_per_byte


@dataclasses.dataclass(frozen=True)
class Rows:
    """A task's rows [R, T] in (example, choice) order: inputs, targets, and 1 where a target is one of the
    continuation's tokens; `cut`: rows whose ids were cut on the left to fit --T."""
    x: np.ndarray
    y: np.ndarray
    mask: np.ndarray
    cut: int


def encode_pair(enc, context, continuation):
    """(context ids, continuation ids) as the harness encodes a request: the context's trailing whitespace
    moves to the continuation, whose ids are those of context + continuation past the context's; an empty
    context is <|endoftext|> (the token every document starts with)."""
    if not context:
        return [enc.eot_token], enc.encode_ordinary(continuation)
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    context_ids = enc.encode_ordinary(context)
    return context_ids, enc.encode_ordinary(context + continuation)[len(context_ids):]


def task_rows(task, enc, T):
    """The rows of every (example, choice) of `task`."""
    pairs = [encode_pair(enc, e.context, choice) for e in task.examples for choice in e.choices]
    x, y = np.full((2, len(pairs), T), enc.eot_token, np.int32)
    mask, cut = np.zeros((len(pairs), T), np.int32), 0
    for r, (context_ids, continuation_ids) in enumerate(pairs):
        ids = (context_ids + continuation_ids)[-(T + 1):]
        cut += len(ids) < len(context_ids) + len(continuation_ids)
        n = len(ids) - 1
        x[r, :n], y[r, :n] = ids[:-1], ids[1:]
        mask[r, n - min(len(continuation_ids), n):n] = 1
    return Rows(x, y, mask, cut)


def row_nats(trainer, state, rows, batch_rows):
    """Each row's summed nats over its continuation [R]: batch_rows rows a step (the last batch padded
    with rows that score nothing), every step dispatched before the first is fetched."""
    R, T = rows.x.shape
    padded = lambda a: np.concatenate([a, np.zeros((-R % batch_rows, T), a.dtype)])
    x, y, mask = padded(rows.x), padded(rows.y), padded(rows.mask)
    sums = [trainer.score_step(state["params"], state["router_bias"],
                               *(_on_mesh(a[i:i + batch_rows], trainer.data_sharding) for a in (x, y, mask)))
            for i in range(0, len(x), batch_rows)]
    return np.concatenate(jax.device_get(sums))[:R]


def _on_mesh(rows, sharding):
    """[B, T] host rows, the same on every process, as a global array laid out as `sharding`."""
    return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])


def scores(task, nats_R, cut, seconds):
    """The record of a task from its rows' nats: acc, acc_norm, bpb, the counts, chance and the time."""
    ll, correct, normed, gold_nats, gold_bytes, r = -nats_R, [], [], 0.0, 0, 0
    for e in task.examples:
        ll_C = ll[r:r + len(e.choices)]
        chars_C = np.array([len(c) for c in e.choices], np.float64)
        correct.append(int(np.argmax(ll_C)) == e.gold)
        normed.append(int(np.argmax(ll_C / chars_C)) == e.gold)
        gold_nats += float(nats_R[r + e.gold])
        gold_bytes += len(e.choices[e.gold].encode("utf-8"))
        r += len(e.choices)
    return {"task": task.name, "acc": float(np.mean(correct)), "acc_norm": float(np.mean(normed)),
            "bpb": bits_per_byte(gold_nats, gold_bytes), "examples": len(task.examples), "cut_on_the_left": cut,
            "chance": task.chance, "seconds": seconds}


class TaskScorer:
    """The tasks of a run, tokenized once (`rows`), scored on the trainer's mesh at every call."""

    def __init__(self, tasks, enc, T, batch_rows, vocab_size):
        self.tasks, self.batch_rows = tasks, batch_rows
        self.rows = [task_rows(task, enc, T) for task in tasks]
        for task, rows in zip(tasks, self.rows):
            largest = max(rows.x.max(initial=0), rows.y.max(initial=0))
            if largest >= vocab_size:
                raise TaskError(f"--eval_tasks {task.name}: its text is cl100k_base ids up to {largest}, beyond "
                                f"--vocab_size {vocab_size}; raise --vocab_size to {enc.n_vocab} or pass "
                                f"--eval_tasks ''")

    def __call__(self, trainer, state):
        """One record per task (utils.METRICS["tasks"]' fields)."""
        records = []
        for task, rows in zip(self.tasks, self.rows):
            t0 = time.perf_counter()
            nats_R = row_nats(trainer, state, rows, self.batch_rows)
            records.append(scores(task, nats_R, rows.cut, time.perf_counter() - t0))
        return records


def line(record):
    """'kjv_endings: acc 30.0% (chance 25%) | acc_norm 22.7% | bpb 1.785 | 207 examples, 1 cut on the left | 14 s'"""
    return (f"{record['task']}: acc {100 * record['acc']:.1f}% (chance {100 * record['chance']:.0f}%) | "
            f"acc_norm {100 * record['acc_norm']:.1f}% | bpb {record['bpb']:.3f} | {record['examples']} examples, "
            f"{record['cut_on_the_left']} cut on the left | {record['seconds']:.0f} s")
