"""A run's checkpoint read after the fact (main.py's --evaluate and --sample) on this job's mesh, whatever mesh
saved it: the model config it recorded (`checkpoint_config`), its state restored (`restore_on_this_mesh`), and
--evaluate's scores of it, printed and written beside the run's files (`evaluate`). Nothing here trains or
writes a checkpoint."""
import dataclasses
import sys

import jax

import metrics_schema
import sharding
import utils
from checkpoints import SaveFailed, checkpoint_manager, newest_meta, restore_latest
from evals import scoring
from metrics import evaluate as val_loss_and_balance
from multihost import log, validate_on_devices
from rundir import RunRefused, os_error, run_dir_of
from trainer import build_trainer


def checkpoint_config(cfg, flag):
    """(cfg with the model config that the checkpoint of --step (0: the run's newest readable one) recorded,
    validated, and the run's checkpoints, read-only); RunRefused for a run with none, or a --step it does not
    keep (naming those it keeps)."""
    mngr = checkpoint_manager(run_dir_of(cfg.run), read_only=True)
    kept, step = sorted(mngr.all_steps()), cfg.run.step
    if step and step not in kept:
        raise RunRefused(f"--step {step}: {mngr.directory} keeps no checkpoint of that step; " + (
            f"it keeps steps {', '.join(map(str, kept))}" if kept else "it keeps none: train the run first"))
    chosen = newest_meta(mngr, [step] if step else kept)
    if chosen is None:
        raise RunRefused(f"{flag}: no readable checkpoint {f'of step {step} ' if step else ''}in {mngr.directory}"
                         + ("" if kept else "; train the run first"))
    fields = {f.name for f in dataclasses.fields(utils.ModelConfig)}
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, **{k: v for k, v in (chosen[1].get("model") or {}).items() if k in fields}))
    return validate_on_devices(cfg), mngr


def restore_on_this_mesh(cfg, mngr):
    """(trainer, state, metadata) of the checkpoint of --step (0: the newest readable one), restored on
    this run's mesh (cfg.run.dims), whatever mesh saved it."""
    trainer = build_trainer(cfg, sharding.run_mesh(cfg.run))
    steps = [cfg.run.step] if cfg.run.step else None
    state, meta = restore_latest(mngr, trainer.abstract_state, None, cfg.model, steps)
    mngr.close()
    return trainer, state, meta


def evaluate(cfg, tasks, trainer, state, step, checkpoints, val_batches, bytes_per_token):
    """--evaluate's scores of the checkpoint of step `step` in `checkpoints` (its directory), restored: the val
    set's cross-entropy and bits per byte over val_batches and the TaskScorer's tasks, printed as they come and
    written to OUTPUT_DIR/NAME (scoring.write_evaluation); the exit status (1: a task could not be scored)."""
    run_dir = run_dir_of(cfg.run)
    val_ce = val_loss_and_balance(trainer, state, val_batches)[0]
    result = {"checkpoint": f"{checkpoints}/{step}", "step": step, "mesh": list(cfg.run.dims.shape),
              "val_loss": val_ce, "val_bpb": metrics_schema.bits_per_byte(val_ce, bytes_per_token), "tasks": [],
              "failed": {}}
    log(f"evaluation @ {step} of {checkpoints}: val cross-entropy {val_ce:.4f} nats, {result['val_bpb']:.4f} "
        f"bits per byte")
    for name, record, failure in tasks.each(trainer, state, with_requests=True):
        if record:
            result["tasks"].append(record)
        else:
            result["failed"][name] = failure
        log(scoring.line(record) if record else f"{name}: not scored ({failure})")
    if jax.process_index() == 0:
        try:
            log(scoring.write_evaluation(run_dir, result))
        except OSError as e:
            raise SaveFailed(f"--evaluate: the evaluation of step {step} cannot be written in {run_dir} "
                             f"({os_error(e)}); nothing was left there, its numbers are the lines above") from None
    if result["failed"]:
        print(f"error: --eval_tasks {','.join(result['failed'])} could not be scored (the lines above say why); the "
              f"other tasks' scores are written", file=sys.stderr)
    return 1 if result["failed"] else 0
