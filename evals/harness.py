"""lm-evaluation-harness's tasks (requirements-eval.txt), by registered name or task YAML file, scored on our
mesh: the harness builds each task's loglikelihood requests and computes its metrics from our
log-likelihoods with its own code (process_results, aggregation), as it does from a model's.

The harness gets each task's data as it would on this machine (the hub, its cache, or a local file that a
task YAML names); only multiple_choice and loglikelihood tasks are scored, generation needs a sampler.
Whatever fails while a task is built (its YAML, an include, a `!function`, a Jinja template, its data, a
document) is a TaskError of one line naming the task and the cause, before anything is trained.
"""
import contextlib
import itertools
import json
import os
import socket
import stat
import sysconfig
import threading
import traceback
import urllib.parse
import urllib.request
from collections import defaultdict
from pathlib import Path

import numpy as np
import yaml

from evals.tasks import TaskError

REQUIREMENTS = "requirements-eval.txt"
SCORED_OUTPUT_TYPES = ("multiple_choice", "loglikelihood")
TASK_FILE = (".yaml", ".yml")
# datasets' builders that read the files a task names, not the hub
LOCAL_BUILDERS = ("json", "csv", "parquet", "arrow", "text", "pandas")
HUB_PROBE_S = 3         # the hub's answer to a connection, or it is taken as unreachable


class HarnessTask:
    """One harness task's requests (a tasks.Task), its documents cut to the first `limit`; TaskError
    names the first document that cannot be scored as asked."""

    def __init__(self, name, task, limit):
        task.build_all_requests(limit=limit or None, rank=0, world_size=1)
        by_doc = defaultdict(list)
        for instance in task.instances:
            by_doc[instance.doc_id].append(instance)
        docs = list(itertools.islice(task.eval_docs, limit or None))      # doc_id: the index here
        if not docs:
            raise TaskError(f"task {name} has no documents to score")
        self.name, self._task = name, task
        self._docs = [sorted(by_doc[doc_id], key=lambda i: i.idx) for doc_id in range(len(docs))]  # each doc's requests
        self._instances = [instance for instances in self._docs for instance in instances]
        self.requests = tuple(tuple(instance.arguments) for instance in self._instances)
        starts = np.cumsum([0] + [len(instances) for instances in self._docs])
        self.gold = tuple(int(start) + self._gold_choice(doc_id, doc, instances)
                          for doc_id, (start, doc, instances) in enumerate(zip(starts, docs, self._docs)))
        self.chance = (float(np.mean([1 / len(instances) for instances in self._docs]))
                       if task.OUTPUT_TYPE == "multiple_choice" else None)

    def metrics(self, ll_B, greedy_B):
        """The harness's metrics of the task (acc, acc_norm, ...) from each request's (log-likelihood, greedy)."""
        for instance, ll, greedy in zip(self._instances, ll_B, greedy_B):
            instance.resps = [(float(ll), bool(greedy))]
        self._task.apply_filters()
        values, key = defaultdict(list), next(iter(self._instances[0].filtered_resps))
        for instances in self._docs:
            results = [instance.filtered_resps[key] for instance in instances]
            for metric, value in self._task.process_results(instances[0].doc, results).items():
                values[metric].append(value)
        aggregate = self._task.aggregation()
        return {metric: float(aggregate[metric](v)) for metric, v in values.items()}

    def _gold_choice(self, doc_id, doc, instances):
        """The index of a document's right continuation among its requests, as process_results finds it (the
        first of several right ones); a loglikelihood task's one request. The harness scores a gold that is
        none of the choices as a miss, where our bpb would read another document's request, and drops a
        document of no choices: refused, naming the row, as is an empty continuation (nothing to score)."""
        row = f"row {doc_id + 1} (doc_id {doc_id})"
        gold = self._multiple_choice_gold(row, doc) if self._task.OUTPUT_TYPE == "multiple_choice" else 0
        if not instances or any(not continuation for _, continuation in (i.arguments for i in instances)):
            raise TaskError(f"{row}: its continuation is empty; a scored continuation has one character or more")
        return gold

    def _multiple_choice_gold(self, row, doc):
        choices = self._task.doc_to_choice(doc)
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise TaskError(f"{row}: its choices are {choices!r}; a multiple-choice document needs a list of one "
                            f"or more non-empty strings")
        gold = self._task.doc_to_text(doc) if self._task.multiple_input else self._task.doc_to_target(doc)
        golds = [_choice_index(g, choices) for g in (gold if isinstance(gold, list) else [gold])]
        if not golds or None in golds:
            raise TaskError(f"{row}: its gold {gold!r} is not one of its {len(choices)} choices (an index from 0 "
                            f"to {len(choices) - 1}, or a choice's text)")
        return golds[0]


def _choice_index(gold, choices):
    """A gold's index among the choices (it is one, or an index of one: a whole number, which a data set's
    column of labels may hold as a float), or None."""
    if isinstance(gold, str):
        return choices.index(gold) if gold in choices else None
    whole = isinstance(gold, (int, float, np.number)) and float(gold).is_integer()
    return int(gold) if whole and 0 <= gold < len(choices) else None


def load(specs, limit, bundled):
    """A list of HarnessTasks per spec of --eval_tasks (a group is several), or TaskError in one line."""
    if not specs:
        return []
    names = [spec for spec in specs if not spec.endswith(TASK_FILE)]
    configs = [_checked_task_file(spec) for spec in specs if spec.endswith(TASK_FILE)]
    if names or any(map(_reads_the_hub, configs)):
        _offline_unless_the_hub_answers()
    try:
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise TaskError(f"--eval_tasks {','.join(specs)}: not one of this repository's tasks ({', '.join(bundled)}), "
                        f"and lm-evaluation-harness, which scores any other, is not installed: "
                        f"pip install -r {REQUIREMENTS}") from None
    manager = TaskManager(include_defaults=bool(names))
    return [_load_spec(manager, spec, limit, bundled) for spec in specs]


def _load_spec(manager, spec, limit, bundled):
    entry = manager.task_index.get(spec)
    if entry is None and not spec.endswith(TASK_FILE):
        raise TaskError(f"--eval_tasks: no task {spec!r}; this repository's are {', '.join(bundled)}; the harness's "
                        f"are listed by `lm-eval ls tasks`; a task YAML file's path also works")
    with _one_line(spec, spec if entry is None or entry.yaml_path is None else f"{spec} ({entry.yaml_path})"):
        loaded = manager.load([spec])["tasks"]
        for name, task in loaded.items():
            if task.OUTPUT_TYPE not in SCORED_OUTPUT_TYPES:
                raise TaskError(f"task {name}'s output type is {task.OUTPUT_TYPE}; only "
                                f"{' and '.join(SCORED_OUTPUT_TYPES)} tasks are scored (generation needs a sampler)")
        return [HarnessTask(name, task, limit) for name, task in loaded.items()]


@contextlib.contextmanager
def _one_line(spec, label=None):
    """Whatever fails inside, as one TaskError line '--eval_tasks LABEL (default: spec): CAUSE' (a TaskError
    raised inside is its cause); data the hub could not give, with how to get them."""
    try:
        yield
    except Exception as e:
        why = str(e) if isinstance(e, TaskError) else cause(e)
        hint = f"; {NO_HUB.format(spec=spec)}" if isinstance(e, ConnectionError) else ""
        raise TaskError(f"--eval_tasks {label or spec}: {why}{hint}") from None


NO_HUB = ("its data are on the Hugging Face hub, which cannot be reached (offline, or HF_HUB_OFFLINE=1), and this "
          "machine's cache does not hold them: cache them once where the hub answers, with the same HF_HOME (`lm-eval "
          "run --model dummy --tasks {spec} --limit 1`), or give --eval_tasks a task YAML over local files "
          "(dataset_path: json, as tests/harness_tasks/kjv_choice.yaml)")
LIBRARIES = tuple({sysconfig.get_paths()[kind] for kind in ("stdlib", "platstdlib", "purelib", "platlib")})
HARNESS_TASK = os.path.join("lm_eval", "api", "task.py")
REPOSITORY = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUR_CODE = (REPOSITORY, os.path.dirname(os.path.abspath(__file__)))      # the top level and evals/


def cause(e):
    """An exception in one line, 'Type: message (at FILE:LINE, in FUNCTION)', where is the innermost frame of a
    task's own code (a `!function`'s module) or of the harness's Task (the step that failed: download,
    doc_to_text, ...), the places a task file's fault shows; the rest of the stack is library plumbing."""
    message = " ".join(str(e).split())
    for frame in reversed(traceback.extract_tb(e.__traceback__)):
        file = frame.filename
        task_code = not (file.startswith(LIBRARIES + ("<",)) or os.path.dirname(file) in OUR_CODE)
        if task_code or file.endswith(HARNESS_TASK):
            where = f" (at {HARNESS_TASK if file.endswith(HARNESS_TASK) else file}:{frame.lineno}, in {frame.name})"
            break
    else:
        where = ""
    return f"{type(e).__name__}{': ' if message else ''}{message}{where}"


def _offline_unless_the_hub_answers():
    """HF_HUB_OFFLINE=1 when the Hugging Face hub does not answer within HUB_PROBE_S (unless the environment
    sets offline mode either way): huggingface_hub retries an unreachable hub for 30-50 s before the harness
    fails, where offline mode loads what the cache holds at once and fails at once on the rest. Called before
    the harness is imported: the hub's libraries read the variable then."""
    if {"HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"} & set(os.environ):
        return
    if not _answers(os.environ.get("HF_ENDPOINT") or "https://huggingface.co"):
        os.environ["HF_HUB_OFFLINE"] = "1"


def _answers(url):
    """Whether a connection to url's host (or to the environment's proxy for its scheme) opens within
    HUB_PROBE_S, its name lookup included (in a thread: getaddrinfo has no timeout of its own)."""
    target = urllib.parse.urlsplit(urllib.request.getproxies().get(urllib.parse.urlsplit(url).scheme) or url)
    address = (target.hostname, target.port or (443 if target.scheme == "https" else 80))
    opened = []

    def connect():
        with contextlib.suppress(OSError), socket.create_connection(address, timeout=HUB_PROBE_S):
            opened.append(True)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(HUB_PROBE_S)
    return bool(opened)


class _AnyTagLoader(yaml.SafeLoader):
    """Reads a harness YAML without resolving its tags (!function ...)."""


_AnyTagLoader.add_multi_constructor("", lambda loader, suffix, node: None)


def _checked_task_file(spec):
    """A task YAML's config, its includes merged, checked as far as it can be before the harness reads it: each
    file parses, no include cycle, every local data file is a regular file (a FIFO or a device would hang the
    read) and, for the json builder, has rows that parse; one line naming the file and the cause (the
    harness's own errors name neither)."""
    with _one_line(spec):
        config = _task_config(spec, ())
        if not (config.get("task") or config.get("group")):
            raise TaskError("names no task (a task YAML has task: NAME, or group: NAME)")
        for data_file in _local_data_files(config):
            kind = _not_regular(data_file)
            if kind:
                raise TaskError(f"its data file {data_file} is {kind}, not a regular file; name a file of rows")
            if config.get("dataset_path") == "json":
                _check_json_rows(data_file)
        return config


def _task_config(path, including):
    """Task YAML `path`'s config (`including`: the files that include it, outermost first), its includes merged
    under it as the harness merges them, tags such as !function unresolved."""
    where = f"its include {path}: " if including else ""
    if os.path.realpath(path) in map(os.path.realpath, including):
        raise TaskError(f"its includes form a cycle ({' -> '.join((*including, path))})")
    try:
        config = yaml.load(Path(path).read_text(), Loader=_AnyTagLoader)
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise TaskError(f"{where}not a readable task YAML ({' '.join(str(e).split())})") from None
    if not isinstance(config, dict):
        raise TaskError(f"{where}not a task YAML (a mapping of task:, dataset_path:, ...)")
    includes = config.pop("include", [])
    merged = {}
    for include in [includes] if isinstance(includes, str) else includes:
        merged.update(_task_config(os.path.join(os.path.dirname(path), include), (*including, path)))
    return {**merged, **config}


def _reads_the_hub(config):
    """Whether a task's data come from the hub: its dataset_path is neither a local builder nor a local path."""
    path = config.get("dataset_path")
    return isinstance(path, str) and path not in LOCAL_BUILDERS and not os.path.exists(path)


def _local_data_files(config):
    """The data files a task config names (dataset_kwargs' data_files: one, a list, or a list per split)."""
    data_files = (config.get("dataset_kwargs") or {}).get("data_files") or []
    for files in (data_files.values() if isinstance(data_files, dict) else [data_files]):
        yield from (f for f in (files if isinstance(files, list) else [files]) if isinstance(f, str))


NOT_REGULAR = {stat.S_IFIFO: "a FIFO (named pipe)", stat.S_IFDIR: "a directory", stat.S_IFCHR: "a character device",
               stat.S_IFBLK: "a block device", stat.S_IFSOCK: "a socket"}


def _not_regular(path):
    """What an existing path that is not a regular file is ('a FIFO (named pipe)', ...); None for a regular file
    or none (the reader says that it is missing)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None
    return None if stat.S_ISREG(mode) else NOT_REGULAR.get(stat.S_IFMT(mode), "not a regular file")


def _check_json_rows(data_file):
    """A JSON (Lines) data file that reads, has rows, and whose every row parses."""
    try:
        lines = Path(data_file).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise TaskError(f"its data file {data_file} cannot be read ({e})") from None
    if not data_file.endswith(".jsonl"):
        lines = ["\n".join(lines)]
    rows = 0
    for row, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            rows += json.loads(text) != []          # a .json file of no rows: []
        except json.JSONDecodeError as e:
            where = f"row {row}" if len(lines) > 1 else f"line {e.lineno}"
            raise TaskError(f"{data_file} {where} is not JSON ({e.msg})") from None
    if not rows:
        raise TaskError(f"its data file {data_file} has no rows")
