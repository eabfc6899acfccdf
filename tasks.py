"""Downstream tasks: each a list of multiple-choice examples (a context, candidate continuations, the gold
one's index), scored by evaluate.py as lm-evaluation-harness scores its multiple-choice tasks.

The bundled task, `kjv_endings`, needs nothing but this repository: every third verse of the held-out books of
the bundled corpus (data/corpus.py's VAL_BOOKS, never trained on) split at its middle word, its true ending
among three endings of other held-out verses, drawn with a fixed seed (chance 25%).
"""
import dataclasses
import gzip
import json

import numpy as np

from data import corpus


@dataclasses.dataclass(frozen=True)
class Example:
    context: str
    choices: tuple          # candidate continuations, each scored given the context
    gold: int               # the index of the right one


@dataclasses.dataclass(frozen=True)
class Task:
    name: str
    examples: tuple

    @property
    def chance(self):
        """The accuracy of a uniform random guess."""
        return float(np.mean([1 / len(e.choices) for e in self.examples]))


KJV_MIN_WORDS = 8           # shorter verses leave too little of a beginning or an ending
# Every third verse keeps the scoring a small share of `python main.py` (docs/performance.md, "Downstream tasks' cost").
KJV_EVERY = 3


def kjv_endings(n_choices=4, seed=0):
    """The bundled task: "<a held-out verse's first half>" -> " <its second half>" among n_choices - 1
    other verses' second halves; every KJV_EVERY-th verse of KJV_MIN_WORDS words or more in corpus order, the
    distractors (any of those verses' endings) and the gold's place drawn from numpy's default_rng(seed)."""
    verses = []
    with gzip.open(corpus.PATH, "rt", encoding="utf-8") as f:
        for line in f:
            chapter = json.loads(line)
            if chapter["book"] in corpus.VAL_BOOKS:
                verses += [v.split() for v in chapter["text"].split("\n") if len(v.split()) >= KJV_MIN_WORDS]
    halves = [(" ".join(w[:len(w) // 2]), " " + " ".join(w[len(w) // 2:])) for w in verses]
    endings = [end for _, end in halves]
    rng, examples = np.random.default_rng(seed), []
    for beginning, ending in halves[::KJV_EVERY]:
        others = [endings[j] for j in rng.permutation(len(endings)) if endings[j] != ending][:n_choices - 1]
        gold = int(rng.integers(n_choices))
        examples.append(Example(beginning, tuple(others[:gold] + [ending] + others[gold:]), gold))
    return Task("kjv_endings", tuple(examples))


BUNDLED = {"kjv_endings": kjv_endings}


class TaskError(ValueError):
    """A task that cannot be scored: an unknown name, a file that does not parse."""


def load_tasks(names, limit=0):
    """The tasks of --eval_tasks (comma-separated names), each cut to its first `limit` examples (0: all, as
    lm-evaluation-harness's --limit); TaskError names the flag and what exists."""
    tasks = []
    for name in filter(None, (n.strip() for n in names.split(","))):
        if name not in BUNDLED:
            raise TaskError(f"--eval_tasks: no task {name!r}; the tasks are: {', '.join(sorted(BUNDLED))}")
        task = BUNDLED[name]()
        tasks.append(dataclasses.replace(task, examples=task.examples[:limit or None]))
    return tasks
