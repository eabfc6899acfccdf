"""The training driver: mesh, init or restore, train/eval steps, logging, checkpoints, sampling.

`python main.py` with no flags trains the `tiny` preset on the bundled corpus (tokenized once into
$JAXFORMER_CACHE, default ~/.cache/jaxformer) on whatever devices exist; every field of the config is a
flag (`python main.py --help`). A run lives in OUTPUT_DIR/NAME (`--output_dir`, `--name`): checkpoints/,
metrics.jsonl (its fields: utils.METRICS), samples.txt (none with `--max_tokens 0`) and, with `--wandb`,
the wandb files, plus `lock` while a run holds the directory. OUTPUT_DIR may be any fsspec URL
(gs://bucket/runs): there metrics and samples go out as whole numbered objects
(metrics.jsonl.parts/000001, ...) at each checkpoint, since object stores cannot append. Starting the same
command again resumes from the newest readable checkpoint, exactly: the data loader is a pure function
of the sequences consumed, and they, the RNG key, the optimizer state, the step and the model config
are in the checkpoint (a model of another shape is refused before anything is touched; `--restart`
moves the old run aside). SIGTERM or Ctrl-C: finish the step, save, exit 0. `--sample`: sample from
the newest checkpoint, train nothing, write nothing.

Steps are counted in optimizer updates; "step k" is the k-th update, and its loss is the loss of the
batch that update was computed from. Each update averages the gradients of `--grad_step`
micro-steps of DP x `--train_batch_size` sequences each (loader batch = step * grad_step + i after
the sequences consumed before this process started).

Read it from the bottom: `main` sets up the devices and calls `train`, whose loop is
`state, metrics = trainer.step(state, batch)` with the interval's work (evaluate, log, save, sample)
in small functions above it. The training state is one pytree: {"params", "opt_state", "key",
"router_bias"}.
"""
import atexit
import contextlib
import dataclasses
import errno
import glob
import json
import logging
import math
import os
import posixpath
import re
import shutil
import signal
import socket
import stat
import sys
import time
import uuid
import warnings
from functools import partial
from typing import Callable, NamedTuple

import fsspec
import fsspec.asyn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
from jax import lax
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec as P
from tqdm import tqdm

import dataset
import generate
import model
import multihost
import pipeline
import pod
import sharding
import spikes
import utils
from data.tokenizer import get_tokenizer


def log(*args, **kwargs):
    """Print on process 0 only (every host runs this same script)."""
    if jax.process_index() == 0:
        print(*args, **kwargs, flush=True)


def set_up_devices(cfg):
    """Before any JAX computation: the simulated CPU devices (--cpu_devices), then the multi-host join,
    which exits with one line when not every process joins within $JAXFORMER_INIT_TIMEOUT s."""
    if cfg.run.cpu_devices > 0:
        jax.config.update("jax_num_cpu_devices", cfg.run.cpu_devices)
        if not os.environ.get("JAX_PLATFORMS"):
            jax.config.update("jax_platforms", "cpu")
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        # GPU/CPU clusters (and launcher.sh): the coordinator and this host's rank come from the environment.
        if (jax.config.jax_platforms or "").startswith("cpu"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        multihost.initialize(coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                             num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                             process_id=int(os.environ["JAX_PROCESS_ID"]))
    elif os.environ.get("SLURM_NTASKS", "1") != "1":
        multihost.initialize()            # SLURM: everything is auto-detected
    elif _on_tpu_vm():
        try:                              # TPU pod slices: auto-detected from the TPU metadata
            multihost.initialize()
        except Exception as e:            # a single-host TPU VM needs no coordination
            if _tpu_multihost():
                raise
            warnings.warn(f"jax.distributed.initialize() skipped on a single TPU host: {e}")


def _on_tpu_vm():
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
                or os.environ.get("TPU_ACCELERATOR_TYPE") or os.environ.get("TPU_WORKER_HOSTNAMES"))


def _tpu_multihost():
    """True on a TPU VM that is one host of several (TPU_WORKER_HOSTNAMES lists them all)."""
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h]) > 1


# ----------------------------------------------------------------------------------------------------------
# Metrics sinks: stdout (process 0), metrics.jsonl, wandb


def is_url(path):
    """True for an fsspec URL (gs://bucket/x, memory://x); such a path is never touched with os.*. A file://
    URL is not one: run_dir_of turns it into the local path it names."""
    return "://" in str(path) and not str(path).startswith("file://")


def make_run_dir(run_dir):
    """RunRefused, naming --output_dir, when the run directory cannot be made (a file is in the way, a
    read-only or unwritable parent)."""
    fs, path = fsspec.core.url_to_fs(run_dir)
    try:
        fs.makedirs(path, exist_ok=True)       # a no-op under a bucket, where directories are prefixes
    except OSError as e:
        raise RunRefused(f"cannot create the run directory {run_dir} ({_os_error(e)}); --output_dir must be a "
                         f"directory this process can write, or a URL (gs://bucket/runs)") from e


# gcsfs logs every request it gives up on, with a screenful of aiohttp frames, and then raises the same error
# to its caller, which reports it in one line (a run file's warning, the lock's refusal, SaveFailed)
logging.getLogger("gcsfs").setLevel(logging.CRITICAL)

EXIT_WAIT_S = 5.0           # at exit, how long a store that does not answer may hold the process


def _exit_timeout(fs):
    """fsspec's per-call time limit, for the writes at exit (an async filesystem such as gcsfs takes one; gcsfs
    alone retries a refused connection for about 30 s)."""
    return {"timeout": EXIT_WAIT_S} if isinstance(fs, fsspec.asyn.AsyncFileSystem) else {}


def _warn(text):
    print(f"WARNING: {text}", file=sys.stderr, flush=True)


def _append(path, data):
    """Append `data` whole or not at all: a disk that fills up mid-write is truncated back, so that no half
    record is left to be glued to the next one."""
    with open(path, "ab", buffering=0) as f:
        start = f.seek(0, os.SEEK_END)
        try:
            view = memoryview(data)
            while view:
                view = view[f.write(view):]
        except OSError:
            f.truncate(start)
            raise


class RunFile:
    """One growing text file of the run directory (metrics.jsonl, samples.txt), written by process 0.

    A local directory gets every record appended at once. An object store cannot append, and rewriting a
    growing object on every line would cost O(lines^2): records wait in memory and go out as whole
    numbered objects, NAME.parts/000001, 000002, ... at flush() (each checkpoint, at most every FLUSH_S
    seconds otherwise, and at close). `read_run_file` puts either layout back together.

    A write that fails (a read-only or full disk, a store that is down) never stops training: one warning,
    and the records wait in memory for the next write that succeeds. At close (also at exit, however the
    process ends) what is still waiting is tried once more, then spilled to a local file that one line names."""
    FLUSH_S = 60.0

    def __init__(self, run_dir, name):
        self.run_dir, self.name = run_dir, name
        self.remote = is_url(run_dir)
        self.path = f"{run_dir.rstrip('/')}/{name}" if self.remote else os.path.join(run_dir, name)
        self._buf, self._last, self._failing = [], time.monotonic(), False
        if self.remote:
            self.fs, parts = fsspec.core.url_to_fs(f"{self.path}.parts")
            self.parts = parts.rstrip("/")
            self._next = 1 + max([int(p) for p in _part_names(self.fs, self.parts)] or [0])
        atexit.register(self.close)

    def write(self, text):
        self._buf.append(text)
        if not self.remote or time.monotonic() - self._last >= self.FLUSH_S:
            self.flush()

    def flush(self):
        """Write what is waiting (never fatal): appended to the local file, or as the next part object."""
        if not self._buf:
            return
        try:
            self._put("".join(self._buf))
        except Exception as e:                 # metrics never stop training; kept for the next try
            self._last = time.monotonic()      # a store that is down is tried again in FLUSH_S, not every record
            if not self._failing:
                _warn(f"could not write {self._target()} ({_os_error(e)}); keeping its records in memory and "
                      f"trying again {'at the next checkpoint' if self.remote else 'with the next record'}")
            self._failing = True
            return
        self._buf, self._last, self._failing = [], time.monotonic(), False

    def close(self):
        """The last try at what is waiting (at most EXIT_WAIT_S on a store); what it cannot write goes to a
        local file in $JAXFORMER_CACHE/unwritten, named in one line with how to put it back."""
        if not self._buf:
            return
        text, n, target = "".join(self._buf), len(self._buf), self._target()
        self._buf = []
        try:
            self._put(text, **(_exit_timeout(self.fs) if self.remote else {}))
            return
        except Exception as e:
            error = f"no answer in {EXIT_WAIT_S:.0f} s" if isinstance(e, TimeoutError) else _os_error(e)
        spill = os.path.join(dataset.default_cache_dir(), "unwritten",
                             f"{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}-{self.name}")
        try:
            os.makedirs(os.path.dirname(spill), exist_ok=True)
            _append(spill, text.encode("utf-8"))
        except OSError as e:
            _warn(f"{n} record(s) could not be written to {target} ({error}) nor to {spill} ({e}): they are lost")
            return
        _warn(f"{n} record(s) could not be written to {target} ({error}); they are in {spill}: "
              + (f"upload it as {target} when the store is back" if self.remote else
                 f"append it to {target} (cat {spill} >> {target}) once that can be written"))

    def _target(self):
        return f"{self.path}.parts/{self._next:06d}" if self.remote else self.path

    def _put(self, text, **kwargs):
        if not self.remote:
            _append(self.path, text.encode("utf-8"))
            return
        self.fs.pipe_file(f"{self.parts}/{self._next:06d}", text.encode("utf-8"), **kwargs)
        self._next += 1


def _part_names(fs, parts):
    try:
        names = [posixpath.basename(str(p).rstrip("/")) for p in fs.ls(parts, detail=False)]
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.isdigit())


def read_run_file(run_dir, name):
    """The whole text of a run file: the local file, or its part objects in order on an object store."""
    fs, path = fsspec.core.url_to_fs(f"{run_dir.rstrip('/')}/{name}")
    text = fs.cat_file(path).decode("utf-8") if fs.exists(path) else ""
    return text + "".join(fs.cat_file(f"{path}.parts/{p}").decode("utf-8") for p in _part_names(fs, f"{path}.parts"))


class Logger:
    """metrics.jsonl and samples.txt in the run directory (local or any fsspec URL), and wandb."""

    def __init__(self, cfg, run_dir, run_id, enabled):
        self.enabled = enabled
        self.metrics_file = RunFile(run_dir, "metrics.jsonl")
        self.samples_file = RunFile(run_dir, "samples.txt")
        self.wandb = self.wandb_html = None
        if enabled and cfg.run.wandb:
            self.wandb, self.wandb_html = _init_wandb(cfg, run_dir, run_id)

    def flush(self):
        if self.enabled:
            self.metrics_file.flush()
            self.samples_file.flush()

    def metrics(self, record):
        if not self.enabled:
            return
        self.metrics_file.write(json.dumps(_finite(record), allow_nan=False) + "\n")
        if self.wandb is not None:
            try:
                self.wandb.log(wandb_scalars(record), step=record["step"])
            except Exception as e:                  # a tracker failure never stops training
                warnings.warn(f"wandb.log failed ({e}); continuing with metrics.jsonl only")
                self.wandb = None

    def sample(self, step, prompt, text):
        if not self.enabled:
            return
        self.samples_file.write(f"=== step {step}\n{prompt}{text}\n\n")
        if self.wandb is not None:
            try:
                self.wandb.log({"sample": self.wandb_html(f"<pre>{prompt}{text}</pre>")}, step=step)
            except Exception as e:
                warnings.warn(f"wandb sample logging failed ({e})")

    def close(self):
        if self.enabled:
            self.metrics_file.close()
            self.samples_file.close()
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception as e:
                warnings.warn(f"wandb.finish failed ({e})")


def _finite(value):
    """`value` with every non-finite float as None: json.dumps writes NaN and Infinity, which strict JSON
    readers (jq, JavaScript, pandas' default engine) reject, so metrics.jsonl holds null there."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def wandb_scalars(record):
    """A record's numbers under wandb keys: a per-MoE-layer list NAME becomes NAME/layer0, ..., and
    expert_load's per-expert lists expert_load/layer0/expert0, ..."""
    flat = {}
    for name, value in record.items():
        if isinstance(value, list):
            for layer, v in enumerate(value):
                if isinstance(v, list):
                    flat.update({f"{name}/layer{layer}/expert{e}": x for e, x in enumerate(v)})
                else:
                    flat[f"{name}/layer{layer}"] = v
        elif isinstance(value, (int, float)) and name != "step":
            flat[name] = value
    return flat


def _init_wandb(cfg, run_dir, run_id):
    """(wandb run, wandb.Html): online when WANDB_API_KEY is set, otherwise offline files under the run dir;
    (None, None) when it cannot start, which is never fatal."""
    try:
        import wandb      # here, not at the top: only --wandb runs pay its import (about 2 s)
        if is_url(run_dir):                   # wandb writes a local directory: keep it in the cache
            run_dir = os.path.join(dataset.default_cache_dir(), "wandb", run_id)
            os.makedirs(run_dir, exist_ok=True)
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "jaxformer"), name=cfg.run.name, id=run_id,
                         resume="allow", dir=run_dir, mode=mode, config=dataclasses.asdict(cfg),
                         settings=wandb.Settings(init_timeout=float(os.environ.get("WANDB_INIT_TIMEOUT", 30)),
                                                 silent=True))
        log(f"wandb: {mode} run {run_id}" + (f" in {run_dir}/wandb" if mode == "offline" else ""))
        return run, wandb.Html
    except Exception as e:
        warnings.warn(f"wandb could not start ({type(e).__name__}: {e}); continuing with metrics.jsonl only")
        return None, None


# ----------------------------------------------------------------------------------------------------------
# Checkpoints


class RunRefused(Exception):
    """Starting would lose or mix work (a changed model, another run live in the directory, no readable
    checkpoint, a prompt that does not fit): main() prints the message and exits 2, nothing touched."""


class SaveFailed(Exception):
    """A checkpoint could not be written: one line naming the path and the OS error; main() exits 1."""


class Diverged(Exception):
    """--max_bad_steps steps in a row were not finite (their updates skipped): main() exits 1."""


def checkpoint_manager(run_dir, read_only=False):
    """The run's checkpoints: saving every --checkpoint_steps interval it is asked to, keeping the last 3;
    read_only (--sample): a manager that writes nothing."""
    options = (ocp.CheckpointManagerOptions(read_only=True, create=False) if read_only else
               ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=True, create=True))
    # a URL goes to Orbax as it is (every host writes its shards there); only a local path is made absolute
    directory = f"{run_dir.rstrip('/')}/checkpoints" if is_url(run_dir) else os.path.join(os.path.abspath(run_dir),
                                                                                             "checkpoints")
    # Orbax warns that a read-only manager is read only (the directory may well be writable): asked for.
    absl, level = logging.getLogger("absl"), logging.getLogger("absl").level
    absl.setLevel(logging.ERROR if read_only else level)
    try:
        # handlers named up front, so that a checkpoint's tree can be inspected before restoring (_restore)
        return ocp.CheckpointManager(directory, options=options, item_handlers={
            "state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})
    finally:
        absl.setLevel(level)


def save(mngr, step, state, meta, force=False):
    """Start an async save; SaveFailed when the directory cannot take it. The directory is probed first:
    on a read-only one Orbax fails to create the step directory and then its commit threads wait 5
    minutes for it before failing in a flood of tracebacks."""
    try:
        _check_writable(str(mngr.directory), state)
        mngr.save(step, args=ocp.args.Composite(state=ocp.args.StandardSave(state), meta=ocp.args.JsonSave(meta)),
                  force=force)
    except Exception as e:
        raise SaveFailed(f"could not save the checkpoint of step {step} in {mngr.directory}: {_os_error(e)}") from e


def wait_for_save(mngr):
    """Wait for the async save in flight (a full disk fails there); SaveFailed naming the path and cause."""
    try:
        mngr.wait_until_finished()
    except Exception as e:
        raise SaveFailed(f"could not save a checkpoint in {mngr.directory}: {_os_error(e)}") from e


def quiet_failed_saves():
    """A failed async save is reported in one line (SaveFailed). Orbax also logs it, with a traceback
    per thread and per array, and tensorstore then completes each outstanding write into the event
    loop Orbax has closed, printing one more traceback per write from its own threads, and asyncio
    logs the futures of those writes that nobody awaits: hundreds of lines for one full disk. Those
    three kinds of output are dropped; nothing else is."""
    logging.getLogger("absl").addFilter(
        lambda record: not (record.levelno >= logging.ERROR and f"{os.sep}orbax{os.sep}" in record.pathname))
    logging.getLogger("asyncio").addFilter(lambda record: "exception was never retrieved" not in record.getMessage())
    default = sys.unraisablehook

    def unraisablehook(unraisable):
        if not (unraisable.exc_type is RuntimeError and str(unraisable.exc_value) == "Event loop is closed"):
            default(unraisable)
    sys.unraisablehook = unraisablehook


def check_saves(mngr):
    """SaveFailed as soon as an async save has failed (the disk filled up while it wrote, say), so that
    the run stops at the next step, not at the next checkpoint: once no save is in progress, waiting
    for it returns at once, or raises what it failed with."""
    if not mngr.is_saving_in_progress():
        wait_for_save(mngr)


def discard_failed_saves(mngr):
    """After a failed save: close the checkpoints and remove the partial step directories the save
    left (STEP.orbax-checkpoint-tmp*), now and once more at exit, when the interpreter has waited for
    Orbax's writer threads, which go on writing into them for a while. Complete checkpoints stay."""
    for _ in range(2):          # the first close raises the failure (reported already) before closing
        try:
            mngr.close()
            break
        except Exception:
            continue
    if jax.process_index() == 0:
        _remove_partial_checkpoints(str(mngr.directory))
        atexit.register(_remove_partial_checkpoints, str(mngr.directory))


def _remove_partial_checkpoints(directory):
    fs, path = fsspec.core.url_to_fs(directory)
    for leftover in fs.glob(f"{path.rstrip('/')}/*.orbax-checkpoint-tmp*"):
        fs.rm(leftover, recursive=True)


def _check_writable(directory, state):
    """OSError when a local checkpoint directory cannot take a save of `state`: not writable, or less free
    space than this process' share of the state's bytes (uncompressed: a safe bound). Object stores
    are left to Orbax."""

    if is_url(directory):
        return
    os.makedirs(directory, exist_ok=True)
    probe = os.path.join(directory, f".write-test-{os.getpid()}")
    with open(probe, "w") as f:
        f.write("ok")
    os.remove(probe)
    need = sum(leaf.nbytes for leaf in jax.tree.leaves(state)) // jax.process_count()
    free = shutil.disk_usage(directory).free
    if free < need:
        raise OSError(errno.ENOSPC, f"No space left on device ({free / 2**20:.1f} MiB free, the checkpoint "
                                    f"needs about {need / 2**20:.1f} MiB)", directory)


def _os_error(e):
    """The OS-level cause of a failed save, in one line (Orbax wraps it several layers deep)."""
    cause = e
    while cause is not None:
        if isinstance(cause, OSError) and cause.errno:
            return str(cause)
        cause = cause.__cause__ or cause.__context__
    code = re.search(r"os_error_code='?(\d+)", str(e))
    if code:
        return f"[Errno {code.group(1)}] {os.strerror(int(code.group(1)))}"
    first = (str(e).strip().splitlines() or [""])[0]
    return f"{type(e).__name__}: {first[:300]}"


def restore_latest(mngr, abstract_state, run_dir, mc):
    """(state, meta) from the newest readable checkpoint, restored straight onto the current mesh's
    shardings (so a checkpoint saved on any mesh restores on this one); None when there is none.

    The newest readable metadata is compared with the model config first (`check_model`): a change of
    shape raises RunRefused before anything is touched. A checkpoint that then fails to read is moved to
    run_dir/unreadable_checkpoints with a warning naming the cause, once an older one has restored
    (run_dir None: left in place). When none restores: RunRefused, nothing moved."""
    steps = sorted(mngr.all_steps(), reverse=True)
    newest = newest_meta(mngr)         # an unreadable checkpoint is skipped here, reported below
    if newest is not None:
        check_model(newest[1].get("model") or {}, mc, f"{mngr.directory}/{newest[0]}")
    failed = []
    for step in steps:
        try:
            state, meta = _restore(mngr, step, abstract_state, mc.pipeline_repeats)
        except Exception as e:
            failed.append((step, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"))
            continue
        for bad, cause in failed:
            dst = f"{run_dir.rstrip('/')}/unreadable_checkpoints/{bad}-{int(time.time())}" if run_dir else None
            log(f"WARNING: checkpoint {mngr.directory}/{bad} is unreadable ({cause}); "
                + (f"moved to {dst}; " if dst else "") + f"using step {step}")
            if dst and jax.process_index() == 0:
                _move_aside(f"{str(mngr.directory).rstrip('/')}/{bad}", dst)
        if failed and run_dir:
            mngr.reload()
        return state, meta
    if failed:
        raise RunRefused(f"no checkpoint in {mngr.directory} can be read; nothing was moved:\n"
                         + "\n".join(f"  step {s}: {cause}" for s, cause in failed)
                         + "\nfix the cause (storage, permissions) and rerun, or add --restart to start over "
                           "(the old run is moved aside, not deleted)")
    return None


def newest_meta(mngr):
    """(step, metadata) of the newest checkpoint whose metadata (step, data position, run id, model config)
    reads, without its arrays; None when there is none."""
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            return step, mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception:
            continue
    return None


def _restore(mngr, step, abstract_state, repeats):
    # Checkpoints from before the aux-loss-free routing bias hold none: they routed with a bias of 0.
    has_bias = "router_bias" in mngr.item_metadata(step)["state"].keys()
    target = abstract_state if has_bias else {k: v for k, v in abstract_state.items() if k != "router_bias"}
    # One saved with another --pipeline_repeats holds the stacked blocks (params, Adam moments) in that
    # layout: the same numbers in model order, read as saved and reshaped onto this run's layout.
    saved_model = mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"].get("model") or {}
    read = _in_layout(target, saved_model.get("pipeline_repeats", 1), repeats)
    restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(read),
                                                            meta=ocp.args.JsonRestore()))
    if int(restored["meta"]["step"]) != step:
        raise ValueError(f"metadata says step {restored['meta']['step']}")
    state = dict(restored["state"])
    _check_checksums(state, restored["meta"].get("checksums"))
    if read is not target:
        state = jax.jit(lambda s: jax.tree.map(lambda a, t: a.reshape(t.shape), s, target),
                        out_shardings=jax.tree.map(lambda t: t.sharding, target))(state)
    if not has_bias:
        bias = abstract_state["router_bias"]
        state["router_bias"] = jax.device_put(jnp.zeros(bias.shape, bias.dtype), bias.sharding)
    return state, restored["meta"]


def _checksum(x):
    """A uint32 checksum of an array's bits: sum_i bits_i * (2 i + 1) mod 2^32 over its elements in
    row-major order. An integer sum, so the same on any mesh and in any layout that keeps row-major order
    (--pipeline_repeats' reshapes); a change to any one element changes it (2 i + 1 is odd)."""
    word = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[x.dtype.itemsize]
    bits = lax.bitcast_convert_type(x, word).astype(jnp.uint32)
    weights = 2 * lax.iota(jnp.uint32, x.size).reshape(x.shape) + 1
    return jnp.sum(bits * weights, dtype=jnp.uint32)


@jax.jit
def _checksums_and_finite(state):
    """({leaf path: its checksum}, whether the trained part of the state is finite), one pass over it."""
    sums = {jax.tree_util.keystr(path): _checksum(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(state)}
    return sums, _all_finite(_trained(state))


def _check_checksums(state, saved):
    """ValueError naming the first array whose bits differ from those its checkpoint recorded (a
    checkpoint written before checksums were kept, saved None, is taken as it is)."""
    if saved is None:
        return
    sums, _ = jax.device_get(_checksums_and_finite(state))
    for path, value in sums.items():
        if path in saved and int(value) != int(saved[path]):
            raise ValueError(f"array {path} does not match the checksum saved with it: its bits changed in storage")


def _in_layout(target, saved_repeats, repeats):
    """target (abstract state, stored for --pipeline_repeats `repeats`) with every stacked block leaf
    (under a "blocks" key: params and optimizer moments) shaped as `saved_repeats` stores it
    (pipeline.pipeline_layout) and replicated over pp, which need not split that layout's stacked axis;
    target itself when nothing differs."""
    changed = []
    lead = 1 if repeats == 1 else 2                 # target's stacked dims: [blocks] or [R, blocks/R]

    def one(path, t):
        if not any(getattr(k, "key", None) == "blocks" for k in path):
            return t
        blocks, rest = math.prod(t.shape[:lead]), t.shape[lead:]
        shape = (blocks, *rest) if saved_repeats == 1 else (saved_repeats, blocks // saved_repeats, *rest)
        if shape == t.shape:
            return t
        changed.append(path)
        spec = (*t.sharding.spec, *(None,) * len(t.shape))[lead:len(t.shape)]
        sharding = NamedSharding(t.sharding.mesh, P(*(None,) * (len(shape) - len(rest)), *spec))
        return jax.ShapeDtypeStruct(shape, t.dtype, sharding=sharding)
    read = jax.tree_util.tree_map_with_path(one, target)
    return read if changed else target


def check_model(saved, mc, where):
    """RunRefused naming every model field that differs from the checkpoint's (both values) when the
    difference changes a parameter's shape; otherwise a note (dropout, capacity, remat, ... may change).
    Checkpoints from before the circular pipeline stored the blocks as GPipe does (--pipeline_repeats 1)."""
    now = dataclasses.asdict(mc)
    saved = {"pipeline_repeats": 1, **saved} if saved else saved
    diffs = [(k, saved[k], now[k]) for k in now if k in saved and saved[k] != now[k]]
    if not diffs:
        return
    lines = "\n".join(f"  --{k}: {old} in the checkpoint, {new} now" for k, old, new in diffs)
    if _param_shapes(dataclasses.replace(mc, **{k: old for k, old, _ in diffs})) != _param_shapes(mc):
        raise RunRefused(f"{where} holds a different model, so this run cannot resume from it; nothing was "
                         f"changed. Differing flags:\n{lines}\nrerun with the checkpoint's values (its --preset "
                         f"and flags) to resume, or add --restart to start over (the old run is moved aside, "
                         f"not deleted)")
    log(f"note: {where} was saved with other settings that keep every shape; resuming with the new ones:\n{lines}")


def _param_shapes(mc):

    leaves, tree = jax.tree.flatten(jax.eval_shape(lambda k: model.init_params(mc, k), jax.random.key(0)))
    return str(tree), [leaf.shape for leaf in leaves]


def _move_aside(src, dst):
    """Rename a checkpoint directory, locally or on any fsspec store (there: copy + delete)."""
    fs, src_path = fsspec.core.url_to_fs(src)
    if fs.exists(src_path):
        dst_path = fsspec.core.url_to_fs(dst)[1]
        fs.makedirs(posixpath.dirname(dst_path), exist_ok=True)
        fs.mv(src_path, dst_path, recursive=True)


# ----------------------------------------------------------------------------------------------------------
# The run directory: one run at a time; --restart

RUN_FILES = ("checkpoints", "unreadable_checkpoints", "metrics.jsonl", "metrics.jsonl.parts", "samples.txt",
             "samples.txt.parts", "wandb")


def set_aside_previous_run(run_dir):
    """--restart: move the run's checkpoints and logs to RUN_DIR/replaced/TIME (kept, never deleted)."""
    fs, path = fsspec.core.url_to_fs(run_dir)
    names = [n for n in RUN_FILES if fs.exists(f"{path.rstrip('/')}/{n}")]
    if names:
        dst = f"{run_dir.rstrip('/')}/replaced/{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
        for name in names:
            _move_aside(f"{run_dir.rstrip('/')}/{name}", f"{dst}/{name}")
        log(f"--restart: moved {', '.join(names)} to {dst}")


def lock_run_dir(run_dir):
    """Create RUN_DIR and take RUN_DIR/lock for this process (host, pid, start time), released at exit if it is
    still this process'. RunRefused when a live run holds it, or when the directory cannot be created or
    written (nothing else is touched); a lock whose process is provably gone (killed, host rebooted) is taken
    over with a warning. On an object store the lock is an object created only where none exists (GCS: a
    generation precondition), so two runs cannot both take it there either."""
    make_run_dir(run_dir)
    lock = _ObjectLock(run_dir) if is_url(run_dir) else _FileLock(run_dir)
    mine = dict(_process_identity(os.getpid()), host=_hostname(),
                started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    try:
        for _ in range(3):
            if lock.create(mine):
                atexit.register(lock.release, mine)
                return lock.path
            holder, token = lock.read()
            if token is None:
                continue                # released meanwhile
            if holder is not None and _alive(holder):
                raise RunRefused(f"{run_dir} is in use by another run: pid {holder.get('pid')} on "
                                 f"{holder.get('host')}, started {holder.get('started')} (lock {lock.path}); stop "
                                 f"it or use another --name; if that run is gone, delete {lock.path}")
            log(f"WARNING: taking over {lock.path}: pid {holder and holder.get('pid')} on "
                f"{holder and holder.get('host')} that held it is gone")
            lock.remove(token)
        raise RunRefused(f"could not take the lock {lock.path}: other runs keep taking it")
    except OSError as e:
        raise RunRefused(f"cannot write the run directory {run_dir} ({_os_error(e)}); --output_dir must be a "
                         f"directory this process can write") from e


class _FileLock:
    """RUN_DIR/lock in a local directory: a hard link of a file written whole, so that it appears atomically
    and only where none exists. Its token (what read() found) is True."""

    def __init__(self, run_dir):
        self.path = os.path.join(run_dir, "lock")
        self._tmp = f"{self.path}.{os.getpid()}.tmp"

    def create(self, mine):
        try:
            with open(self._tmp, "w") as f:
                json.dump(mine, f)
            os.link(self._tmp, self.path)
            return True
        except FileExistsError:
            return False
        finally:
            with contextlib.suppress(OSError):
                os.remove(self._tmp)

    def read(self):
        try:
            with open(self.path) as f:
                return json.load(f), True
        except FileNotFoundError:
            return None, None
        except (OSError, ValueError):
            return None, True

    def remove(self, token):
        try:                            # not atomic with the read: two runs taking over at once can both win
            os.remove(self.path)
        except FileNotFoundError:
            pass

    def release(self, mine):
        """At exit; never raises (a directory turned read-only keeps the lock: the next run takes it over)."""
        try:
            if self.read()[0] == mine:
                self.remove(True)
        except OSError:
            pass


class _ObjectLock:
    """RUN_DIR/lock on an fsspec object store, written with fsspec's create-only mode (GCS and S3: a
    precondition the store enforces). On GCS read() returns the object's generation as its token and
    remove() deletes only that generation, so a takeover never deletes the lock a third run just took;
    elsewhere the token is the bytes read, compared again just before the delete."""

    def __init__(self, run_dir):
        self.path = f"{run_dir.rstrip('/')}/lock"
        self.fs, self._key = fsspec.core.url_to_fs(self.path)
        self._gcs = "gs" in self.fs.protocol           # gcsfs: ("gs", "gcs")

    def create(self, mine):
        try:
            self.fs.pipe_file(self._key, json.dumps(mine).encode(), mode="create")
            return True
        except FileExistsError:
            return False

    def read(self, **kwargs):
        try:
            if self._gcs:               # the body and its generation from one request
                headers, body = self.fs.call("GET", "b/{}/o/{}", *self.fs.split_path(self._key)[:2], alt="media",
                                             **kwargs)
                token = headers["X-Goog-Generation"]
            else:
                body = token = self.fs.cat_file(self._key, **kwargs)
        except FileNotFoundError:
            return None, None
        try:
            return json.loads(body), token
        except ValueError:
            return None, token

    def remove(self, token, **kwargs):
        try:
            if self._gcs:
                self.fs.call("DELETE", "b/{}/o/{}", *self.fs.split_path(self._key)[:2], ifGenerationMatch=token,
                             **kwargs)
            elif self.fs.cat_file(self._key, **kwargs) == token:
                self.fs.rm_file(self._key, **kwargs)
        except (FileNotFoundError, FileExistsError):   # gone, or replaced (GCS answers 412 as FileExistsError)
            pass

    def release(self, mine):
        """At exit, within EXIT_WAIT_S; never raises (a store that is down keeps the lock: the next run on this
        host takes it over)."""
        try:
            holder, token = self.read(**_exit_timeout(self.fs))
            if holder == mine:
                self.remove(token, **_exit_timeout(self.fs))
        except Exception:
            pass


def _process_identity(pid):
    """pid plus what tells it from a later process with the same pid: boot id and start time (Linux)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
        with open(f"/proc/{pid}/stat") as f:
            started = f.read().rsplit(")", 1)[1].split()[19]      # field 22, starttime in clock ticks
        return {"pid": pid, "boot_id": boot, "proc_start": started}
    except (OSError, IndexError):
        return {"pid": pid}


def _alive(holder):
    """False only when the lock's process is provably gone: same host, and no process with its identity."""
    if holder.get("host") != _hostname():
        return True
    if "proc_start" not in holder:  # no /proc: whether any process has that pid
        try:
            os.kill(int(holder["pid"]), 0)
        except ProcessLookupError:
            return False
        except (OSError, KeyError, ValueError):
            pass
        return True
    return _process_identity(holder["pid"]) == {k: holder.get(k) for k in ("pid", "boot_id", "proc_start")}


def _hostname():
    return socket.gethostname()


# ----------------------------------------------------------------------------------------------------------
# Data


def data_dir_for(cfg):
    """--data_dir, or the bundled corpus' shards, tokenized into $JAXFORMER_CACHE on first use."""
    if cfg.run.data_dir:
        return cfg.run.data_dir
    cache = dataset.default_cache_dir()
    try:
        return dataset.ensure_bundled_shards(cache, say=log)
    except OSError as e:
        raise dataset.DataError(f"JAXFORMER_CACHE={cache}: cannot write the bundled corpus' shards there ({e}); "
                                f"point JAXFORMER_CACHE at a writable directory, or pass --data_dir") from None


def next_batch(batches, grad_step):
    """The next optimizer step's batch: (xs, ys), each a tuple of --grad_step global batches [DP x
    --train_batch_size, T] laid out as the trainer's data_sharding."""
    xs, ys = zip(*[next(batches) for _ in range(grad_step)])
    return xs, ys


# ----------------------------------------------------------------------------------------------------------
# The training step (bench.py times it and pod.py compiles it for a TPU slice)


class Trainer(NamedTuple):
    step: Callable              # step(state, (xs, ys)) -> (state, metrics), jitted, donates the state
    eval_step: Callable         # eval_step(params, router_bias, x, y) -> (val CE, balance term), jitted
    fresh_state: Callable       # fresh_state(seed) -> a new training state on the mesh
    abstract_state: dict        # the state's shapes, dtypes and shardings (restore targets, compiling)
    schedule: Callable          # the learning rate of an update, by step index
    data_sharding: NamedSharding  # a global batch [sequences, T]: sequences over dp, whole rows


def build_trainer(cfg, mesh):
    """The jitted training and eval steps for cfg on mesh, and the training state's layout."""
    abstract_params = jax.eval_shape(partial(pipeline.init_pipeline_params, cfg.model), jax.random.key(0))
    optimizer = make_optimizer(cfg.optim, abstract_params)
    shardings, abstract_state = state_layout(cfg, optimizer, abstract_params, mesh)
    replicated, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp", None))
    micro_steps = (data,) * cfg.optim.grad_step
    step = jax.jit(partial(train_step, cfg=cfg, mesh=mesh, optimizer=optimizer),
                   in_shardings=(shardings, (micro_steps, micro_steps)), out_shardings=(shardings, replicated),
                   donate_argnums=(0,))
    evaluate = jax.jit(partial(eval_step, cfg=cfg, mesh=mesh),
                       in_shardings=(shardings["params"], replicated, data, data))
    return Trainer(step, evaluate, partial(init_state, cfg, optimizer, shardings, mesh), abstract_state,
                   utils.lr_schedule(cfg.optim), data)


def abstract_step_args(cfg, trainer):
    """The arguments of the train and eval steps as shapes, dtypes and shardings, for compiling without
    data: ((state, (xs, ys)), (params, router_bias, x, y)). A global batch of token ids [sequences, T]
    laid out over dp: utils.global_batch per micro-step, --val_batch_size to evaluate."""
    batch = lambda rows: jax.ShapeDtypeStruct((rows, cfg.model.T), jnp.int32, sharding=trainer.data_sharding)
    state, micro_steps, val = trainer.abstract_state, (batch(utils.global_batch(cfg)),) * cfg.optim.grad_step, \
        batch(cfg.run.val_batch_size)
    return (state, (micro_steps, micro_steps)), (state["params"], state["router_bias"], val, val)


def make_optimizer(oc, abstract_params):
    """Global-norm clipping, then AdamW, inside spikes.skip_spikes: it keeps the running grad-norm median
    in the optimizer state (checkpointed with it) and, with --skip_spikes F > 0, leaves params and
    moments untouched on a step whose norm is > F x it."""
    # Guide: optax.adamw; here the tied embedding table has its own Adam epsilon (spikes.adamw).
    adamw = spikes.adamw(utils.lr_schedule(oc), oc, model.decay_mask(abstract_params),
                         model.table_mask(abstract_params))
    return spikes.skip_spikes(optax.chain(optax.clip_by_global_norm(oc.grad_clip_norm), adamw), oc.skip_spikes)


def state_layout(cfg, optimizer, abstract_params, mesh):
    """(shardings, abstract state) of the training state: params and their optimizer moments sharded
    as model.param_shardings says, everything else replicated. The aux-loss-free routing bias [blocks,
    E] (model.update_router_bias) is tiny, and equal on every device because every device computes its
    update from the same global counts."""
    replicated = NamedSharding(mesh, P())
    param_shardings = model.param_shardings(abstract_params, mesh, cfg.model.expert_parallel)
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    shardings = {"params": param_shardings, "key": replicated, "router_bias": replicated,
                 "opt_state": optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt, param_shardings,
                                                    transform_non_params=lambda _: replicated)}
    shapes = {"params": abstract_params, "opt_state": abstract_opt,
              "key": jax.ShapeDtypeStruct(jax.random.key_data(jax.random.key(0)).shape, jnp.uint32),
              "router_bias": jax.ShapeDtypeStruct((cfg.model.blocks, cfg.model.n_experts), jnp.float32)}
    return shardings, jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), shapes,
                                   shardings)


def init_state(cfg, optimizer, shardings, mesh, seed):
    """A fresh training state, computed straight into its shardings (no host holds the whole model)."""
    init_key, train_key = jax.random.split(jax.random.key(seed))
    params = pipeline.init_sharded_params(cfg.model, init_key, mesh)
    opt_state = jax.jit(optimizer.init, out_shardings=shardings["opt_state"])(params)
    # The key committed to the mesh like the train step's output, so step 2 reuses step 1's executable.
    return {"params": params, "opt_state": opt_state,
            "key": jax.device_put(jax.random.key_data(train_key), shardings["key"]),
            "router_bias": jax.device_put(jnp.zeros((cfg.model.blocks, cfg.model.n_experts), jnp.float32),
                                          shardings["router_bias"])}


def train_step(state, batch, *, cfg, mesh, optimizer):
    """One optimizer update from --grad_step micro-steps: (state, (xs, ys)) -> (state, metrics)."""
    key, step_key = jax.random.split(jax.random.wrap_key_data(state["key"]))
    grads, metrics = accumulate_gradients(state["params"], state["router_bias"], batch, step_key, cfg, mesh)
    metrics["grad_norm"] = optax.global_norm(grads)
    # Guide: the update runs inside shard_map; here outside it, on global arrays that jit partitions.
    updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
    metrics["grad_norm_ratio"], metrics["skipped"] = opt_state.ratio, opt_state.skipped
    # A step skipped as a spike leaves the routing bias as it was, like the parameters.
    router_bias = jnp.where(opt_state.skipped > state["opt_state"].skipped, state["router_bias"],
                            model.update_router_bias(state["router_bias"], metrics["tokens_per_expert"],
                                                     cfg.optim.bias_update_rate))
    updated = {"params": optax.apply_updates(state["params"], updates), "opt_state": opt_state,
               "router_bias": router_bias}
    # A non-finite loss, gradient or updated state (an Adam moment can overflow under a finite gradient)
    # leaves params, moments and routing bias as they were, so no checkpoint ever holds a NaN. The test
    # reads replicated scalars: every device takes the same decision.
    finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"]) & _all_finite(_trained(updated))
    metrics["nonfinite"] = ~finite
    kept = jax.tree.map(lambda new, old: jnp.where(finite, new, old), updated,
                        {name: state[name] for name in updated})
    return kept | {"key": jax.random.key_data(key)}, metrics


def _trained(state):
    """The parts of the state a NaN must never reach: params, routing bias and the optimizer's moments
    (not the spike watch's window of grad norms, where NaN means "not seen yet")."""
    return state["params"], state["router_bias"], state["opt_state"].inner


def _all_finite(tree):
    """Whether every float in the tree is finite (one reduction per leaf)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)
                              if jnp.issubdtype(leaf.dtype, jnp.floating)]))


def accumulate_gradients(params, router_bias, batch, key, cfg, mesh):
    """(gradient, metrics) averaged over the micro-steps of batch = (xs, ys), except the routed-choice
    counts, which stay sums: the bias update and the log interval's loads count the whole global batch.
    Gradients of the params only: the routing bias is state the loss reads, not a parameter."""
    xs, ys = batch
    G = len(xs)
    grad_fn = jax.value_and_grad(lambda p, x, y, k: pipeline.loss_and_metrics(
        model.with_router_bias(p, router_bias), x, y, k, cfg.model, mesh, cfg.run.micro_batch_size, True),
        has_aux=True)

    def micro(sums, inputs):
        x, y, i = inputs
        (loss, metrics), g = grad_fn(params, x, y, jax.random.fold_in(key, i))
        return jax.tree.map(jnp.add, sums, (g, {"loss": loss, **metrics})), None

    loss, metrics = jax.eval_shape(grad_fn, params, xs[0], ys[0], key)[0]
    zeros = (jax.tree.map(jnp.zeros_like, params),
             jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), {"loss": loss, **metrics}))
    if G == 1:
        (grads, sums), _ = micro(zeros, (xs[0], ys[0], 0))
    else:
        (grads, sums), _ = jax.lax.scan(micro, zeros, (jnp.stack(xs), jnp.stack(ys), jnp.arange(G)))
        grads = jax.tree.map(lambda g: g / G, grads)
    return grads, {name: s if name == "tokens_per_expert" else s / G for name, s in sums.items()}


def eval_step(params, router_bias, x, y, *, cfg, mesh):
    _, metrics = pipeline.loss_and_metrics(model.with_router_bias(params, router_bias), x, y, jax.random.key(0),
                                        cfg.model, mesh, cfg.run.micro_batch_size, False)
    return metrics["ce"], jnp.sum(metrics["balance"])


# ----------------------------------------------------------------------------------------------------------
# Setting up a run: its directory, data, and the state to start from


@dataclasses.dataclass
class Run:
    """What the training loop works with, set up by open_run."""
    cfg: utils.Config
    trainer: Trainer
    mngr: ocp.CheckpointManager
    logger: "Logger"
    train_ds: dataset.TokenDataset
    val_batches: list
    loader: dataset.BatchLoader
    state: dict                 # the state to start from: restored, or fresh
    meta: dict                  # the restored checkpoint's metadata; None for a fresh run
    start_step: int
    start_seq: int              # sequences consumed before this process started
    run_id: str
    sample_ids: list            # the prompt's token ids

    @property
    def sequences_per_step(self):
        return utils.sequences_per_step(self.cfg)


def check_data_source(cfg):
    """RunRefused when a pod preset would train on the bundled corpus (no --data_dir)."""
    if cfg.preset in utils.PRESET_SLICES and not cfg.run.data_dir:
        raise RunRefused(f"--data_dir: --preset {cfg.preset} is the guide's run on FineWeb-Edu, not the bundled "
                         f"corpus; tokenize it first ({utils.TOKENIZE_FINEWEB}) and pass --data_dir "
                         f"gs://BUCKET/fineweb-edu (--compile_for needs no data)")


def open_run(cfg, mesh):
    """Take the run directory, print the run's header, load the data, restore or start the state."""
    rc, proc0 = cfg.run, jax.process_index() == 0
    run_dir = run_dir_of(rc)
    sample_ids = prompt_ids(cfg.inference, cfg.model.T)  # a prompt that cannot be sampled stops the run here
    on_process_0(lambda: lock_run_dir(run_dir))
    if rc.restart:                              # every host opens the checkpoints after they moved
        on_process_0(lambda: set_aside_previous_run(run_dir))
    print_header(cfg)
    trainer = build_trainer(cfg, mesh)
    train_ds, val_batches = load_data(cfg, trainer.data_sharding)
    mngr = checkpoint_manager(run_dir)
    restored = restore_latest(mngr, trainer.abstract_state, run_dir, cfg.model)
    state, meta = restored if restored is not None else (trainer.fresh_state(rc.seed), None)
    start_step, start_seq, run_id = start_position(meta, cfg)
    if meta is not None:
        log(f"resumed from {mngr.directory}/{start_step}: step {start_step}, data position {start_seq} "
            f"sequences, run id {run_id}")
    logger = Logger(cfg, run_dir, run_id, proc0)
    loader = dataset.BatchLoader(train_ds, cfg.model.T, utils.global_batch(cfg),
                                 trainer.data_sharding, rc.seed, consumed=start_seq)
    return Run(cfg, trainer, mngr, logger, train_ds, val_batches, loader, state, meta, start_step, start_seq,
               run_id, sample_ids)


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
    dp, pp, tp = cfg.run.n_device_axis
    log(utils.describe(cfg))
    counts = model.count_params(cfg.model)
    log(f"params: total {counts['total']:,} | active {counts['active']:,} | embedding {counts['embedding']:,} "
        f"(active: used per token, without the embedding)")
    log(f"mesh: dp={dp} pp={pp} tp={tp} over {dp * pp * tp} of {jax.device_count()} "
        f"{jax.devices()[0].device_kind} device(s), {jax.process_count()} process(es)")
    log(utils.MFU_FORMULA)


def load_data(cfg, data_sharding):
    """(the training split, the fixed validation batches: --eval_steps batches of --val_batch_size sequences in
    all, so the same windows on every mesh)."""
    mc, rc = cfg.model, cfg.run
    data_dir = data_dir_for(cfg)
    try:
        train_ds = dataset.TokenDataset(data_dir, "train", mc.vocab_size)
        val_ds = dataset.TokenDataset(data_dir, "val", mc.vocab_size)
    except dataset.DataError as e:
        if rc.data_dir:
            raise dataset.DataError(f"--data_dir {rc.data_dir}: {e}") from None
        raise
    val_batches = dataset.validation_batches(val_ds, mc.T, rc.val_batch_size, data_sharding, rc.eval_steps)
    if len(val_batches) < rc.eval_steps:
        log(f"note: the val split holds {val_ds.n_windows(mc.T)} windows of {mc.T + 1} tokens, enough for "
            f"{len(val_batches)} of --eval_steps {rc.eval_steps} batches of {rc.val_batch_size}; "
            f"evaluating on {len(val_batches)}")
    return train_ds, val_batches


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


class StopSignals:
    """SIGTERM, SIGHUP (a closed terminal or tmux pane) and a first Ctrl-C set .requested (and .signal,
    its name): the loop finishes its step, saves, says where, exits 0. A second Ctrl-C gets the default
    action, which ends the process at once, even inside a long XLA call (a Python handler would wait
    for it to return)."""

    def __init__(self):
        self.requested, self.signal = False, None
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, self.on_signal)

    def on_signal(self, signum, frame):
        if signum == signal.SIGHUP:
            _detach_from_terminal()
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            # os.write, not print: the handler may interrupt a print, and print is not reentrant
            os.write(2, b"\nCtrl-C: finishing this step, then saving and exiting; Ctrl-C again to exit now "
                        b"without saving\n")
        self.requested = True
        self.signal = self.signal or signal.Signals(signum).name


def _detach_from_terminal():
    """After SIGHUP the terminal, or the tmux pane and the tee that logged it (run.sh), is gone, and
    writing there fails (EIO, EPIPE): stdout and stderr that were a terminal or a pipe now go to
    /dev/null, so that the run still saves and exits 0. Output redirected to a file is left as it is."""
    null = os.open(os.devnull, os.O_WRONLY)
    for fd in (1, 2):
        try:
            mode = os.fstat(fd).st_mode
        except OSError:
            continue
        if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
            os.dup2(null, fd)
    os.close(null)


# ----------------------------------------------------------------------------------------------------------
# The loop's interval work: metrics, evaluation, checkpoints, samples


class Meter:
    """Per-step metrics and timing. The loop dispatches a step before the previous one's metrics are
    fetched (the host stays one step ahead of the device); each fetched step is written to
    metrics.jsonl, watched for spikes and kept for its interval's record. The first step, which
    compiles, is timed apart."""

    def __init__(self, run, bar):
        self.logger, self.schedule, self.bar = run.logger, run.trainer.schedule, bar
        self.watch = spikes.SpikeWatch(run.cfg.optim.skip_spikes or spikes.RATIO_WARN)
        self.skipped = int(jax.device_get(run.state["opt_state"].skipped))  # before the next fetched step
        self.max_bad, self.bad_steps = run.cfg.run.max_bad_steps, []          # non-finite steps in a row
        self.mngr = run.mngr
        self.pending, self.interval = [], []
        self.t0 = time.perf_counter()
        self.t, self.steps, self.first_step_s = None, 0, None

    def dispatched(self, step, metrics):
        self.pending.append((step, metrics))

    def fetch(self, everything=True):
        """Fetch and record the pending steps' metrics: all of them, or all but the newest (never before
        the first step is timed, so the timer starts after compilation)."""
        while self.pending and (everything or self.t is None or len(self.pending) > 1):
            step, metrics = self.pending.pop(0)
            self.record(step, jax.device_get(metrics))

    def record(self, step, m):
        rec = utils.metrics_record(
            "step", step, loss=float(m["loss"]), ce=float(m["ce"]), balance=float(np.sum(m["balance"])),
            grad_norm=float(m["grad_norm"]), lr=float(self.schedule(step - 1)),
            drop_rate=float(np.mean(m["drop_rate"])), skipped_steps=int(m["skipped"]),
            grad_norm_ratio=float(m["grad_norm_ratio"]) if np.isfinite(m["grad_norm_ratio"]) else None,
            update_skipped=int(m["skipped"]) > self.skipped, loss_jump=None, nonfinite=bool(m["nonfinite"]))
        self.skipped = rec["skipped_steps"]
        if rec["nonfinite"]:
            self.not_finite(rec)
        else:
            self.bad_steps = []
            warning = self.watch.step(rec)                   # sets rec["loss_jump"]
            if warning:
                say(self.bar, warning)
        self.logger.metrics(rec)
        if len(self.bad_steps) >= self.max_bad:
            newest = self.mngr.latest_step()
            raise Diverged(f"steps {self.bad_steps[0]}-{self.bad_steps[-1]} in a row had a non-finite loss, gradient "
                           f"or updated state (--max_bad_steps {self.max_bad}); their updates were skipped and the "
                           f"run stops. " + (f"The newest checkpoint, {self.mngr.directory}/{newest}, is from before "
                                             f"them: resume from it with a lower --max_lr or other changes"
                                             if newest is not None else "No checkpoint was written yet"))
        self.interval.append((rec, m))
        now = time.perf_counter()
        if self.t is None:
            self.first_step_s, self.t, self.steps = now - self.t0, now, 0
        else:
            self.steps += 1
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)

    def not_finite(self, rec):
        """A step whose update train_step skipped: say so, count it in the run of such steps."""
        self.bad_steps.append(rec["step"])
        say(self.bar, f"WARNING: step {rec['step']}: loss {rec['loss']}, grad norm {rec['grad_norm']}: not finite; "
                      f"its update was skipped (parameters, Adam moments and routing bias unchanged), "
                      f"{len(self.bad_steps)} in a row of --max_bad_steps {self.max_bad}")

    def take_interval(self):
        """(step records, their device metrics, seconds per step or None) of the interval, which starts
        over; the step time is the first step's (compilation included) when no other step was timed."""
        elapsed = time.perf_counter() - self.t if self.t is not None else 0.0
        recs, device = [r for r, _ in self.interval], [m for _, m in self.interval]
        step_time = elapsed / self.steps if self.steps and elapsed > 0 else None
        self.interval, self.steps = [], 0
        return recs, device, step_time

    def restart_timer(self):
        """After the interval's evaluation, save and sample: the next steps are timed from here."""
        self.t, self.steps = time.perf_counter(), 0


def say(bar, text):
    """A line above the progress bar, on process 0."""
    if jax.process_index() == 0:
        bar.write(text)


def evaluate(trainer, state, val_batches):
    """(val cross-entropy, val balance term), means over the fixed validation batches."""
    results = [trainer.eval_step(state["params"], state["router_bias"], x, y) for x, y in val_batches]
    return float(np.mean([float(r[0]) for r in results])), float(np.mean([float(r[1]) for r in results]))


def log_interval(run, meter, state, step):
    """Evaluate and write the interval's record (utils.METRICS["interval"]) and line; returns val CE."""
    cfg, (dp, pp, tp) = run.cfg, run.cfg.run.n_device_axis
    meter.fetch()
    recs, device, step_time = meter.take_interval()
    tok_s = run.sequences_per_step * cfg.model.T / step_time if step_time else None
    step_time = step_time or meter.first_step_s
    val_ce, val_bal = evaluate(run.trainer, state, run.val_batches)
    experts = expert_stats(device)
    spread, idle = load_spread(np.asarray(experts["expert_load"]))
    peak = utils.peak_flops(jax.devices()[0].device_kind)
    util = utils.mfu(tok_s, model.flops_per_token(cfg.model), dp * pp * tp, peak) if tok_s else None
    rec = utils.metrics_record(
        "interval", step, val_loss=val_ce, val_balance=val_bal, train_loss=float(np.mean([r["loss"] for r in recs])),
        lr=recs[-1]["lr"], grad_norm=recs[-1]["grad_norm"], tokens_per_s=tok_s, step_time_s=step_time, mfu=util,
        **experts, expert_load_spread=spread if idle is None else None,
        drop_rate=float(np.mean([r["drop_rate"] for r in recs])), balance=float(np.mean([r["balance"] for r in recs])),
        skipped_steps=recs[-1]["skipped_steps"], **meter.watch.interval())
    run.logger.metrics(rec)
    say(meter.bar, f"step {step:>6} | loss {recs[-1]['loss']:.4f} | val {val_ce:.4f} | lr {rec['lr']:.2e} | "
                   f"grad {rec['grad_norm']:.3f} | {(f'{tok_s:,.0f}' if tok_s else 'n/a'):>8} tok/s | "
                   f"step {step_time * 1e3:.0f} ms | MFU {(f'{100 * util:.1f}%' if util is not None else 'n/a')} | "
                   f"load max/min {spread:.2f}{idle or ''} | drop {100 * rec['drop_rate']:.2f}%")
    return val_ce


def load_spread(load):
    """(max/min tokens per expert over the worst MoE layer, a note naming idle experts or None); inf when
    an expert got no tokens."""
    with np.errstate(divide="ignore", invalid="ignore"):
        spread = float(np.max(load.max(-1) / load.min(-1)))
    idle = [f"{layer}.{e}" for layer, e in zip(*np.nonzero(load == 0))]
    if not idle:
        return spread, None
    more = f" and {len(idle) - 8} more" if len(idle) > 8 else ""
    return spread, f" (no tokens: expert {', '.join(idle[:8])}{more}, as layer.expert)"


def expert_stats(steps):
    """Per MoE layer, lists indexed by layer, over a log interval from its steps' device metrics: each
    expert's share of the routed choices (before capacity drops), the fraction of experts that got
    none, the busiest expert's load over the mean, the fraction of choices dropped, and the balance
    term (alpha applied; the loss adds the layers')."""
    tokens = np.sum([m["tokens_per_expert"] for m in steps], axis=0)          # [layers, experts]
    return {"expert_load": (tokens / tokens.sum(-1, keepdims=True)).tolist(),
            "idle_expert_fraction": np.mean(tokens == 0, axis=-1).tolist(),
            "load_max_over_mean": (tokens.max(-1) / tokens.mean(-1)).tolist(),
            "layer_drop_rate": np.mean([m["drop_rate"] for m in steps], axis=0).tolist(),
            "layer_balance": np.mean([m["balance"] for m in steps], axis=0).tolist()}


def val_target_reached(val_loss, rc):
    """Whether an evaluation's val cross-entropy ends the run (--stop_at_val_loss; 0 = never)."""
    return rc.stop_at_val_loss > 0 and val_loss is not None and val_loss <= rc.stop_at_val_loss


def save_checkpoint(run, step, state, val_loss, force=False):
    """Start the async save of `state` as step `step`, with what resuming needs in its metadata and a
    checksum of every array (checked at restore). A state that is not finite is never saved: the train
    step keeps one from arising, and one resumed from an older checkpoint is refused here."""
    sums, finite = jax.device_get(_checksums_and_finite(state))
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
    ic = run.cfg.inference
    if ic.max_tokens == 0:
        return
    try:
        text = sample_text(state, run.cfg, run.sample_ids, step)
        log(f"sample @ {step}:\n{ic.prompt}{text}")
        run.logger.sample(step, ic.prompt, text)
    except Exception as e:
        log(f"WARNING: sampling at step {step} failed ({type(e).__name__}: {e}); training goes on")


def sample_text(state, cfg, ids, step):
    """--max_tokens new tokens after `ids` (top-k, temperature) from the state's params routed with its
    bias, decoded; the key depends on the seed and the step only, never on the training key."""
    ic, enc = cfg.inference, get_tokenizer()
    key = jax.random.fold_in(jax.random.key(cfg.run.seed + 1), step)
    params = model.with_router_bias(state["params"], state["router_bias"])
    new = generate.generate(params, cfg.model, ids, key, ic.max_tokens, ic.top_k, ic.temperature, ic.use_cache)
    return enc.decode([t for t in new if t < enc.n_vocab])


def close_run(run):
    """Wait for the checkpoint in flight, then close the checkpoints, the logs and the loader."""
    wait_for_save(run.mngr)
    run.mngr.close()
    run.logger.close()
    run.loader.close()


def stopped(run, step, signal_name):
    """After a stop (SIGTERM, Ctrl-C, or another host's): wait for the step's checkpoint, say where."""
    close_run(run)
    log(f"{signal_name or 'stop requested on another host'}: checkpoint of step {step} written to "
        f"{run.mngr.directory}/{step}; exiting (the same command resumes it)")
    return 0


def finished(run):
    """Whether the checkpoint restored is the end of the run: its last step, or --stop_at_val_loss met."""
    return run.meta is not None and (run.start_step >= run.cfg.optim.training_steps
                                     or val_target_reached(run.meta.get("val_loss"), run.cfg.run))


def nothing_to_do(run):
    """A finished run started again: say so, write nothing (no metrics record, no sample), exit 0."""
    close_run(run)
    val = run.meta.get("val_loss")
    log(f"{run.mngr.directory}/{run.start_step} ends this run (--training_steps {run.cfg.optim.training_steps}"
        + (f", val cross-entropy {val:.4f} at its last evaluation" if val is not None else "")
        + "): nothing to do; raise --training_steps to train on, or add --restart to start over")
    return 0


def finish(run, state, step, val_ce, saved, t0):
    """The end of the run (the last step or --stop_at_val_loss): its checkpoint, and the final val
    cross-entropy against the unigram entropy of the training tokens."""
    if not saved:
        save_checkpoint(run, step, state, val_ce)
    wait_for_save(run.mngr)                     # the final line only once its checkpoint is written
    entropy = run.train_ds.unigram_entropy()          # from the token counts the tokenizer recorded
    log(f"final: val cross-entropy {val_ce:.4f} nats | " + (
        f"unigram entropy of the training tokens {entropy:.4f} nats | {entropy - val_ce:+.4f} nats below it"
        if entropy is not None else "unigram entropy n/a (the manifest predates token counts; re-tokenize)")
        + f" | {time.perf_counter() - t0:.0f} s")
    run.logger.metrics(utils.metrics_record("final", step, final_val_loss=val_ce, unigram_entropy=entropy))
    close_run(run)
    return 0


# ----------------------------------------------------------------------------------------------------------
# The run


def train(cfg, mesh):
    """Train the run in OUTPUT_DIR/NAME from its newest checkpoint (or from scratch) to --training_steps
    or --stop_at_val_loss; SIGTERM or Ctrl-C saves and stops early."""
    oc, rc = cfg.optim, cfg.run
    run = open_run(cfg, mesh)
    if finished(run):
        return nothing_to_do(run)
    if run.meta is not None:
        run.logger.metrics(utils.metrics_record("event", run.start_step, event="resume"))
    state, step = run.state, run.start_step
    # A progress bar on a terminal; a log file (launcher.sh's) gets the interval lines alone, not redraws.
    bar = tqdm(total=oc.training_steps, initial=step, disable=jax.process_index() != 0 or not sys.stdout.isatty(),
               dynamic_ncols=True, desc="train", unit="step", file=sys.stdout, mininterval=0.5)
    meter, stop = Meter(run, bar), StopSignals()
    # every process stops at the same step; agreed every few seconds, not every step (multihost.py)
    stop_agreed = multihost.StopAgreement(lambda: stop.requested)
    batches = run.loader.iterate(0)
    say(bar, "compiling the training step (the first step waits for it)")
    val_ce, stopping, reached, last_saved = None, False, False, None
    try:
        while step < oc.training_steps and not reached:
            state, metrics = run.trainer.step(state, next_batch(batches, oc.grad_step))
            step += 1
            meter.dispatched(step, metrics)
            if step == run.start_step + 1:        # every process; launcher.sh waits for this line
                print(multihost.started_line(jax.process_index(), jax.process_count()), flush=True)
            meter.fetch(everything=False)
            check_saves(run.mngr)
            interval_ends = step % rc.checkpoint_steps == 0 or step == oc.training_steps
            stopping = stop_agreed(step, synced=interval_ends)
            if interval_ends or stopping:
                val_ce = log_interval(run, meter, state, step)
                reached = val_target_reached(val_ce, rc)
                if reached:
                    log(f"val loss {val_ce:.4f} <= --stop_at_val_loss {rc.stop_at_val_loss} at step {step}: "
                        f"stopping here, as at the last step")
                if step % (10 * rc.checkpoint_steps) == 0 or step == oc.training_steps or stopping or reached:
                    save_checkpoint(run, step, state, val_ce, force=stopping)
                    last_saved = step
                sample(run, state, step)
                meter.restart_timer()
            if stopping:
                break
        meter.fetch()
    except (Diverged, dataset.DataError):       # the state is sound: the checkpoint in flight completes
        bar.close()
        close_run(run)
        raise
    except SaveFailed:
        bar.close()
        discard_failed_saves(run.mngr)
        run.logger.close()
        run.loader.close()
        raise
    bar.close()
    if stopping and step < oc.training_steps:
        return stopped(run, step, stop.signal)
    return finish(run, state, step, val_ce, last_saved == step, meter.t0)


def sample_from_checkpoint(cfg):
    """--sample: restore the run's newest readable checkpoint on this mesh (whatever mesh saved it, with
    the model config it recorded), print one sample for --prompt, write nothing. The key is the one
    training samples with at that step, so on the same mesh the text is the one samples.txt holds."""
    mngr = checkpoint_manager(run_dir_of(cfg.run), read_only=True)
    newest = newest_meta(mngr)
    if newest is None:
        raise RunRefused(f"--sample: no readable checkpoint in {mngr.directory}; train the run first")
    fields = {f.name for f in dataclasses.fields(utils.ModelConfig)}
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, **{k: v for k, v in (newest[1].get("model") or {}).items() if k in fields}))
    utils.validate(cfg, jax.device_count())
    ids = prompt_ids(cfg.inference, cfg.model.T)
    trainer = build_trainer(cfg, sharding.make_mesh(cfg.run.n_device_axis))
    state, meta = restore_latest(mngr, trainer.abstract_state, None, cfg.model)
    mngr.close()
    text = sample_text(state, cfg, ids, int(meta["step"]))
    log(f"sample @ {meta['step']} of {mngr.directory}:\n{cfg.inference.prompt}{text}")
    return 0


def run_dir_of(rc):
    """OUTPUT_DIR/NAME; a file:// URL is the local path it names (os.* and Orbax are given the path)."""
    if is_url(rc.output_dir):
        return f"{rc.output_dir.rstrip('/')}/{rc.name}"
    local = fsspec.core.url_to_fs(rc.output_dir)[1] if rc.output_dir.startswith("file://") else rc.output_dir
    return os.path.join(local, rc.name)


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
    cfg = utils.config_from_args(argv)
    if cfg.run.compile_for:                 # a pod rehearsal on this machine: no devices, no run directory
        return pod.main(cfg)
    set_up_devices(cfg)
    quiet_failed_saves()
    try:
        if cfg.run.sample:                 # validated with the model config the checkpoint recorded
            return sample_from_checkpoint(cfg)
        check_data_source(cfg)
        utils.validate(cfg, jax.device_count())
        return train(cfg, sharding.make_mesh(cfg.run.n_device_axis))
    except utils.ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    except RunRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (SaveFailed, Diverged) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except dataset.DataError as e:          # the data (or --T, --vocab_size) does not fit the run
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
