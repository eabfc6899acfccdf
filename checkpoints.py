"""Checkpoints: async Orbax saves of the training state with what resuming needs (step, data position,
run id, model config, a checksum per array), restores onto any mesh and any --pipeline_repeats, the
check that a checkpoint holds the same model, and the handling of saves that fail (one line, no
partial directory left).
"""
import atexit
import dataclasses
import errno
import logging
import math
import os
import shutil
import socket
import sys
import time

import fsspec
import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec

import sharding
from multihost import log
from rundir import RunRefused, is_url, move_aside, os_error


class SaveFailed(Exception):
    """A checkpoint could not be written: one line naming the path and the OS error; main() exits 1."""


def checkpoint_manager(run_dir, read_only=False):
    """The run's checkpoints: saving every --checkpoint_steps interval it is asked to, keeping the last 3;
    read_only (--sample): a manager that writes nothing."""
    # a URL goes to Orbax as it is (every host writes its shards there); only a local path is made absolute
    directory = f"{run_dir.rstrip('/')}/checkpoints" if is_url(run_dir) else os.path.join(os.path.abspath(run_dir),
                                                                                             "checkpoints")
    # Orbax warns that a read-only manager is read only and saves nothing (its options and the manager say
    # so): asked for.
    absl, level = logging.getLogger("absl"), logging.getLogger("absl").level
    absl.setLevel(logging.ERROR if read_only else level)
    try:
        options = (ocp.CheckpointManagerOptions(read_only=True, create=False) if read_only else
                   ocp.CheckpointManagerOptions(max_to_keep=3, enable_async_checkpointing=True, create=True))
        # handlers named up front, so that a checkpoint's tree can be inspected before restoring (restore_step)
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
        raise SaveFailed(f"could not save the checkpoint of step {step} in {mngr.directory}: {os_error(e)}") from e


def wait_for_save(mngr):
    """Wait for the async save in flight (a full disk fails there); SaveFailed naming the path and cause."""
    try:
        mngr.wait_until_finished()
    except Exception as e:
        raise SaveFailed(f"could not save a checkpoint in {mngr.directory}: {os_error(e)}") from e


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
    """Best effort: a store that fails the save may fail this too (down, read-only); Orbax's next start
    ignores what is left, and the failure was reported already."""
    fs, path = fsspec.core.url_to_fs(directory)
    try:
        for leftover in fs.glob(f"{path.rstrip('/')}/*.orbax-checkpoint-tmp*"):
            fs.rm(leftover, recursive=True)
    except Exception:
        pass


def check_can_save(mngr, abstract_state):
    """RunRefused at start when the checkpoint directory could not take a save of the state (a file in its
    place, not writable, too little space for one checkpoint): found at the first save, it would cost
    every step before it."""
    try:
        _check_writable(str(mngr.directory), abstract_state)
    except OSError as e:
        raise RunRefused(f"the checkpoints could not be saved in {mngr.directory} ({os_error(e)}); make it a "
                         f"directory this process can write with room for a checkpoint, or use another "
                         f"--output_dir or --name") from None


def compile_checksums(abstract_state):
    """Compile the save's checksum program now: a stop (a preemptible TPU gives ~30 s) must save at once,
    not compile first. The compiled program is jit's, so save_checkpoint's call finds it."""
    checksums_and_finite.lower(abstract_state).compile()


def _check_writable(directory, state):
    """OSError when a local checkpoint directory cannot take a save of `state` (arrays or their shapes):
    not writable, or less free space than this process' share of the state's bytes (uncompressed: a safe
    bound). Object stores are left to Orbax."""

    if is_url(directory):
        return
    os.makedirs(directory, exist_ok=True)
    probe = os.path.join(directory, f".write-test-{socket.gethostname()}-{os.getpid()}")
    with open(probe, "w") as f:
        f.write("ok")
    os.remove(probe)
    need = sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree.leaves(state)) // jax.process_count()
    free = shutil.disk_usage(directory).free
    if free < need:
        raise OSError(errno.ENOSPC, f"No space left on device ({free / 2**20:.1f} MiB free, the checkpoint "
                                    f"needs about {need / 2**20:.1f} MiB)", directory)


def restore_latest(mngr, abstract_state, run_dir, mc, steps=None):
    """(state, meta) from the newest readable checkpoint (of `steps`; None: of all), restored straight onto the
    current mesh's shardings (so a checkpoint saved on any mesh restores on this one); None when there is none.

    The newest readable metadata is compared with the model config first (`check_model`): a change of
    shape raises RunRefused before anything is touched. A checkpoint that then fails to read is moved to
    run_dir/unreadable_checkpoints with a warning naming the cause, once an older one has restored
    (run_dir None: left in place). When none restores: RunRefused, nothing moved."""
    steps = sorted(mngr.all_steps() if steps is None else steps, reverse=True)
    newest = newest_meta(mngr, steps)  # an unreadable checkpoint is skipped here, reported below
    if newest is not None:
        check_model(newest[1].get("model") or {}, mc, f"{mngr.directory}/{newest[0]}")
    failed = []
    for step in steps:
        try:
            state, meta = restore_step(mngr, step, abstract_state, mc.pipeline_repeats)
        except Exception as e:
            failed.append((step, f"{type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:300]}"))
            continue
        for bad, cause in failed:
            dst = f"{run_dir.rstrip('/')}/unreadable_checkpoints/{bad}-{int(time.time())}" if run_dir else None
            log(f"WARNING: checkpoint {mngr.directory}/{bad} is unreadable ({cause}); "
                + (f"moved to {dst}; " if dst else "") + f"using step {step}")
            if dst and jax.process_index() == 0:
                move_aside(f"{str(mngr.directory).rstrip('/')}/{bad}", dst)
        if failed and run_dir:
            mngr.reload()
        return state, meta
    if failed:
        raise RunRefused(f"no checkpoint in {mngr.directory} can be read; nothing was moved:\n"
                         + "\n".join(f"  step {s}: {cause}" for s, cause in failed)
                         + "\nfix the cause (storage, permissions) and rerun, or add --restart to start over "
                           "(the old run is moved aside, not deleted)")
    return None


def newest_meta(mngr, steps=None):
    """(step, metadata) of the newest checkpoint (of `steps`; None: of all) whose metadata (step, data position,
    run id, model config) reads, without its arrays; None when there is none."""
    for step in sorted(mngr.all_steps() if steps is None else steps, reverse=True):
        try:
            return step, mngr.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
        except Exception:
            continue
    return None


def restore_step(mngr, step, abstract_state, repeats):
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


def trained(state):
    """The parts of the state a NaN must never reach: params, routing bias and the optimizer's moments
    (not the spike watch's window of grad norms, where NaN means "not seen yet")."""
    return state["params"], state["router_bias"], state["opt_state"].inner


def all_finite(tree):
    """Whether every float in the tree is finite (one reduction per leaf)."""
    return jnp.all(jnp.stack([jnp.all(jnp.isfinite(leaf)) for leaf in jax.tree.leaves(tree)
                              if jnp.issubdtype(leaf.dtype, jnp.floating)]))


@jax.jit
def checksums_and_finite(state):
    """({leaf path: its checksum}, whether the trained part of the state is finite), one pass over it."""
    sums = {jax.tree_util.keystr(path): _checksum(leaf) for path, leaf in jax.tree_util.tree_leaves_with_path(state)}
    return sums, all_finite(trained(state))


def _check_checksums(state, saved):
    """ValueError naming the first array whose bits differ from those its checkpoint recorded (a
    checkpoint written before checksums were kept, saved None, is taken as it is)."""
    if saved is None:
        return
    sums, _ = jax.device_get(checksums_and_finite(state))
    for path, value in sums.items():
        if path in saved and int(value) != int(saved[path]):
            raise ValueError(f"array {path} does not match the checksum saved with it: its bits changed in storage")


def _in_layout(target, saved_repeats, repeats):
    """target (abstract state, stored for --pipeline_repeats `repeats`) with every stacked block leaf
    (under a "blocks" key: params and optimizer moments) shaped as `saved_repeats` stores it
    (sharding.Layout) and replicated over pp, which need not split that layout's stacked axis;
    target itself when nothing differs."""
    changed = []
    lead = sharding.Layout(repeats).stacked_dims     # target's stacked dims: [blocks] or [P, G]

    def one(path, t):
        if not any(getattr(k, "key", None) == "blocks" for k in path):
            return t
        blocks, rest = math.prod(t.shape[:lead]), t.shape[lead:]
        shape = sharding.Layout(saved_repeats).stored_shape((blocks, *rest))
        if shape == t.shape:
            return t
        changed.append(path)
        spec = (*t.sharding.spec, *(None,) * len(t.shape))[lead:len(t.shape)]
        placement = NamedSharding(t.sharding.mesh, PartitionSpec(*(None,) * (len(shape) - len(rest)), *spec))
        return jax.ShapeDtypeStruct(shape, t.dtype, sharding=placement)
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

    leaves, tree = jax.tree.flatten(jax.eval_shape(lambda k: sharding.init_params(mc, k), jax.random.key(0)))
    return str(tree), [leaf.shape for leaf in leaves]
