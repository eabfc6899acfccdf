"""The metrics schema: every field main.py writes to RUN_DIR/metrics.jsonl, and what it means (plot.py and
docs/training.md read them from here, without loading jax). Each record has "step" and "time" (Unix seconds
when it was made); its other fields are those of one kind. A per-MoE-layer value is a list indexed by layer
(expert_load: per layer, per expert); wandb gets NAME/layerI (and NAME/layerI/expertJ). `parse` takes a line
back to its record, or says why the line holds none (rundir.metrics_records, the one reader, skips it).
"""
import json
import math
import time

METRICS = {
    "step": {       # one per optimizer step
        "loss": "training loss of the step (cross-entropy + balance term)",
        "ce": "training cross-entropy",
        "balance": "balance term (alpha applied, summed over MoE layers)",
        "grad_norm": "global grad norm before clipping",
        "lr": "learning rate of the update",
        "drop_rate": "fraction of routed choices dropped for capacity",
        "skipped_steps": "updates skipped as spikes so far (--skip_spikes)",
        "grad_norm_ratio": "grad norm over the median of the previous 20 steps' (null until 10 are seen)",
        "update_skipped": "whether this step's update was skipped",
        "loss_jump": "loss minus the median of the previous 10 losses (null before 10)",
        "nonfinite": "whether the loss, gradient or updated state was not finite (the update was then skipped: "
                     "parameters, moments and routing bias unchanged)",
    },
    "interval": {   # one per evaluation, every --checkpoint_steps
        "val_loss": "validation cross-entropy (without the balance term)",
        "val_bpb": "validation bits per byte: summed nats / (ln 2 x the UTF-8 bytes the targets spell)",
        "val_balance": "validation balance term",
        "train_loss": "mean training loss over the interval",
        "lr": "learning rate of the interval's last update",
        "grad_norm": "grad norm of the interval's last step",
        "tokens_per_s": "training tokens per second (compilation excluded)",
        "step_time_s": "seconds per step",
        "mfu": "model FLOPs utilisation (null where the device's peak is unknown)",
        "expert_load": "per MoE layer, each expert's share of the routed choices (1/E: balanced)",
        "idle_expert_fraction": "per MoE layer, the fraction of experts that got no token",
        "load_max_over_mean": "per MoE layer, the busiest expert's load over the mean",
        "layer_drop_rate": "per MoE layer, the fraction of routed choices dropped",
        "layer_balance": "per MoE layer, the balance term (alpha applied; balance is their sum)",
        "expert_load_spread": "max/min expert load over the worst MoE layer (null when an expert is idle)",
        "drop_rate": "mean drop rate over the interval",
        "balance": "mean balance term over the interval",
        "skipped_steps": "updates skipped as spikes so far",
        "max_loss_jump": "largest loss_jump of the interval",
        "max_grad_norm_ratio": "largest grad_norm_ratio of the interval",
        "steps": "steps whose statistics the record holds (train_loss, drop_rate, balance, the experts' loads)",
        "partial": "whether steps of the interval are missing from those: trained by an earlier session, before the "
                   "checkpoint this one resumed from (the loads of a few steps can leave an expert idle)",
    },
    "final": {      # once, when the run ends
        "final_val_loss": "validation cross-entropy at the end",
        "final_val_bpb": "validation bits per byte at the end",
        "unigram_entropy": "entropy of the training tokens' unigram distribution (the no-context baseline)",
    },
    "tasks": {      # per task of --eval_tasks, at every checkpoint (evals/scoring.py)
        "task": "the task's name",
        "acc": "share of examples whose gold continuation has the highest log-likelihood (loglikelihood tasks: "
               "whose continuation is the greedy one)",
        "acc_norm": "the same, each log-likelihood divided by its continuation's length in characters (or null)",
        "bpb": "the gold continuations' bits per byte: summed nats / (ln 2 x their UTF-8 bytes)",
        "examples": "examples scored",
        "cut_on_the_left": "requests (rows) whose context was cut on the left to fit --T",
        "chance": "the accuracy of a uniform random guess (null: not a choice among candidates)",
        "seconds": "time the scoring took",
    },
    "goodput": {    # per process run (session): at every checkpoint and when it ends, where its time went so far
        "wall_s": "seconds from the process's start to this record (at the end: to its last checkpoint)",
        "startup_s": "imports, devices, the data and the restore",
        "compile_s": "the first training step (its compile)",
        "train_s": "the other training steps",
        "eval_s": "validation",
        "checkpoint_s": "saving (the final save's wait included)",
        "tasks_s": "downstream tasks (--eval_tasks)",
        "sample_s": "text samples",
        "redone_steps": "steps a previous session trained past the checkpoint this one resumed from",
        "redone_s": "their share of train_s (time lost to the restart)",
        "down_s": "seconds from the previous session's last record to this process's start (the failure, its "
                  "detection and the restart); null for the first session",
        "goodput": "(train_s - redone_s) / wall_s",
    },
    "run_goodput": {    # with each goodput record on process 0: the whole run, every session so far
        "run_sessions": "process runs of this run so far, this one included",
        "run_wall_s": "seconds from the first session's start to this record",
        **{f"run_{p}_s": f"{p}_s of every session, summed" for p in ("startup", "compile", "train", "eval",
                                                                      "checkpoint", "tasks", "sample")},
        "run_lost_s": "work of interrupted sessions after their last goodput record (at their last checkpoint): "
                      "done again by the next session",
        "run_down_s": "time between one session's last record and the next one's start, summed",
        "run_goodput": "run_train_s / run_wall_s (the phases, run_lost_s and run_down_s add up to run_wall_s)",
    },
    "event": {"event": "start (a fresh run), resume (from the checkpoint of this step) or stop (checkpointed at "
                       "this step, before anything else, on a signal or a lost terminal)",
              "process_start": "Unix seconds when this session's process started",
              "cause": "what stopped the run: SIGTERM, SIGINT, SIGHUP, stdout/stderr lost (a closed terminal or "
                       "pipe) or another host's stop"},
}


# Each kind's fields that every record of it holds, in every version of main.py (fields added later are
# optional: an older run's records lack them); the first marks the kind.
REQUIRED = {"step": ("loss",), "interval": ("val_loss",), "final": ("final_val_loss",), "tasks": ("task", "acc", "bpb"),
            "goodput": ("wall_s",), "run_goodput": ("run_wall_s",), "event": ("event",)}


def _number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _count(v):
    return isinstance(v, int) and not isinstance(v, bool)


def _per_layer(v):
    return isinstance(v, list) and len(v) > 0 and all(x is None or _number(x) for x in v)


def _per_expert(v):
    return isinstance(v, list) and len(v) > 0 and all(map(_per_layer, v)) and len({len(layer) for layer in v}) == 1


OPTIONAL_NUMBER = ("a number or null", lambda v: v is None or _number(v))   # a non-finite float is written null
NUMBER, COUNT = ("a number", _number), ("a whole number", _count)
FLAG, TEXT = ("true or false", lambda v: isinstance(v, bool)), ("a string", lambda v: isinstance(v, str))
# (what, test) of each field whose JSON type is not OPTIONAL_NUMBER
TYPES = {"step": COUNT, "time": NUMBER, "skipped_steps": COUNT, "update_skipped": FLAG, "nonfinite": FLAG,
         "steps": COUNT, "partial": FLAG, "expert_load": ("a list per MoE layer of as many numbers each", _per_expert),
         **dict.fromkeys(("idle_expert_fraction", "load_max_over_mean", "layer_drop_rate", "layer_balance"),
                         ("a list of numbers, one per MoE layer", _per_layer)),
         "task": TEXT, "acc": NUMBER, "examples": COUNT, "cut_on_the_left": COUNT, "seconds": NUMBER,
         **{name: NUMBER for kind in ("goodput", "run_goodput") for name in METRICS[kind]
            if name.endswith("_s") and name != "down_s"},
         "redone_steps": COUNT, "run_sessions": COUNT, "event": TEXT, "process_start": NUMBER, "cause": TEXT}


def kind_of(record):
    """The kind (a key of METRICS) of a record that `problem` accepts."""
    return next(kind for kind, fields in REQUIRED.items() if fields[0] in record)


def parse(line):
    """(the record a metrics.jsonl line, bytes without its newline, holds; None) or (None, why it holds none)."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        return None, f"not UTF-8 (byte {line[e.start]:#04x} at column {e.start + 1})"
    try:
        record = json.loads(text)
    except (ValueError, RecursionError):            # RecursionError: brackets nested past Python's stack
        return None, "not JSON (a record cut short by a kill, or damaged)"
    why = problem(record)
    return (record, None) if why is None else (None, why)


def problem(record):
    """Why `record`, a metrics.jsonl line parsed, is not one main.py writes (None when it is): a JSON object with a
    whole-number step, the mark of one kind and the fields every record of it holds, and each of its kind's
    fields of the type TYPES gives. Its readers (plot.py, a resume's goodput) then take it as it is."""
    if not isinstance(record, dict):
        return f"{_shown(record)} is not a record (a JSON object)"
    if not _count(record.get("step")):
        return "a record without a whole-number step"
    kinds = [kind for kind, fields in REQUIRED.items() if fields[0] in record]
    if len(kinds) != 1:
        return (f"a record of {' and '.join(kinds)} at once" if kinds else
                f"a record of no kind (none of {', '.join(fields[0] for fields in REQUIRED.values())})")
    kind = kinds[0]
    a_record = f"{'an' if kind[0] in 'aeiou' else 'a'} {kind} record"
    missing = [name for name in REQUIRED[kind] if name not in record]
    if missing:
        return f"{a_record} without {', '.join(missing)}"
    for name, value in record.items():
        what, test = TYPES.get(name, OPTIONAL_NUMBER)
        if (name in METRICS[kind] or name == "time") and not test(value):
            return f"{a_record} whose {name} is {_shown(value)}, not {what}"
    return None


def _shown(value):
    text = json.dumps(value)
    return text if len(text) <= 40 else f"{text[:37]}..."


def metrics_record(kind, step, **values):
    """A metrics.jsonl record of `kind`; every field must be in METRICS[kind] (ValueError otherwise)."""
    unknown = set(values) - set(METRICS[kind])
    if unknown:
        raise ValueError(f"metrics {sorted(unknown)} are not in metrics_schema.METRICS[{kind!r}]")
    return {"step": step, "time": round(time.time(), 3), **values}


def bits_per_byte(nats_per_token, bytes_per_token):
    """Bits per UTF-8 byte of text from a cross-entropy in nats per token: comparable across tokenizers."""
    return nats_per_token / (math.log(2) * bytes_per_token)
