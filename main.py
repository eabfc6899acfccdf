"""The training driver: mesh, init or restore, train/eval steps, logging, checkpoints, sampling.

`python main.py` with no flags trains the `tiny` preset on the bundled corpus (tokenized once into
$JAXFORMER_CACHE, default ~/.cache/jaxformer) on whatever devices exist; every field of the config is a flag (`python main.py --help`).
A run lives in OUTPUT_DIR/NAME (`--output_dir`, `--name`): checkpoints/, metrics.jsonl, samples.txt
and, with `--wandb`, the wandb files, plus `lock` while a run holds the directory. OUTPUT_DIR may be any
fsspec URL (gs://bucket/runs): there metrics and samples go out as whole numbered objects
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

Test hooks (environment, used by tests/test_main.py only):
  JAXFORMER_TEST_SIGNAL=STEP:SIG   send signal SIG (KILL or TERM) to this process after step STEP
                                   (after that step's checkpoint, if one is due, has been written).
  JAXFORMER_NO_SAMPLES=1           skip text generation (saves compile time in tests).
"""
import dataclasses
import json
import os
import posixpath
import signal
import sys
import time
import uuid
import warnings

import multihost
import utils

REPO = os.path.dirname(os.path.abspath(__file__))


def log(*args, **kwargs):
    """Print on process 0 only (every host runs this same script)."""
    if _PROCESS_INDEX == 0:
        print(*args, **kwargs, flush=True)


_PROCESS_INDEX = 0


def set_up_devices(cfg):
    """Environment for JAX, which must happen before `import jax`; then multi-host init, which exits
    with one line when not every process joins within $JAXFORMER_INIT_TIMEOUT s. Returns jax."""
    if cfg.run.cpu_devices > 0:
        flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if "xla_force_host_platform_device_count" not in f]
        os.environ["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={cfg.run.cpu_devices}"])
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax

    global _PROCESS_INDEX
    if os.environ.get("JAX_COORDINATOR_ADDRESS"):
        # GPU/CPU clusters (and launcher.sh): the coordinator and this host's rank come from the environment.
        if os.environ.get("JAX_PLATFORMS", "").startswith("cpu"):
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
        multihost.initialize(jax, coordinator_address=os.environ["JAX_COORDINATOR_ADDRESS"],
                             num_processes=int(os.environ["JAX_NUM_PROCESSES"]),
                             process_id=int(os.environ["JAX_PROCESS_ID"]))
    elif os.environ.get("SLURM_NTASKS", "1") != "1":
        multihost.initialize(jax)         # SLURM: everything is auto-detected
    elif _on_tpu_vm():
        try:                              # TPU pod slices: auto-detected from the TPU metadata
            multihost.initialize(jax)
        except Exception as e:            # a single-host TPU VM needs no coordination
            if _tpu_multihost():
                raise
            warnings.warn(f"jax.distributed.initialize() skipped on a single TPU host: {e}")
    _PROCESS_INDEX = jax.process_index()
    return jax


def _on_tpu_vm():
    import glob
    return bool(glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*")
                or os.environ.get("TPU_ACCELERATOR_TYPE") or os.environ.get("TPU_WORKER_HOSTNAMES"))


def _tpu_multihost():
    """True on a TPU VM that is one host of several (TPU_WORKER_HOSTNAMES lists them all)."""
    hosts = os.environ.get("TPU_WORKER_HOSTNAMES", "")
    return len([h for h in hosts.split(",") if h]) > 1


# ----------------------------------------------------------------------------------------------------------
# Metrics sinks: stdout (process 0), metrics.jsonl, wandb


def is_url(path):
    """True for an fsspec URL (gs://bucket/x, memory://x); such a path is never touched with os.*."""
    return "://" in str(path) and not str(path).startswith("file://")


def make_run_dir(run_dir):
    import fsspec
    fs, path = fsspec.core.url_to_fs(run_dir)
    fs.makedirs(path, exist_ok=True)           # a no-op under a bucket, where directories are prefixes


class RunFile:
    """One growing text file of the run directory (metrics.jsonl, samples.txt), written by process 0.

    A local directory gets every record appended at once. An object store cannot append, and rewriting a
    growing object on every line would cost O(lines^2): records wait in memory and go out as whole
    numbered objects, NAME.parts/000001, 000002, ... at flush() (each checkpoint, at most every FLUSH_S
    seconds otherwise, and at close). `read_run_file` puts either layout back together."""
    FLUSH_S = 60.0

    def __init__(self, run_dir, name):
        self.run_dir, self.name = run_dir, name
        self.remote = is_url(run_dir)
        self.path = f"{run_dir.rstrip('/')}/{name}" if self.remote else os.path.join(run_dir, name)
        self._buf, self._last = [], time.monotonic()
        if self.remote:
            import fsspec
            self.fs, parts = fsspec.core.url_to_fs(f"{self.path}.parts")
            self.parts = parts.rstrip("/")
            self._next = 1 + max([int(p) for p in _part_names(self.fs, self.parts)] or [0])

    def write(self, text):
        if not self.remote:
            with open(self.path, "a") as f:
                f.write(text)
            return
        self._buf.append(text)
        if time.monotonic() - self._last >= self.FLUSH_S:
            self.flush()

    def flush(self):
        """Write what is buffered as the next part object (an object store only; never fatal)."""
        if not self.remote or not self._buf:
            return
        name = f"{self.parts}/{self._next:06d}"
        try:
            self.fs.pipe_file(name, "".join(self._buf).encode("utf-8"))
        except Exception as e:                 # metrics never stop training; kept for the next flush
            warnings.warn(f"could not write {self.fs.unstrip_protocol(name)} ({type(e).__name__}: {e}); "
                          f"keeping {len(self._buf)} record(s) in memory for the next try")
            return
        self._buf, self._last, self._next = [], time.monotonic(), self._next + 1


def _part_names(fs, parts):
    try:
        names = [posixpath.basename(str(p).rstrip("/")) for p in fs.ls(parts, detail=False)]
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.isdigit())


def read_run_file(run_dir, name):
    """The whole text of a run file: the local file, or its part objects in order on an object store."""
    import fsspec
    fs, path = fsspec.core.url_to_fs(f"{run_dir.rstrip('/')}/{name}")
    text = fs.cat_file(path).decode("utf-8") if fs.exists(path) else ""
    return text + "".join(fs.cat_file(f"{path}.parts/{p}").decode("utf-8") for p in _part_names(fs, f"{path}.parts"))


class Logger:
    """metrics.jsonl and samples.txt in the run directory (local or any fsspec URL), and wandb."""

    def __init__(self, cfg, run_dir, run_id, enabled):
        self.enabled = enabled
        self.metrics_file = RunFile(run_dir, "metrics.jsonl")
        self.samples_file = RunFile(run_dir, "samples.txt")
        self.wandb = None
        if enabled and cfg.run.wandb:
            self.wandb = _init_wandb(cfg, run_dir, run_id)

    def flush(self):
        if self.enabled:
            self.metrics_file.flush()
            self.samples_file.flush()

    def metrics(self, record):
        if not self.enabled:
            return
        self.metrics_file.write(json.dumps(record) + "\n")
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
                import wandb
                self.wandb.log({"sample": wandb.Html(f"<pre>{prompt}{text}</pre>")}, step=step)
            except Exception as e:
                warnings.warn(f"wandb sample logging failed ({e})")

    def close(self):
        self.flush()
        if self.wandb is not None:
            try:
                self.wandb.finish()
            except Exception as e:
                warnings.warn(f"wandb.finish failed ({e})")


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
    """Online when WANDB_API_KEY is set, otherwise offline files under the run dir; never fatal."""
    try:
        import wandb
        if is_url(run_dir):                   # wandb writes a local directory: keep it in the cache
            import dataset
            run_dir = os.path.join(dataset.default_cache_dir(), "wandb", run_id)
            os.makedirs(run_dir, exist_ok=True)
        mode = os.environ.get("WANDB_MODE") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        run = wandb.init(project=os.environ.get("WANDB_PROJECT", "jaxformer"), name=cfg.run.name, id=run_id,
                         resume="allow", dir=run_dir, mode=mode, config=dataclasses.asdict(cfg),
                         settings=wandb.Settings(init_timeout=float(os.environ.get("WANDB_INIT_TIMEOUT", 30)),
                                                 silent=True))
        log(f"wandb: {mode} run {run_id}" + (f" in {run_dir}/wandb" if mode == "offline" else ""))
        return run
    except Exception as e:
        warnings.warn(f"wandb could not start ({type(e).__name__}: {e}); continuing with metrics.jsonl only")
        return None


# ----------------------------------------------------------------------------------------------------------
# Checkpoints


class RunRefused(Exception):
    """Starting would lose or mix work (a changed model, another run live in the directory, no readable
    checkpoint, a prompt that does not fit): main() prints the message and exits 2, nothing touched."""


class SaveFailed(Exception):
    """A checkpoint could not be written: one line naming the path and the OS error; main() exits 1."""


def checkpoint_manager(run_dir, read_only=False):
    import orbax.checkpoint as ocp
    options = (ocp.CheckpointManagerOptions(read_only=True, create=False) if read_only else
               ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=True, create=True))
    # a URL goes to Orbax as it is (every host writes its shards there); only a local path is made absolute
    directory = f"{run_dir.rstrip('/')}/checkpoints" if is_url(run_dir) else os.path.join(os.path.abspath(run_dir),
                                                                                             "checkpoints")
    # handlers named up front, so that a checkpoint's tree can be inspected before restoring (_restore)
    return ocp.CheckpointManager(directory, options=options, item_handlers={
        "state": ocp.StandardCheckpointHandler(), "meta": ocp.JsonCheckpointHandler()})


def save(mngr, step, state, meta, force=False):
    """Start an async save; SaveFailed when the directory cannot take it. The directory is probed first:
    on a read-only one Orbax fails to create the step directory and then its commit threads wait 5
    minutes for it before failing in a flood of tracebacks."""
    import orbax.checkpoint as ocp
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


def _check_writable(directory, state):
    """OSError when a local checkpoint directory cannot take a save of `state`: not writable, or less free
    space than this process' share of the state's bytes (uncompressed: a safe bound). Object stores
    are left to Orbax."""
    import errno
    import shutil

    import jax
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
    import re
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
    import jax
    steps = sorted(mngr.all_steps(), reverse=True)
    newest = newest_meta(mngr)         # an unreadable checkpoint is skipped here, reported below
    if newest is not None:
        check_model(newest[1].get("model") or {}, mc, f"{mngr.directory}/{newest[0]}")
    failed = []
    for step in steps:
        try:
            state, meta = _restore(mngr, step, abstract_state)
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
    import orbax.checkpoint as ocp
    for step in sorted(mngr.all_steps(), reverse=True):
        try:
            return step, mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception:
            continue
    return None


def _restore(mngr, step, abstract_state):
    import jax
    import jax.numpy as jnp
    import orbax.checkpoint as ocp
    # Checkpoints from before the aux-loss-free routing bias hold none: they routed with a bias of 0.
    has_bias = "router_bias" in mngr.item_metadata(step)["state"].keys()
    target = abstract_state if has_bias else {k: v for k, v in abstract_state.items() if k != "router_bias"}
    restored = mngr.restore(step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target),
                                                            meta=ocp.args.JsonRestore()))
    if int(restored["meta"]["step"]) != step:
        raise ValueError(f"metadata says step {restored['meta']['step']}")
    state = dict(restored["state"])
    if not has_bias:
        bias = abstract_state["router_bias"]
        state["router_bias"] = jax.device_put(jnp.zeros(bias.shape, bias.dtype), bias.sharding)
    return state, restored["meta"]


def check_model(saved, mc, where):
    """RunRefused naming every model field that differs from the checkpoint's (both values) when the
    difference changes a parameter's shape; otherwise a note (dropout, capacity, remat, ... may change)."""
    now = dataclasses.asdict(mc)
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
    import jax

    import model
    leaves, tree = jax.tree.flatten(jax.eval_shape(lambda k: model.init_params(mc, k), jax.random.key(0)))
    return str(tree), [leaf.shape for leaf in leaves]


def _move_aside(src, dst):
    """Rename a checkpoint directory, locally or on any fsspec store (there: copy + delete)."""
    import fsspec
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
    import fsspec
    fs, path = fsspec.core.url_to_fs(run_dir)
    names = [n for n in RUN_FILES if fs.exists(f"{path.rstrip('/')}/{n}")]
    if names:
        dst = f"{run_dir.rstrip('/')}/replaced/{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
        for name in names:
            _move_aside(f"{run_dir.rstrip('/')}/{name}", f"{dst}/{name}")
        log(f"--restart: moved {', '.join(names)} to {dst}")


def lock_run_dir(run_dir):
    """Take RUN_DIR/lock for this process (host, pid, start time) and release it at exit. RunRefused when
    a live run holds it; a lock whose process is gone (killed, host rebooted) is taken over with a
    warning. Local directories only: on an object store the lock is skipped."""
    import atexit
    if is_url(run_dir):
        return None
    path = os.path.join(run_dir, "lock")
    mine = dict(_process_identity(os.getpid()), host=_hostname(),
                started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()))
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(mine, f)
    try:
        for _ in range(3):
            try:
                os.link(tmp, path)      # atomic, and fails when the lock exists: the file appears whole
                atexit.register(_unlock, path, mine)
                return path
            except FileExistsError:
                holder = _read_lock(path)
            if holder is None and not os.path.exists(path):
                continue                # released meanwhile
            if holder is not None and _alive(holder):
                raise RunRefused(f"{run_dir} is in use by another run: pid {holder.get('pid')} on "
                                 f"{holder.get('host')}, started {holder.get('started')} (lock {path}); stop it or "
                                 f"use another --name; if that run is gone, delete {path}")
            log(f"WARNING: taking over {path}: pid {holder and holder.get('pid')} on "
                f"{holder and holder.get('host')} that held it is gone")
            _remove(path)               # not atomic with the read: two runs taking over at once can both win
        raise RunRefused(f"could not take the lock {path}: other runs keep taking it")
    finally:
        _remove(tmp)


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
    import socket
    return socket.gethostname()


def _read_lock(path):
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def _remove(path):
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def _unlock(path, mine):
    if _read_lock(path) == mine:
        _remove(path)


# ----------------------------------------------------------------------------------------------------------
# Data


def data_dir_for(cfg):
    if cfg.run.data_dir:
        return cfg.run.data_dir
    import dataset
    return dataset.ensure_bundled_shards(dataset.default_cache_dir())


# ----------------------------------------------------------------------------------------------------------
# The run


def main(argv=None):
    cfg = utils.config_from_args(argv)
    if cfg.run.compile_for:                 # a pod rehearsal on this machine: no devices, no run directory
        import pod
        return pod.main(cfg)
    jax = set_up_devices(cfg)
    n_devices = jax.device_count()
    try:
        if cfg.run.sample:                 # validated with the model config the checkpoint recorded
            return sample_from_checkpoint(cfg, jax)
        utils.validate(cfg, n_devices)
        return train(cfg, jax)
    except utils.ConfigError as e:
        print(e, file=sys.stderr)
        return 2
    except RunRefused as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SaveFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1


def build_trainer(cfg, mesh):
    """The training state's shardings, a fresh state, and the jitted training step (bench.py times
    this same step). The state: params, opt_state, key and router_bias. step(state, xs, ys) -> (state,
    stats); xs and ys are tuples of --grad_step global batches [dp x train_batch_size, T] laid out as
    data_sharding. eval_step(params, router_bias, x, y) -> (val CE, balance term)."""
    import types

    import jax
    import jax.numpy as jnp
    import optax
    from jax.sharding import NamedSharding, PartitionSpec as P

    import model
    import spikes

    mc, oc, rc = cfg.model, cfg.optim, cfg.run
    abstract_params = jax.eval_shape(lambda k: model.init_params(mc, k), jax.random.key(0))
    p_shard = model.param_shardings(abstract_params, mesh)
    replicated = NamedSharding(mesh, P())
    schedule = utils.lr_schedule(oc)
    # skip_spikes keeps the running grad-norm median in the optimizer state (checkpointed with it) and,
    # with --skip_spikes F > 0, leaves params and moments untouched on a step whose norm is > F x it.
    optimizer = spikes.skip_spikes(optax.chain(
        optax.clip_by_global_norm(oc.grad_clip_norm),
        spikes.adamw(schedule, oc, model.decay_mask(abstract_params), model.table_mask(abstract_params))),
        oc.skip_spikes)
    abstract_opt = jax.eval_shape(optimizer.init, abstract_params)
    o_shard = optax.tree_map_params(optimizer, lambda _, s: s, abstract_opt, p_shard,
                                    transform_non_params=lambda _: replicated)
    # The aux-loss-free routing bias [blocks, E] (model.update_router_bias), replicated: tiny, and equal
    # on every device because every device computes its update from the same global counts.
    state_shard = {"params": p_shard, "opt_state": o_shard, "key": replicated, "router_bias": replicated}
    router_bias = jax.ShapeDtypeStruct((mc.blocks, mc.n_experts), jnp.float32)

    def fresh_state(seed):
        init_key, train_key = jax.random.split(jax.random.key(seed))
        params = jax.jit(lambda k: model.init_params(mc, k), out_shardings=p_shard)(init_key)
        opt_state = jax.jit(optimizer.init, out_shardings=o_shard)(params)
        # The key committed to the mesh like the train step's output, so step 2 reuses step 1's executable.
        return {"params": params, "opt_state": opt_state,
                "key": jax.device_put(jax.random.key_data(train_key), replicated),
                "router_bias": jax.device_put(jnp.zeros(router_bias.shape, router_bias.dtype), replicated)}

    abstract_state = {"params": abstract_params, "opt_state": abstract_opt,
                      "key": jax.ShapeDtypeStruct(jax.random.key_data(jax.random.key(0)).shape, jnp.uint32),
                      "router_bias": router_bias}
    abstract_state = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                                  abstract_state, state_shard)
    G, M = oc.grad_step, rc.micro_batch_size

    def train_step(state, xs, ys):
        key, step_key = jax.random.split(jax.random.wrap_key_data(state["key"]))
        params, opt_state = state["params"], state["opt_state"]
        # Gradients of the params only: the routing bias is state the loss reads, not a parameter.
        grad_fn = jax.value_and_grad(lambda p, x, y, k: model.loss_and_metrics(
            model.with_router_bias(p, state["router_bias"]), x, y, k, mc, mesh, M, True), has_aux=True)

        def micro(sums, inputs):
            x, y, i = inputs
            (loss, metrics), g = grad_fn(params, x, y, jax.random.fold_in(step_key, i))
            return jax.tree.map(jnp.add, sums, (g, {"loss": loss, **metrics})), None

        loss, metrics = jax.eval_shape(grad_fn, params, xs[0], ys[0], step_key)[0]
        zeros = (jax.tree.map(jnp.zeros_like, params),
                 jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype), {"loss": loss, **metrics}))
        if G == 1:
            (grads, sums), _ = micro(zeros, (xs[0], ys[0], 0))
        else:
            (grads, sums), _ = jax.lax.scan(micro, zeros, (jnp.stack(xs), jnp.stack(ys), jnp.arange(G)))
            grads = jax.tree.map(lambda g: g / G, grads)
        # Means over the micro-steps, but the routed-choice counts stay sums: the bias update and the
        # log interval's loads count the whole global batch.
        stats = {name: s if name == "tokens_per_expert" else s / G for name, s in sums.items()}
        stats["grad_norm"] = optax.global_norm(grads)
        updates, new_opt_state = optimizer.update(grads, opt_state, params)
        stats["grad_norm_ratio"], stats["skipped"] = new_opt_state.ratio, new_opt_state.skipped
        # A step skipped as a spike leaves the routing bias as it was, like the parameters.
        router_bias = jnp.where(new_opt_state.skipped > opt_state.skipped, state["router_bias"],
                                model.update_router_bias(state["router_bias"], stats["tokens_per_expert"],
                                                         oc.bias_update_rate))
        return {"params": optax.apply_updates(params, updates), "opt_state": new_opt_state,
                "key": jax.random.key_data(key), "router_bias": router_bias}, stats

    data_sharding = NamedSharding(mesh, P("dp", None))          # sequences over dp, whole rows
    data_shards = tuple([data_sharding] * G)
    train_step = jax.jit(train_step, in_shardings=(state_shard, data_shards, data_shards),
                         out_shardings=(state_shard, replicated), donate_argnums=(0,))

    def eval_step(params, router_bias, x, y):
        _, metrics = model.loss_and_metrics(model.with_router_bias(params, router_bias), x, y, jax.random.key(0),
                                            mc, mesh, M, False)
        return metrics["ce"], jnp.sum(metrics["balance"])
    eval_step = jax.jit(eval_step, in_shardings=(p_shard, replicated, data_sharding, data_sharding))

    return types.SimpleNamespace(step=train_step, eval_step=eval_step, fresh_state=fresh_state,
                                 abstract_state=abstract_state, schedule=schedule, data_sharding=data_sharding)


def train(cfg, jax):
    import model
    return _train(cfg, jax, model.make_mesh(cfg.run.n_device_axis))


def sample_from_checkpoint(cfg, jax):
    """--sample: restore the run's newest readable checkpoint on this mesh (whatever mesh saved it, with
    the model config it recorded), print one sample for --prompt, write nothing. The key is the one
    training samples with at that step, so on the same mesh the text is the one samples.txt holds."""
    import model
    mngr = checkpoint_manager(run_dir_of(cfg.run), read_only=True)
    newest = newest_meta(mngr)
    if newest is None:
        raise RunRefused(f"--sample: no readable checkpoint in {mngr.directory}; train the run first")
    fields = {f.name for f in dataclasses.fields(utils.ModelConfig)}
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(
        cfg.model, **{k: v for k, v in (newest[1].get("model") or {}).items() if k in fields}))
    utils.validate(cfg, jax.device_count())
    ids = prompt_ids(cfg.inference, cfg.model.T)
    trainer = build_trainer(cfg, model.make_mesh(cfg.run.n_device_axis))
    state, meta = restore_latest(mngr, trainer.abstract_state, None, cfg.model)
    mngr.close()
    text = sample_text(state, cfg, ids, int(meta["step"]))
    log(f"sample @ {meta['step']} of {mngr.directory}: {cfg.inference.prompt}{text}")
    return 0


def run_dir_of(rc):
    return f"{rc.output_dir.rstrip('/')}/{rc.name}" if is_url(rc.output_dir) else os.path.join(rc.output_dir, rc.name)


def prompt_ids(ic, T):
    """The prompt's token ids, checked at start: an empty prompt is <|endoftext|> alone (every document
    starts with it, as the guide samples); RunRefused when prompt + --max_tokens do not fit in --T."""
    from data.tokenizer import get_tokenizer
    enc = get_tokenizer()
    ids = enc.encode_ordinary(ic.prompt) or [enc.eot_token]
    if len(ids) + ic.max_tokens > T:
        raise RunRefused(f"--prompt is {len(ids)} tokens and --max_tokens {ic.max_tokens} asks for that many more: "
                         f"{len(ids) + ic.max_tokens} positions, more than --T {T}; shorten --prompt, lower "
                         f"--max_tokens (to at most {T - len(ids)}) or raise --T")
    return ids


def sample_text(state, cfg, ids, step):
    """--max_tokens new tokens after `ids` (top-k, temperature) from the state's params routed with its
    bias, decoded; the key depends on the seed and the step only, never on the training key."""
    import model
    from data.tokenizer import get_tokenizer
    import jax
    ic, enc = cfg.inference, get_tokenizer()
    key = jax.random.fold_in(jax.random.key(cfg.run.seed + 1), step)
    params = model.with_router_bias(state["params"], state["router_bias"])
    new = model.generate(params, cfg.model, ids, key, ic.max_tokens, ic.top_k, ic.temperature, ic.use_cache)
    return enc.decode([t for t in new if t < enc.n_vocab])


def on_process_0(jax, fn):
    """fn() on process 0 while the others wait for it; a RunRefused there stops every process."""
    refused = None
    if jax.process_index() == 0:
        try:
            fn()
        except RunRefused as e:
            refused = e
    if jax.process_count() > 1:
        import numpy as np
        from jax.experimental import multihost_utils
        if multihost_utils.broadcast_one_to_all(np.int32(refused is not None)) and refused is None:
            refused = RunRefused("process 0 refused to start this run; its log says why")
    if refused is not None:
        raise refused


def handle_stop_signals(stop):
    """SIGTERM and a first Ctrl-C set stop["requested"] (and stop["signal"]): the loop finishes its step,
    saves, says where, exits 0. A second Ctrl-C gets the default action, which ends the process at once,
    even inside a long XLA call (a Python handler would wait for it to return)."""
    def on_signal(signum, frame):
        if signum == signal.SIGINT:
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            # os.write, not print: the handler may interrupt a print, and print is not reentrant
            os.write(2, b"\nCtrl-C: finishing this step, then saving and exiting; Ctrl-C again to exit now "
                        b"without saving\n")
        stop["requested"] = True
        stop.setdefault("signal", signal.Signals(signum).name)
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def load_spread(load):
    """(max/min tokens per expert over the worst MoE layer, a note naming idle experts or None); inf when
    an expert got no tokens."""
    import numpy as np
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
    import numpy as np
    tokens = np.sum([m["tokens_per_expert"] for m in steps], axis=0)          # [layers, experts]
    return {"expert_load": (tokens / tokens.sum(-1, keepdims=True)).tolist(),
            "idle_expert_fraction": np.mean(tokens == 0, axis=-1).tolist(),
            "load_max_over_mean": (tokens.max(-1) / tokens.mean(-1)).tolist(),
            "layer_drop_rate": np.mean([m["drop_rate"] for m in steps], axis=0).tolist(),
            "layer_balance": np.mean([m["balance"] for m in steps], axis=0).tolist()}


def val_target_reached(val_loss, rc):
    """Whether an evaluation's val cross-entropy ends the run (--stop_at_val_loss; 0 = never)."""
    return rc.stop_at_val_loss > 0 and val_loss is not None and val_loss <= rc.stop_at_val_loss


def _train(cfg, jax, mesh):
    import numpy as np
    from tqdm import tqdm

    import dataset
    import model
    import spikes

    mc, oc, rc, ic = cfg.model, cfg.optim, cfg.run, cfg.inference
    proc0 = jax.process_index() == 0
    dp, pp, tp = rc.n_device_axis
    n_mesh = dp * pp * tp
    run_dir = run_dir_of(rc)
    sample_ids = prompt_ids(ic, mc.T)           # a prompt that cannot be sampled stops the run before it starts
    if proc0:
        make_run_dir(run_dir)
    on_process_0(jax, lambda: lock_run_dir(run_dir))
    if rc.restart:                              # every host opens the checkpoints after they moved
        on_process_0(jax, lambda: set_aside_previous_run(run_dir))

    log(utils.describe(cfg))
    counts = model.count_params(mc)
    log(f"params: total {counts['total']:,} | active {counts['active']:,} | embedding {counts['embedding']:,} "
        f"(active: used per token, without the embedding)")
    log(f"mesh: dp={dp} pp={pp} tp={tp} over {n_mesh} of {jax.device_count()} {jax.devices()[0].device_kind} "
        f"device(s), {jax.process_count()} process(es)")
    log(utils.MFU_FORMULA)

    trainer = build_trainer(cfg, mesh)
    abstract_state, schedule, data_sharding = trainer.abstract_state, trainer.schedule, trainer.data_sharding
    G = oc.grad_step

    # --- data
    data_dir = data_dir_for(cfg)
    train_ds = dataset.TokenDataset(data_dir, "train", mc.vocab_size)
    val_ds = dataset.TokenDataset(data_dir, "val", mc.vocab_size)
    global_batch = dp * rc.train_batch_size
    val_batches = dataset.validation_batches(val_ds, mc.T, dp * rc.val_batch_size, data_sharding, rc.eval_steps)
    if len(val_batches) < rc.eval_steps:
        log(f"note: the val split holds {val_ds.n_windows(mc.T)} windows of {mc.T + 1} tokens, enough for "
            f"{len(val_batches)} of --eval_steps {rc.eval_steps} batches of {dp * rc.val_batch_size}; "
            f"evaluating on {len(val_batches)}")

    mngr = checkpoint_manager(run_dir)
    restored = restore_latest(mngr, abstract_state, run_dir, mc)
    if restored is None:
        state, start_step, run_id = trainer.fresh_state(rc.seed), 0, uuid.uuid4().hex[:8]
        start_seq = 0
    else:
        state, meta = restored
        start_step, run_id = int(meta["step"]), meta.get("run_id") or uuid.uuid4().hex[:8]
        # sequences consumed, whatever batch layout consumed them (checkpoints before it: data_step batches)
        start_seq = int(meta.get("sequences", meta.get("data_step", start_step * G) * global_batch))
        log(f"resumed from {mngr.directory}/{start_step}: step {start_step}, data position {start_seq} "
            f"sequences, run id {run_id}")

    logger = Logger(cfg, run_dir, run_id, proc0)
    if restored is not None:
        logger.metrics({"event": "resume", "step": start_step})

    def evaluate(state):
        results = [trainer.eval_step(state["params"], state["router_bias"], x, y) for x, y in val_batches]
        ce, bal = np.mean([float(r[0]) for r in results]), np.mean([float(r[1]) for r in results])
        return float(ce), float(bal)

    samples_on = os.environ.get("JAXFORMER_NO_SAMPLES") != "1"

    def sample(state, step):
        """A failed sample is a warning: it never costs the run (the checkpoint is written before it)."""
        if not samples_on:
            return
        try:
            text = sample_text(state, cfg, sample_ids, step)
            log(f"sample @ {step}: {ic.prompt}{text!r}")
            logger.sample(step, ic.prompt, text)
        except Exception as e:
            log(f"WARNING: sampling at step {step} failed ({type(e).__name__}: {e}); training goes on")

    def checkpoint(step, state, val_loss, force=False):
        meta = {"step": step, "sequences": start_seq + (step - start_step) * G * global_batch, "run_id": run_id,
                "model": dataclasses.asdict(mc), "val_loss": val_loss}
        save(mngr, step, state, meta, force=force)
        logger.flush()                 # on an object store: metrics and samples up to this checkpoint

    # --- SIGTERM, Ctrl-C: finish the current step, save, wait, exit 0
    stop = {"requested": False}
    handle_stop_signals(stop)
    test_signal = os.environ.get("JAXFORMER_TEST_SIGNAL")
    test_signal = (int(test_signal.split(":")[0]), test_signal.split(":")[1]) if test_signal else None

    # every process stops at the same step; agreed every few seconds, not every step (multihost.py)
    stop_agreed = multihost.StopAgreement(jax, lambda: stop["requested"])

    # --- the loop
    tokens_per_step = G * global_batch * mc.T
    flops_per_token = model.flops_per_token(mc)
    peak = utils.peak_flops(jax.devices()[0].device_kind)
    step = start_step
    loader = dataset.BatchLoader(train_ds, mc.T, global_batch, data_sharding, rc.seed, consumed=start_seq)
    batches = loader.iterate(0)
    pending = []                       # (step, device metrics) not yet fetched: keeps dispatch one step ahead
    interval = []                      # fetched metrics of the current log interval
    watch = spikes.SpikeWatch(oc.skip_spikes or spikes.RATIO_WARN)
    skipped_before = {"n": int(jax.device_get(state["opt_state"].skipped))}   # count before the next fetched step
    timer = {"t": None, "steps": 0, "first_step_s": None}
    bar = tqdm(total=oc.training_steps, initial=start_step, disable=not proc0, dynamic_ncols=True,
               desc="train", unit="step", file=sys.stdout,
               mininterval=0.5 if sys.stdout.isatty() else 60)    # a log file gets a line a minute
    last_saved = start_step if restored is not None else None
    val_ce, stopping = None, False
    # a run that stopped at --stop_at_val_loss is finished: the same command reports, as after the last step
    reached = restored is not None and val_target_reached(restored[1].get("val_loss"), rc)

    def fetch(upto_all):
        while pending and (upto_all or len(pending) > 1):
            s, m = pending.pop(0)
            m = jax.device_get(m)
            rec = {"step": s, "loss": float(m["loss"]), "ce": float(m["ce"]), "balance": float(np.sum(m["balance"])),
                   "grad_norm": float(m["grad_norm"]), "lr": float(schedule(s - 1)),
                   "drop_rate": float(np.mean(m["drop_rate"])), "skipped_steps": int(m["skipped"]),
                   "grad_norm_ratio": float(m["grad_norm_ratio"]) if np.isfinite(m["grad_norm_ratio"]) else None}
            rec["update_skipped"] = rec["skipped_steps"] > skipped_before["n"]
            skipped_before["n"] = rec["skipped_steps"]
            warning = watch.step(rec)                   # adds rec["loss_jump"]
            if warning:
                bar.write(warning) if proc0 else None
            logger.metrics(rec)
            interval.append((rec, m))
            now = time.perf_counter()
            if timer["t"] is None:     # the first step includes compilation: time from its end
                timer["first_step_s"] = now - t_start
                timer["t"], timer["steps"] = now, 0
            else:
                timer["steps"] += 1
            bar.update(1)
            bar.set_postfix(loss=f"{rec['loss']:.3f}", refresh=False)

    t_start = time.perf_counter()
    while step < oc.training_steps and not reached:
        xs, ys = zip(*[next(batches) for _ in range(G)])
        state, metrics = trainer.step(state, xs, ys)
        step += 1
        pending.append((step, metrics))
        if step == start_step + 1:
            print(multihost.started_line(jax), flush=True)     # every process; launcher.sh waits for it
        fetch(upto_all=timer["t"] is None)      # block on the first step, so the timer starts after compilation
        stopping = stop_agreed(step, synced=step % rc.checkpoint_steps == 0 or step == oc.training_steps)
        if step % rc.checkpoint_steps == 0 or step == oc.training_steps or stopping:
            fetch(upto_all=True)
            now = time.perf_counter()
            steps_timed = timer["steps"]
            elapsed = now - timer["t"] if timer["t"] is not None else 0.0
            tok_s = steps_timed * tokens_per_step / elapsed if steps_timed and elapsed > 0 else None
            step_time = elapsed / steps_timed if steps_timed else timer["first_step_s"]
            val_ce, val_bal = evaluate(state)
            reached = val_target_reached(val_ce, rc)
            recs = [r for r, _ in interval]
            experts = expert_stats([m for _, m in interval])
            spread, idle = load_spread(np.asarray(experts["expert_load"]))
            util = utils.mfu(tok_s, flops_per_token, n_mesh, peak) if tok_s else None
            rec = {"step": step, "val_loss": val_ce, "val_balance": val_bal,
                   "train_loss": float(np.mean([r["loss"] for r in recs])), "lr": recs[-1]["lr"],
                   "grad_norm": recs[-1]["grad_norm"], "tokens_per_s": tok_s, "step_time_s": step_time,
                   "mfu": util, **experts, "expert_load_spread": spread if idle is None else None,
                   "drop_rate": float(np.mean([r["drop_rate"] for r in recs])),
                   "balance": float(np.mean([r["balance"] for r in recs])),
                   "skipped_steps": recs[-1]["skipped_steps"], **watch.interval()}
            logger.metrics(rec)
            bar.write(f"step {step:>6} | loss {recs[-1]['loss']:.4f} | val {val_ce:.4f} | lr {rec['lr']:.2e} | "
                      f"grad {rec['grad_norm']:.3f} | "
                      f"{(f'{tok_s:,.0f}' if tok_s else 'n/a'):>8} tok/s | step {step_time * 1e3:.0f} ms | "
                      f"MFU {(f'{100 * util:.1f}%' if util is not None else 'n/a')} | "
                      f"load max/min {spread:.2f}{idle or ''} | drop {100 * rec['drop_rate']:.2f}%") if proc0 else None
            interval.clear()
            if reached:
                log(f"val loss {val_ce:.4f} <= --stop_at_val_loss {rc.stop_at_val_loss} at step {step}: "
                    f"stopping here, as at the last step")
            if step % (10 * rc.checkpoint_steps) == 0 or step == oc.training_steps or stopping or reached:
                checkpoint(step, state, val_ce, force=stopping)
                last_saved = step
            sample(state, step)
            timer["t"], timer["steps"] = time.perf_counter(), 0
        if test_signal and step == test_signal[0]:
            mngr.wait_until_finished()
            fetch(upto_all=True)
            os.kill(os.getpid(), getattr(signal, "SIG" + test_signal[1]))
            if test_signal[1] == "TERM":
                stop["requested"] = True    # make sure the handler's flag is seen at the next check
        if stopping:
            break
    fetch(upto_all=True)
    bar.close()
    if stopping and step < oc.training_steps:
        wait_for_save(mngr)
        mngr.close()
        log(f"{stop.get('signal', 'stop requested on another host')}: checkpoint of step {step} written to "
            f"{mngr.directory}/{step}; exiting (the same command resumes it)")
        logger.close()
        loader.close()
        return 0

    if val_ce is None:                          # resumed a finished run: just report
        val_ce, _ = evaluate(state)
        sample(state, step)
    if last_saved != step:
        checkpoint(step, state, val_ce)
    wait_for_save(mngr)
    mngr.close()
    entropy = train_ds.unigram_entropy()          # from the token counts the tokenizer recorded
    log(f"final: val cross-entropy {val_ce:.4f} nats | " + (
        f"unigram entropy of the training tokens {entropy:.4f} nats | {entropy - val_ce:+.4f} nats below it"
        if entropy is not None else "unigram entropy n/a (the manifest predates token counts; re-tokenize)")
        + f" | {time.perf_counter() - t_start:.0f} s")
    logger.metrics({"step": step, "final_val_loss": val_ce, "unigram_entropy": entropy})
    logger.close()
    loader.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
