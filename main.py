"""The training driver: set up the devices, open the run (its directory, the data, the state restored or
fresh), train, finish; `--sample`, `--evaluate` and `--compile_for` (planning/report.py) are its other modes.

`python main.py` with no flags trains the `tiny` preset on the bundled corpus (tokenized once into
$JAXFORMER_CACHE, default ~/.cache/jaxformer) on whatever devices exist; every field of the config is a
flag (`python main.py --help`). A run lives in OUTPUT_DIR/NAME (rundir.py: metrics, samples, the lock),
its checkpoints in OUTPUT_DIR/NAME/checkpoints (checkpoints.py); starting the same command again
resumes from the newest readable checkpoint, exactly: the data loader is a pure function of the
sequences consumed, and they, the RNG key, the optimizer state, the step and the model config are in
the checkpoint. SIGTERM, SIGHUP, Ctrl-C or a lost terminal: finish the step (or the piece of an interval's
evaluation, tasks or sample under way), save, exit 0 (a SIGHUP
ignored at start, as nohup does, stays ignored). No progress for --hang_timeout s (a host stopped or lost mid-collective): every thread's stack to stderr, exit 3;
SIGUSR1: the stacks now, and go on (multihost.Watchdog).

Steps are counted in optimizer updates; "step k" is the k-th update, and its loss is the loss of the
batch that update was computed from. Each update averages the gradients of `--grad_step` micro-steps
of DP x `--train_batch_size` sequences each (trainer.py).

Read it from the bottom: `main` sets up the devices and calls `train`, whose loop is
`state, metrics = trainer.step(state, batch)` with the interval's work (evaluate and log in
metrics.py, save, sample) in small functions above it.
"""
import dataclasses
import functools
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

if __name__ == "__main__" and {"-h", "--help"} & set(sys.argv[1:]):
    import utils                   # --help before jax loads (its import takes seconds, more on a busy machine)
    utils.build_parser().parse_args()

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

import dataset
import generate
import hardware
import metrics_schema
import sharding
import utils
from checkpoints import (SaveFailed, check_can_save, check_saves, checkpoint_manager, checksums_and_finite,
                         compile_checksums, discard_failed_saves, quiet_failed_saves, restore_latest, save,
                         wait_for_save)
from data.shards import OutputError
from data.tokenizer import get_tokenizer
from evals import restored, scoring
from metrics import Diverged, log_interval
from multihost import log, set_up_devices, validate_on_devices
from planning import fit
from progress import Progress
from rundir import Logger, RunRefused, lock_run_dir, metrics_records, os_error, run_dir_of, set_aside_previous_run
from trainer import Trainer, build_trainer, compile_interval_steps


def data_dir_for(cfg):
    """--data_dir, or the bundled corpus' shards, tokenized into $JAXFORMER_CACHE on first use."""
    if cfg.run.data_dir:
        return cfg.run.data_dir
    cache = dataset.default_cache_dir()
    try:
        return dataset.ensure_bundled_shards(cache, say=log)
    except (OSError, OutputError) as e:
        raise dataset.DataError(f"JAXFORMER_CACHE={cache}: cannot write the bundled corpus' shards there "
                                f"({os_error(e)}); point JAXFORMER_CACHE at a writable directory, or pass "
                                f"--data_dir") from None


def next_batch(batches, grad_step):
    """The next optimizer step's batch: (xs, ys), each a tuple of --grad_step global batches [DP x
    --train_batch_size, T] laid out as the trainer's data_sharding."""
    xs, ys = zip(*[next(batches) for _ in range(grad_step)])
    return xs, ys


@dataclasses.dataclass
class Run:
    """What the training loop works with, set up by open_run."""
    cfg: utils.Config
    trainer: Trainer
    mngr: ocp.CheckpointManager
    logger: "Logger"
    train_ds: dataset.TokenDataset
    val_batches: list
    val_bytes_per_token: float  # UTF-8 bytes per target token of the val batches (bits per byte)
    tasks: scoring.TaskScorer  # --eval_tasks, tokenized
    loader: dataset.BatchLoader
    state: dict                 # the state to start from: restored, or fresh
    meta: dict                  # the restored checkpoint's metadata; None for a fresh run
    start_step: int
    start_seq: int              # sequences consumed before this process started
    run_id: str
    sample_ids: list            # the prompt's token ids
    sampler: Callable = None    # sample(state, step) -> new ids, compiled before the first step; None: no samples

    @property
    def sequences_per_step(self):
        return utils.sequences_per_step(self.cfg)


def check_data_source(cfg):
    """RunRefused when a pod preset would train on the bundled corpus (no --data_dir)."""
    if cfg.preset in utils.FINEWEB_PRESETS and not cfg.run.data_dir:
        raise RunRefused(f"--data_dir: --preset {cfg.preset} is the guide's run on FineWeb-Edu, not the bundled "
                         f"corpus; tokenize it first ({utils.TOKENIZE_FINEWEB}) and pass --data_dir "
                         f"gs://BUCKET/fineweb-edu (--compile_for needs no data)")


def open_run(cfg, mesh):
    """Take the run directory, print the run's header, load the data, restore or start the state; first --remat
    auto settled for the devices (fit.settle_auto_remat) and with --fit the setting that fits them
    (fit.fit_to_devices), which the run's config then holds."""
    cfg, plan = fit.settle_auto_remat(cfg, mesh, log)      # a step it compiles is the run's: it fits, --fit has no work
    trainer = plan and plan.trainer
    if cfg.run.fit and trainer is None:
        # the state alone first, from shapes (seconds): no setting --fit compiles makes it smaller
        fit.check_fits(cfg, build_trainer(cfg, mesh), state_only=True)
        cfg, trainer = fit.fit_to_devices(cfg, mesh, log)       # with the train step it compiled, if it did
    trainer = trainer or build_trainer(cfg, mesh)   # shapes and shardings: nothing compiled or allocated yet
    fit.check_fits(cfg, trainer)                  # before the run directory is touched or anything allocated
    rc, proc0 = cfg.run, jax.process_index() == 0
    run_dir = run_dir_of(rc)
    sample_ids = prompt_ids(cfg.inference, cfg.model.T)  # a prompt that cannot be sampled stops the run here
    tasks = scoring.task_scorer(cfg)
    on_process_0(lambda: lock_run_dir(run_dir))
    if rc.restart:                              # every host opens the checkpoints after they moved
        on_process_0(lambda: set_aside_previous_run(run_dir))
    print_header(cfg)
    train_ds, val_batches, val_bytes_per_token = load_data(cfg, trainer.data_sharding)
    mngr = checkpoint_manager(run_dir)
    check_can_save(mngr, trainer.abstract_state)
    compile_checksums(trainer.abstract_state)
    restored = restore_latest(mngr, trainer.abstract_state, run_dir, cfg.model)
    state, meta = restored if restored is not None else (trainer.fresh_state(rc.seed), None)
    if meta is None:              # once per run: a resume's log follows the first session's, which has it
        print_mfu_formula()
    start_step, start_seq, run_id = start_position(meta, cfg)
    if meta is not None:
        log(f"resumed from {mngr.directory}/{start_step}: step {start_step}, data position {start_seq} "
            f"sequences, run id {run_id}")
    logger = Logger(cfg, run_dir, run_id, proc0)
    loader = dataset.BatchLoader(train_ds, cfg.model.T, utils.global_batch(cfg),
                                 trainer.data_sharding, rc.seed, consumed=start_seq)
    return Run(cfg, trainer, mngr, logger, train_ds, val_batches, val_bytes_per_token, tasks, loader, state, meta,
               start_step, start_seq, run_id, sample_ids)


def start_position(meta, cfg):
    """(step, sequences consumed, run id) to start from: a checkpoint's metadata, or None for step 0."""
    if meta is None:
        return 0, 0, uuid.uuid4().hex[:8]
    step = int(meta["step"])
    # sequences consumed, whatever batch layout consumed them (checkpoints before it: data_step batches)
    global_batch = utils.global_batch(cfg)
    sequences = int(meta.get("sequences", meta.get("data_step", step * cfg.optim.grad_step) * global_batch))
    return step, sequences, meta.get("run_id") or uuid.uuid4().hex[:8]


def print_header(cfg):
    log(utils.config_lines(cfg))
    counts = sharding.count_params(cfg.model)
    log(f"params: total {counts['total']:,} | active {counts['active']:,} | embedding {counts['embedding']:,} "
        f"(active: used per token, without the embedding)")
    log(f"mesh: {cfg.run.dims.words} over {cfg.run.dims.n_devices} of {jax.device_count()} "
        f"{jax.devices()[0].device_kind} device(s), {jax.process_count()} process(es)")


def print_mfu_formula():
    """How MFU is counted: a long line, printed when a run starts fresh (once per run directory)."""
    log(f"{hardware.MFU_FORMULA}; model FLOPs per token = {sharding.FLOPS_PER_TOKEN} (rope_layers: every layer with "
        f"--rope_all_layers, else the dense ones); pipeline bubbles and remat are not counted")


def load_data(cfg, data_sharding):
    """(the training split, the fixed validation batches: --eval_steps batches of --val_batch_size sequences in
    all, so the same windows on every mesh, and the UTF-8 bytes per target token they hold)."""
    mc, rc = cfg.model, cfg.run
    data_dir = data_dir_for(cfg)
    try:
        train_ds = dataset.TokenDataset(data_dir, "train", mc.vocab_size)
        val_ds = dataset.TokenDataset(data_dir, "val", mc.vocab_size)
    except dataset.DataError as e:
        if rc.data_dir:
            raise type(e)(f"--data_dir {rc.data_dir}: {e}") from None
        raise
    val_batches = dataset.validation_batches(val_ds, mc.T, rc.val_batch_size, data_sharding, rc.eval_steps)
    if len(val_batches) < rc.eval_steps:
        log(f"note: the val split holds {val_ds.n_windows(mc.T)} windows of {mc.T + 1} tokens, enough for "
            f"{len(val_batches)} of --eval_steps {rc.eval_steps} batches of {rc.val_batch_size}; "
            f"evaluating on {len(val_batches)}")
    bytes_per_token = dataset.validation_bytes_per_token(val_ds, mc.T, rc.val_batch_size, rc.eval_steps)
    return train_ds, val_batches, bytes_per_token


def on_process_0(fn):
    """fn() on process 0 while the others wait for it; a RunRefused there stops every process."""
    refused = None
    if jax.process_index() == 0:
        try:
            fn()
        except RunRefused as e:
            refused = e
    if jax.process_count() > 1:
        if multihost_utils.broadcast_one_to_all(np.int32(refused is not None)) and refused is None:
            refused = RunRefused("process 0 refused to start this run; its log says why")
    if refused is not None:
        raise refused


def val_target_reached(val_loss, rc):
    """Whether an evaluation's val cross-entropy ends the run (--stop_at_val_loss; 0 = never)."""
    return rc.stop_at_val_loss > 0 and val_loss is not None and val_loss <= rc.stop_at_val_loss


def save_checkpoint(run, step, state, val_loss, force=False):
    """Start the async save of `state` as step `step`, with what resuming needs in its metadata and a
    checksum of every array (checked at restore). A state that is not finite is never saved: the train
    step keeps one from arising, and one resumed from an older checkpoint is refused here."""
    sums, finite = jax.device_get(checksums_and_finite(state))
    if not finite:
        raise SaveFailed(f"the state of step {step} holds a non-finite value, so it was not saved in "
                         f"{run.mngr.directory}; resume from an earlier checkpoint")
    meta = {"step": step, "sequences": run.start_seq + (step - run.start_step) * run.sequences_per_step,
            "run_id": run.run_id, "model": dataclasses.asdict(run.cfg.model), "val_loss": val_loss,
            "checksums": {path: int(value) for path, value in sums.items()}}
    save(run.mngr, step, state, meta, force=force)
    run.logger.flush()                 # on an object store: metrics and samples up to this checkpoint


def sample(run, state, step):
    """A text sample into the log and samples.txt (none with --max_tokens 0). A failed sample is a
    warning: it never costs the run (the checkpoint is written before it)."""
    if run.sampler is None:
        return
    try:
        text = sample_text(run.sampler, state, step)
        log(f"sample @ {step}:\n{run.cfg.inference.prompt}{text}")
        run.logger.sample(step, run.cfg.inference.prompt, text)
    except Exception as e:
        log(f"WARNING: sampling at step {step} failed ({type(e).__name__}: {e}); training goes on")


def compile_sampler(cfg, trainer, ids):
    """sample(state, step) -> --max_tokens new ids after `ids` (top-k, temperature) from the state's params
    routed with its bias, compiled now (generate.compile_sampler); the key depends on the seed and the step only,
    never on the training key."""
    ic = cfg.inference
    return generate.compile_sampler(trainer.abstract_state, cfg.model, ids, cfg.run.seed + 1, ic.max_tokens, ic.top_k,
                                    ic.temperature, ic.use_cache)


def sample_text(sampler, state, step):
    enc = get_tokenizer()
    return enc.decode([t for t in sampler(state, step) if t < enc.n_vocab])


def compile_programs(run, argv):
    """The train step (fit.compile_train_step) and, in a thread beside it, what an interval's end runs
    (`interval_programs`): all compiled before the first step, in goodput's compile phase. The loop then compiles
    nothing, so a stop at an interval's end saves at once (a pod's first interval end would compile for minutes,
    and a preemption gives 30 s)."""
    with ThreadPoolExecutor(max_workers=1) as pool:      # XLA compiles without the GIL: the two overlap
        interval = pool.submit(interval_programs, run.cfg, run.trainer, run.tasks, run.sample_ids)
        trainer = fit.compile_train_step(run.cfg, run.trainer, argv, log)
        compiled, run.sampler = interval.result()
    run.trainer = trainer._replace(eval_step=compiled.eval_step, score_step=compiled.score_step)


def interval_programs(cfg, trainer, tasks, sample_ids):
    """(trainer with its eval step and the tasks' score steps compiled, the sampler compiled); the sampler is None
    with --max_tokens 0, and where it does not compile: a warning, as a failed sample is."""
    trainer = compile_interval_steps(cfg, trainer, tasks.shapes())
    if not cfg.inference.max_tokens:
        return trainer, None
    try:
        return trainer, compile_sampler(cfg, trainer, sample_ids)
    except Exception as e:
        log(f"WARNING: the sampler does not compile ({type(e).__name__}: {e}); training goes on without samples")
        return trainer, None


@dataclasses.dataclass
class Interval:
    """The work after step `step` (end_interval's: evaluation, checkpoint, tasks, sample) as far as it went. A
    stop between its pieces leaves the rest undone: to --eval_on_stop after the stop's checkpoint (`stopped`),
    and a checkpoint's tasks to the next resume (`resumed`)."""
    step: int
    evaluated: bool = False
    val_ce: float = None                # the evaluation's val cross-entropy
    reached: bool = False               # it met --stop_at_val_loss
    saved: bool = False                 # the checkpoint of `step` is written or being written
    tried: set = dataclasses.field(default_factory=set)  # the tasks scored (or failed): indices in run.tasks.tasks
    sampled: bool = False


def evaluate_interval(run, progress, state, interval, stop=lambda: False):
    """The interval's evaluation, record and line, unless done; a stop between its batches leaves it undone."""
    if not interval.evaluated:
        interval.val_ce = log_interval(run, progress.meter, state, interval.step, stop)
        interval.evaluated = interval.val_ce is not None
        progress.done("eval")


def score_tasks(run, state, interval, stop=lambda: False):
    """The --eval_tasks not tried yet, scored with the state of interval.step: a record and a line each; a stop
    before a task or between its batches leaves the rest unscored. A task that fails is a warning, as a sample
    is: the step's checkpoint is written before, the other tasks are scored, and the run goes on."""
    step = interval.step
    for i, task in enumerate(run.tasks.tasks):
        if i in interval.tried:
            continue
        if stop():
            break
        interval.tried.add(i)           # failed or not: on every process, which then agree on what is left
        try:
            record = run.tasks.score(i, run.trainer, state, stop=stop)
        except Exception as e:
            log(f"WARNING: scoring --eval_tasks {task.name} at step {step} failed ({type(e).__name__}: {e}); "
                f"training goes on")
            continue
        if record is None:              # a stop between its batches: left for --eval_on_stop or the resume
            interval.tried.discard(i)
            break
        run.logger.metrics(metrics_schema.metrics_record("tasks", step, **record))
        log(f"task @ {step}: {scoring.line(record)}")


def sample_interval(run, progress, state, interval, stop=lambda: False):
    """The interval's sample, unless done or a stop came."""
    if not interval.sampled and not stop():
        sample(run, state, interval.step)
        interval.sampled = True
        progress.done("sample")


def close_run(run):
    """Wait for the checkpoint in flight, then close the checkpoints, the logs and the loader."""
    wait_for_save(run.mngr)
    run.mngr.close()
    run.logger.close()
    run.loader.close()


def stopped(run, state, progress, interval):
    """A stop (SIGTERM, SIGHUP, Ctrl-C, a lost terminal, or another host's) after step interval.step, wherever
    it came (a step, the interval's work): its checkpoint first (the interval's own, if already begun, is not
    written twice), written and said where, the cause in metrics.jsonl; only then, with --eval_on_stop, what
    the interval left of its evaluation, the task scores (a stop's checkpoint is a checkpoint) and its sample
    (a preemptible TPU gives ~30 s: nothing compiles or evaluates before the save)."""
    step = interval.step
    if not interval.saved:
        save_checkpoint(run, step, state, interval.val_ce, force=True)
    wait_for_save(run.mngr)
    progress.done("checkpoint")
    cause = progress.signals.signal or "stop requested on another host"
    log(f"{cause}: checkpoint of step {step} written to {run.mngr.directory}/{step} (the same command resumes it)")
    run.logger.metrics(metrics_schema.metrics_record("event", step, event="stop", cause=cause))
    if run.cfg.run.eval_on_stop:
        evaluate_interval(run, progress, state, interval)
        score_tasks(run, state, interval)
        progress.done("tasks")
        sample_interval(run, progress, state, interval)
    progress.report(step, final=True)
    close_run(run)
    return 0


def finished(run):
    """Whether the checkpoint restored is the end of the run: its last step, or --stop_at_val_loss met."""
    return run.meta is not None and (run.start_step >= run.cfg.optim.training_steps
                                     or val_target_reached(run.meta.get("val_loss"), run.cfg.run))


def scores_tasks(cfg, step, reached):
    """Whether the interval that ends at `step` writes a checkpoint and scores --eval_tasks with it: every tenth
    interval, the last step, and the step that reached --stop_at_val_loss."""
    return step % (10 * cfg.run.checkpoint_steps) == 0 or step >= cfg.optim.training_steps or reached


def nothing_to_do(run):
    """A finished run started again: say so, write nothing (no metrics record but the task scores a kill cut
    short, no sample), exit 0."""
    close_run(run)
    val = run.meta.get("val_loss")
    log(f"{run.mngr.directory}/{run.start_step} ends this run (--training_steps {run.cfg.optim.training_steps}"
        + (f", val cross-entropy {val:.4f} at its last evaluation" if val is not None else "")
        + "): nothing to do; raise --training_steps to train on, or add --restart to start over")
    return 0


def finish(run, state, step, val_ce, saved, progress):
    """The end of the run (the last step or --stop_at_val_loss): its checkpoint, and the final val
    cross-entropy against the unigram entropy of the training tokens."""
    if not saved:
        save_checkpoint(run, step, state, val_ce)
    progress.report(step, final=True)             # the final lines once its checkpoint is written
    entropy = run.train_ds.unigram_entropy()          # from the token counts the tokenizer recorded
    bpb = metrics_schema.bits_per_byte(val_ce, run.val_bytes_per_token)
    log(f"final: val cross-entropy {val_ce:.4f} nats, {bpb:.4f} bits per byte | " + (
        f"unigram entropy of the training tokens {entropy:.4f} nats | {abs(entropy - val_ce):.4f} nats "
        f"{'below' if val_ce <= entropy else 'above'} it"
        if entropy is not None else "unigram entropy n/a (the manifest predates token counts; re-tokenize)")
        + f" | {time.perf_counter() - progress.meter.t0:.0f} s")
    run.logger.metrics(metrics_schema.metrics_record("final", step, final_val_loss=val_ce, final_val_bpb=bpb,
                                            unigram_entropy=entropy))
    close_run(run)
    return 0


# ----------------------------------------------------------------------------------------------------------
# The run


def train(cfg, mesh, argv=()):
    """Train the run in OUTPUT_DIR/NAME from its newest checkpoint (or from scratch) to --training_steps
    or --stop_at_val_loss; SIGTERM or Ctrl-C saves and stops early. argv: the command line, for the command
    a step too large for the devices names (fit.does_not_fit)."""
    run = open_run(cfg, mesh)
    cfg = run.cfg                                 # --fit's choice, if it made one
    if finished(run):                             # its last checkpoint's tasks, if a kill cut their scoring short
        score_lost_tasks(run, run.state, resumed(run))
        return nothing_to_do(run)
    progress = Progress(run)
    try:
        compile_programs(run, argv)
    except fit.OutOfMemory:                        # nothing trained: nothing to save
        progress.close()
        close_run(run)
        raise
    state, step, batches = run.state, run.start_step, run.loader.iterate(0)
    interval = resumed(run)
    progress.done("compile")
    progress.signals.compiling = None             # the training step is compiled: a Ctrl-C stops after a task
    score_lost_tasks(run, state, interval, functools.partial(progress.stop_agreed, interval.step))
    progress.done("tasks")
    try:
        while step < cfg.optim.training_steps and not interval.reached and not progress.stopping:
            state, metrics = run.trainer.step(state, next_batch(batches, cfg.optim.grad_step))
            step += 1
            check_saves(run.mngr)                 # a save in flight that failed stops the run here
            if progress.stepped(step, metrics) and not progress.stopping:
                interval = end_interval(run, progress, state, step)
        progress.fetch_all(f"the last step ({step}); then its checkpoint")
    except (Diverged, dataset.DataError):       # the state is sound: the checkpoint in flight completes
        progress.close()
        close_run(run)
        raise
    except SaveFailed:
        progress.close()
        discard_failed_saves(run.mngr)
        run.logger.close()
        run.loader.close()
        raise
    except jax.errors.JaxRuntimeError as e:     # the state was donated to the step that failed: nothing to save
        oom = fit.runtime_out_of_memory(e, f"training step {step + 1} ran")
        if oom is None:
            raise
        progress.close()
        close_run(run)
        raise oom from None
    progress.close()
    if progress.stopping:
        return stopped(run, state, progress, interval if interval.step == step else Interval(step))
    return finish(run, state, step, interval.val_ce, interval.saved, progress)


def end_interval(run, progress, state, step):
    """After step `step`: evaluate and log, save and score the tasks every tenth interval (and at the last
    step or the val target), sample. A stop agreed before any of these, between the evaluation's batches or
    between tasks leaves the rest undone (`stopped` then saves at once). Returns the Interval."""
    rc, interval = run.cfg.run, Interval(step)
    stop = functools.partial(progress.stop_agreed, step)
    progress.fetch_all(f"the evaluation, checkpoint and sample after step {step}")
    evaluate_interval(run, progress, state, interval, stop)
    interval.reached = interval.evaluated and val_target_reached(interval.val_ce, rc)
    if interval.reached:
        log(f"val loss {interval.val_ce:.4f} <= --stop_at_val_loss {rc.stop_at_val_loss} at step {step}: stopping "
            f"here, as at the last step")
    if scores_tasks(run.cfg, step, interval.reached) and not stop():
        save_checkpoint(run, step, state, interval.val_ce)
        interval.saved = True
        progress.done("checkpoint")
        score_tasks(run, state, interval, stop)      # at every checkpoint, the last step's included
        progress.done("tasks")
    sample_interval(run, progress, state, interval, stop)
    if not stop():                        # asked once more: a stop during the sample saves this step, not the next
        progress.interval_done(step, interval.saved, last=interval.reached or step == run.cfg.optim.training_steps)
    return interval


def resumed(run):
    """The Interval of the step this process starts from, all done (a checkpoint's evaluation and sample are
    not redone) but for the --eval_tasks of a checkpoint that scores them (`scores_tasks`) whose records
    metrics.jsonl lacks: a kill or a stop cut its scoring short. Only the checkpoint resumed from: an older one's
    state would need restoring beside this one (`--evaluate --step N` scores any kept)."""
    n_tasks = len(run.tasks.tasks)
    interval = Interval(run.start_step, evaluated=True, saved=True, tried=set(range(n_tasks)), sampled=True)
    if run.meta is not None and n_tasks and scores_tasks(
            run.cfg, run.start_step, val_target_reached(run.meta.get("val_loss"), run.cfg.run)):
        interval.tried = {i for i, recorded in enumerate(tasks_recorded(run, run.start_step)) if recorded}
    return interval


def tasks_recorded(run, step):
    """Whether metrics.jsonl holds a record of step `step` for each --eval_tasks task ([tasks] of 0 or 1): read by
    process 0, which alone writes it, and sent to the others, so that every process scores the same tasks."""
    recorded = np.zeros(len(run.tasks.tasks), np.int32)
    if jax.process_index() == 0:
        names = {r.get("task") for r in metrics_records(run_dir_of(run.cfg.run)) if r.get("step") == step}
        recorded[:] = [task.name in names for task in run.tasks.tasks]
    if jax.process_count() > 1:
        recorded = np.asarray(multihost_utils.broadcast_one_to_all(recorded))
    return recorded


def score_lost_tasks(run, state, interval, stop=lambda: False):
    """The tasks `resumed` found unscored, with the state resumed: before the first step (a stop between them is
    honoured, as during training), or before a finished run says it has nothing to do."""
    lost = [task.name for i, task in enumerate(run.tasks.tasks) if i not in interval.tried]
    if lost:
        log(f"the checkpoint of step {interval.step} has no score of --eval_tasks {','.join(lost)} (its scoring "
            f"was cut short): scoring them now")
        score_tasks(run, state, interval, stop)


def sample_from_checkpoint(cfg):
    """--sample: print one sample for --prompt from the run's newest readable checkpoint, write nothing. The
    key is the one training samples with at that step, so on the same mesh the text is the one samples.txt
    holds."""
    cfg, mngr = restored.checkpoint_config(cfg, "--sample")
    ids = prompt_ids(cfg.inference, cfg.model.T)
    trainer, state, meta = restored.restore_on_this_mesh(cfg, mngr)
    text = sample_text(compile_sampler(cfg, trainer, ids), state, int(meta["step"]))
    log(f"sample @ {meta['step']} of {mngr.directory}:\n{cfg.inference.prompt}{text}")
    return 0


def evaluate_checkpoint(cfg):
    """--evaluate: the val set's cross-entropy and bits per byte and --eval_tasks' scores of the checkpoint of
    --step (0: the run's newest readable one) on this mesh, printed as they come and written to
    OUTPUT_DIR/NAME/evaluation-STEP.json (whole or not at all, beside an earlier one of that step, never over it)
    with every request's log-likelihood; nothing else is written. A task that fails is a line, and `failed` in
    the file; the other tasks are scored and written, and the exit is 1 (evals/restored.py)."""
    cfg, mngr = restored.checkpoint_config(cfg, "--evaluate")
    tasks = scoring.task_scorer(cfg)
    trainer, state, meta = restored.restore_on_this_mesh(cfg, mngr)
    _, val_batches, bytes_per_token = load_data(cfg, trainer.data_sharding)
    return restored.evaluate(cfg, tasks, trainer, state, int(meta["step"]), mngr.directory, val_batches,
                             bytes_per_token)


def prompt_ids(ic, T):
    """The prompt's token ids, checked at start: an empty prompt is <|endoftext|> alone (every document
    starts with it, as the guide samples); RunRefused when prompt + --max_tokens do not fit in --T."""
    enc = get_tokenizer()
    ids = enc.encode_ordinary(ic.prompt) or [enc.eot_token]
    if len(ids) + ic.max_tokens > T:
        fixes = (f"shorten --prompt, lower --max_tokens (to at most {T - len(ids)}) or raise --T" if len(ids) < T else
                 f"shorten --prompt to fewer than {T} tokens or raise --T")
        raise RunRefused(f"--prompt is {len(ids)} tokens and --max_tokens {ic.max_tokens} asks for that many more: "
                         f"{len(ids) + ic.max_tokens} positions, more than --T {T}; {fixes}")
    return ids


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    cfg = utils.config_from_args(argv)
    if cfg.run.compile_for:                 # a pod rehearsal on this machine: no devices, no run directory
        from planning import report         # the report, and the step-time estimate, are for --compile_for alone
        return report.compile_for(cfg, argv)
    set_up_devices(cfg)
    quiet_failed_saves()
    try:
        if cfg.run.sample:                 # validated with the model config the checkpoint recorded
            return sample_from_checkpoint(cfg)
        if cfg.run.evaluate:
            return evaluate_checkpoint(cfg)
        check_data_source(cfg)
        return train(validate_on_devices(cfg), sharding.run_mesh(cfg.run), argv)
    except utils.ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    except RunRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (SaveFailed, Diverged, dataset.DataUnavailable, fit.OutOfMemory) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except dataset.DataError as e:          # the data (or --T, --vocab_size) does not fit the run
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
