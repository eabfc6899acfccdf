"""lm-evaluation-harness's tasks (requirements-eval.txt), by registered name or task YAML file, scored on our
mesh: the harness builds each task's loglikelihood requests and computes its metrics from our
log-likelihoods with its own code (process_results, aggregation), as it does from a model's.

The harness gets each task's data as it would on this machine (the hub, its cache, or a local file that a
task YAML names); only multiple_choice and loglikelihood tasks are scored, generation needs a sampler.
"""
import json
from collections import defaultdict
from pathlib import Path

import numpy as np
import yaml

from tasks import TaskError

REQUIREMENTS = "requirements-eval.txt"
SCORED_OUTPUT_TYPES = ("multiple_choice", "loglikelihood")


class HarnessTask:
    """One harness task's requests (tasks.Task's interface), its documents cut to the first `limit`."""

    def __init__(self, name, task, limit):
        task.build_all_requests(limit=limit or None, rank=0, world_size=1)
        by_doc = defaultdict(list)
        for instance in task.instances:
            by_doc[instance.doc_id].append(instance)
        self.name, self._task = name, task
        self._docs = [sorted(by_doc[doc_id], key=lambda i: i.idx) for doc_id in sorted(by_doc)]   # each doc's requests
        self._instances = [instance for instances in self._docs for instance in instances]
        self.requests = tuple(tuple(instance.arguments) for instance in self._instances)
        starts = np.cumsum([0] + [len(instances) for instances in self._docs])
        self.gold = tuple(int(start) + self._gold_choice(instances[0].doc)
                          for start, instances in zip(starts, self._docs))
        self.chance = (float(np.mean([1 / len(instances) for instances in self._docs]))
                       if task.OUTPUT_TYPE == "multiple_choice" else None)

    def metrics(self, ll_R, greedy_R):
        """The harness's metrics of the task (acc, acc_norm, ...) from each request's (log-likelihood, greedy)."""
        for instance, ll, greedy in zip(self._instances, ll_R, greedy_R):
            instance.resps = [(float(ll), bool(greedy))]
        self._task.apply_filters()
        values, key = defaultdict(list), next(iter(self._instances[0].filtered_resps))
        for instances in self._docs:
            results = [instance.filtered_resps[key] for instance in instances]
            for metric, value in self._task.process_results(instances[0].doc, results).items():
                values[metric].append(value)
        aggregate = self._task.aggregation()
        return {metric: float(aggregate[metric](v)) for metric, v in values.items()}

    def _gold_choice(self, doc):
        """The index of the document's right continuation among its requests, as process_results finds it (the
        first of several right ones); a loglikelihood task's one request."""
        if self._task.OUTPUT_TYPE != "multiple_choice":
            return 0
        choices = self._task.doc_to_choice(doc)
        gold = self._task.doc_to_text(doc) if self._task.multiple_input else self._task.doc_to_target(doc)
        gold = gold[0] if isinstance(gold, list) else gold
        return choices.index(gold) if isinstance(gold, str) else int(gold)


def load(specs, limit, bundled):
    """A list of HarnessTasks per spec of --eval_tasks (a group is several), or TaskError in one line."""
    if not specs:
        return []
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise TaskError(f"--eval_tasks {','.join(specs)}: not one of this repository's tasks ({', '.join(bundled)}), "
                        f"and lm-evaluation-harness, which scores any other, is not installed: "
                        f"pip install -r {REQUIREMENTS}") from None
    files = [spec for spec in specs if spec.endswith((".yaml", ".yml"))]
    for spec in files:
        _check_task_file(spec)
    manager = TaskManager(include_defaults=len(files) < len(specs))
    return [_load_spec(manager, spec, limit, bundled) for spec in specs]


def _load_spec(manager, spec, limit, bundled):
    try:
        loaded = manager.load([spec])["tasks"]
    except KeyError:
        raise TaskError(f"--eval_tasks: no task {spec!r}; this repository's are {', '.join(bundled)}; the harness's "
                        f"are listed by `lm-eval ls tasks`; a task YAML file's path also works") from None
    for name, task in loaded.items():
        if task.OUTPUT_TYPE not in SCORED_OUTPUT_TYPES:
            raise TaskError(f"--eval_tasks {spec}: task {name}'s output type is {task.OUTPUT_TYPE}; only "
                            f"{' and '.join(SCORED_OUTPUT_TYPES)} tasks are scored (generation needs a sampler)")
    return [HarnessTask(name, task, limit) for name, task in loaded.items()]


class _AnyTagLoader(yaml.SafeLoader):
    """Reads a harness YAML without resolving its tags (!function ...)."""


_AnyTagLoader.add_multi_constructor("", lambda loader, suffix, node: None)


def _check_task_file(path):
    """A task YAML that exists and parses, and, when its data is local JSON, every row of it: one line naming
    the file and the row that does not (the harness's own error names neither)."""
    try:
        config = yaml.load(Path(path).read_text(), Loader=_AnyTagLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise TaskError(f"--eval_tasks {path}: not a readable task YAML ({' '.join(str(e).split())})") from None
    if not isinstance(config, dict):
        raise TaskError(f"--eval_tasks {path}: not a task YAML (a mapping of task:, dataset_path:, ...)")
    if config.get("dataset_path") != "json":
        return
    data_files = (config.get("dataset_kwargs") or {}).get("data_files") or []
    for files in (data_files.values() if isinstance(data_files, dict) else [data_files]):
        for data_file in [files] if isinstance(files, str) else files:
            _check_json_rows(path, data_file)


def _check_json_rows(task_file, data_file):
    try:
        lines = Path(data_file).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TaskError(f"--eval_tasks {task_file}: its data file {data_file} cannot be read ({e})") from None
    if not data_file.endswith(".jsonl"):
        lines = ["\n".join(lines)]
    for row, text in enumerate(lines, 1):
        try:
            if text.strip():
                json.loads(text)
        except json.JSONDecodeError as e:
            where = f"row {row}" if len(lines) > 1 else f"line {e.lineno}"
            raise TaskError(f"--eval_tasks {task_file}: {data_file} {where} is not JSON ({e.msg})") from None
