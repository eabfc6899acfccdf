"""Scoring downstream tasks (evals/tasks.py's, evals/harness.py's) on the training mesh, as lm-evaluation-harness scores
a task from its loglikelihood requests: each request's continuation's log-likelihood given its context, summed
over the continuation's tokens, and whether every one of those tokens is the greedy choice; per task

  acc       the share of examples whose gold continuation has the highest log-likelihood (a loglikelihood
            task's: whose continuation is the greedy one),
  acc_norm  the same with each log-likelihood divided by its choice's length in characters,
  bpb       the gold continuations' summed nats / (ln 2 x their UTF-8 bytes): bits per byte.

Every request is one row of --T tokens: the context's and the continuation's ids, cut on the left
to T + 1 as the harness cuts them (counted), inputs x = ids[:-1], targets y = ids[1:], padded on the right
(causal attention and per-sequence routing in position order: padding changes no real token's score). Rows
go through the eval-mode model --val_batch_size at a time, longest first, each batch no wider than it needs
(trainer.score_step, `row_scores`); every process builds the same rows and reads the same replicated sums, so
all agree on one result.
"""
import dataclasses
import itertools
import json
import time

import fsspec
import jax
import numpy as np

from data.tokenizer import get_tokenizer
from evals import harness
from evals.tasks import BUNDLED, Task, TaskError
from metrics_schema import bits_per_byte
from rundir import RunRefused, write_whole


@dataclasses.dataclass(frozen=True)
class Rows:
    """A task's rows [B, T], a request each, in the order of its requests: inputs, targets, and 1 where a target
    is one of the continuation's tokens; `cut`: rows whose ids were cut on the left to fit --T."""
    x: np.ndarray
    y: np.ndarray
    mask: np.ndarray
    cut: int


def encode_pair(enc, context, continuation):
    """(context ids, continuation ids) as the harness encodes a request for the exported model, whose tokenizer
    starts every text with <|endoftext|> (its bos, the token every training document starts with): the
    context's trailing whitespace moves to the continuation, whose ids are those of context + continuation
    past the context's."""
    n_spaces = len(context) - len(context.rstrip())
    if n_spaces:
        context, continuation = context[:-n_spaces], context[-n_spaces:] + continuation
    context_ids = enc.encode_ordinary(context)
    return [enc.eot_token] + context_ids, enc.encode_ordinary(context + continuation)[len(context_ids):]


def load_tasks(names, limit=0):
    """The tasks of --eval_tasks (comma-separated: bundled names, else lm-evaluation-harness task names or task
    YAML files), in that order, each cut to its first `limit` examples (0: all, as the harness's --limit);
    TaskError names the flag and what exists."""
    names = [n for n in (n.strip() for n in names.split(",")) if n]
    harness_tasks = iter(harness.load([n for n in names if n not in BUNDLED], limit, sorted(BUNDLED)))
    tasks = []
    for name in names:
        if name in BUNDLED:
            task = BUNDLED[name]()
            tasks.append(dataclasses.replace(task, examples=task.examples[:limit or None]))
        else:
            tasks += next(harness_tasks)
    return tasks


def task_scorer(cfg):
    """--eval_tasks, tokenized once; RunRefused names an unknown task."""
    try:
        tasks = load_tasks(cfg.run.eval_tasks, cfg.run.eval_tasks_limit)
        return TaskScorer(tasks, get_tokenizer(), cfg.model.T, cfg.run.val_batch_size, cfg.model.vocab_size)
    except TaskError as e:
        raise RunRefused(str(e)) from None


def task_rows(task, enc, T):
    """The rows of every request of `task`."""
    pairs = [encode_pair(enc, context, continuation) for context, continuation in task.requests]
    x, y = np.full((2, len(pairs), T), enc.eot_token, np.int32)
    mask, cut = np.zeros((len(pairs), T), np.int32), 0
    for r, (context_ids, continuation_ids) in enumerate(pairs):
        ids = (context_ids + continuation_ids)[-(T + 1):]
        cut += len(ids) < len(context_ids) + len(continuation_ids)
        n = len(ids) - 1
        x[r, :n], y[r, :n] = ids[:-1], ids[1:]
        mask[r, n - min(len(continuation_ids), n):n] = 1
    return Rows(x, y, mask, cut)


# A task's short rows go through the model narrower than --T (a power of two, at least this wide), so that a
# pod scoring hellaswag's ~100-token requests at --T 1024 does not pay for the padding; few widths, few compiles.
MIN_WIDTH = 128


def batch_plan(rows, batch_rows, min_width=MIN_WIDTH):
    """How row_scores runs `rows`: (the rows' order, longest first, the last batch padded with repeats that score
    nothing; per batch of batch_rows, (its rows, its width, its window)). The width is the narrowest that holds
    the batch's longest row (a power of two >= min_width, at most T), the window the positions a row through the
    output layer: the batch's longest continuation (`pipeline.continuation_scores`)."""
    n_rows, T = rows.x.shape
    lengths = T - np.argmax(rows.mask[:, ::-1] > 0, axis=1)          # up to the continuation's last token
    order = np.argsort(-lengths, kind="stable")
    order = np.concatenate([order, np.full(-n_rows % batch_rows, order[-1])])     # the last batch: repeats, dropped
    plan = []
    for i in range(0, len(order), batch_rows):
        batch = order[i:i + batch_rows]
        width = min(T, max(min_width, _power_of_two(lengths[batch[0]])))
        window = min(width, max(8, _power_of_two(rows.mask[batch].sum(axis=1).max())))
        plan.append((batch, width, window))
    return order, plan


def row_scores(trainer, state, rows, batch_rows, min_width=MIN_WIDTH, stop=lambda: False):
    """Each row's summed nats over its continuation [B] and whether all its tokens are greedy [B]: the rows in
    batches of batch_rows as `batch_plan` lays them out, each only as wide as its longest row and only as many
    positions a row through the output layer as its longest continuation needs. No score changes: attention is
    causal and an expert's capacity counts --T whatever the width (model.expert_capacity), so the tokens after a
    row's end, padding, never reach it. Each step is fetched while the next runs, and a stop() then ends the
    scoring (None: a stop came; every process asks at the same points)."""
    order, plan = batch_plan(rows, batch_rows, min_width)
    fetched, running = [], None
    for batch, width, window in plan:
        on_mesh = [_on_mesh(np.ascontiguousarray(a[batch, :width]), trainer.data_sharding)
                   for a in (rows.x, rows.y, rows.mask)]
        dispatched = trainer.score_step(state["params"], state["router_bias"], *on_mesh, window)
        if running is not None:
            fetched.append(jax.device_get(running))
            if stop():
                return None
        running = dispatched
    fetched.append(jax.device_get(running))
    nats, greedy = (np.concatenate(a) for a in zip(*fetched))
    n_rows = len(rows.x)
    unsorted = np.empty(n_rows, np.int64)
    unsorted[order[:n_rows]] = np.arange(n_rows)
    return nats[unsorted], greedy[unsorted]


def _power_of_two(n):
    """The smallest power of two >= n (>= 1): few shapes, few compiles."""
    return 1 << int(max(n, 1) - 1).bit_length()


def _on_mesh(rows, sharding):
    """[B, T] host rows, the same on every process, as a global array laid out as `sharding`."""
    return jax.make_array_from_callback(rows.shape, sharding, lambda index: rows[index])


def scores(task: Task, nats_B, greedy_B, cut, seconds):
    """The record of a task from its rows' nats and greedy flags: acc, acc_norm (None where the task has
    none), bpb, the counts, chance (None: not a choice) and the time."""
    metrics = task.metrics(-nats_B.astype(np.float64), greedy_B)
    gold_bytes = sum(len(task.requests[r][1].encode("utf-8")) for r in task.gold)
    return {"task": task.name, "acc": metrics.get("acc"), "acc_norm": metrics.get("acc_norm"),
            "bpb": bits_per_byte(float(np.sum(nats_B[list(task.gold)])), gold_bytes), "examples": len(task.gold),
            "cut_on_the_left": cut, "chance": task.chance, "seconds": seconds}


class TaskScorer:
    """The tasks of a run, tokenized once (`rows`), scored on the trainer's mesh at every call."""

    def __init__(self, tasks: list[Task], enc, T, batch_rows, vocab_size):
        self.tasks, self.batch_rows = tasks, batch_rows
        self.rows = [task_rows(task, enc, T) for task in tasks]
        for task, rows in zip(tasks, self.rows):
            largest = max(rows.x.max(initial=0), rows.y.max(initial=0))
            if largest >= vocab_size:
                raise TaskError(f"--eval_tasks {task.name}: its text is cl100k_base ids up to {largest}, beyond "
                                f"--vocab_size {vocab_size}; raise --vocab_size to {enc.n_vocab} or pass "
                                f"--eval_tasks ''")

    def shapes(self):
        """The (rows, width, window) of every batch that scoring the tasks runs (`batch_plan`): the score steps
        trainer.compile_interval_steps compiles before the first step."""
        return {(self.batch_rows, width, window) for rows in self.rows
                for _, width, window in batch_plan(rows, self.batch_rows)[1]}

    def each(self, trainer, state, with_requests=False):
        """(task name, its record, None) or (task name, None, why it failed in one line) per task, in order, as
        each is scored: a task that fails (its metric code, the harness's) costs only its own scores."""
        for i, task in enumerate(self.tasks):
            try:
                record, failure = self.score(i, trainer, state, with_requests), None
            except Exception as e:
                record, failure = None, harness.cause(e)
            yield task.name, record, failure

    def score(self, i, trainer, state, with_requests=False, stop=lambda: False):
        """The record of task i (metrics_schema.METRICS["tasks"]' fields); with_requests: and each request's context,
        continuation, log-likelihood and is_greedy (the harness's --log_samples). None: stop() came first."""
        task, rows, t0 = self.tasks[i], self.rows[i], time.perf_counter()
        scored = row_scores(trainer, state, rows, self.batch_rows, stop=stop)
        if scored is None:
            return None
        nats_B, greedy_B = scored
        record = scores(task, nats_B, greedy_B, rows.cut, time.perf_counter() - t0)
        if with_requests:
            record["requests"] = [{"context": context, "continuation": continuation, "loglikelihood": -float(nats),
                                   "is_greedy": bool(greedy)}
                                  for (context, continuation), nats, greedy in zip(task.requests, nats_B, greedy_B)]
        return record


def line(record):
    """'kjv_endings: acc 29.0% (chance 25%) | acc_norm 23.2% | bpb 1.785 | 207 examples, 2 cut on the left | 14 s'"""
    chance = "" if record["chance"] is None else f" (chance {100 * record['chance']:.0f}%)"
    acc_norm = "" if record["acc_norm"] is None else f"acc_norm {100 * record['acc_norm']:.1f}% | "
    return (f"{record['task']}: acc {100 * record['acc']:.1f}%{chance} | {acc_norm}bpb {record['bpb']:.3f} | "
            f"{record['examples']} examples, {record['cut_on_the_left']} cut on the left | {record['seconds']:.0f} s")


def evaluation_file(step, n):
    """The name of the n-th (from 1) evaluation of a step: evaluation-STEP.json, then evaluation-STEP.N.json."""
    return f"evaluation-{step}.json" if n == 1 else f"evaluation-{step}.{n}.json"


def write_evaluation(run_dir, result):
    """--evaluate's result, written whole to RUN_DIR under the first evaluation_file of its step not there yet:
    an evaluation of a step done before (another --eval_tasks, another mesh) is kept, never replaced. The line
    that says where; OSError when it cannot be written, nothing left."""
    fs, path = fsspec.core.url_to_fs(run_dir)
    names = (evaluation_file(result["step"], n) for n in itertools.count(1))
    earlier = list(itertools.takewhile(lambda name: fs.exists(f"{path.rstrip('/')}/{name}"), names))
    name = evaluation_file(result["step"], len(earlier) + 1)
    written = write_whole(run_dir, name, json.dumps(result, indent=1) + "\n")
    return f"written to {written}" + (f" (beside {', '.join(earlier)}, kept)" if earlier else "")
