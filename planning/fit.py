"""The run's fit check: does a run fit the devices this process has? Asked three times: from shapes alone,
before anything is allocated (`check_fits`: its state, gradients and the layer inputs its backward keeps, a
lower bound; a run that cannot fit is refused in one line); with --fit, from its compiled train step
(`fit_to_devices`: when the plan exceeds the devices' memory, the cheapest setting that fits,
planning/tradeoffs.py); and by the compile of the step the run trains with (`compile_train_step`: the plan
said on an accelerator, a step too large for the devices one line naming the shortfall and the setting that
fits). Before them `settle_auto_remat` settles --remat auto where keeping every activation may fit (a TPU's),
by compiling that step. Compiles and plans are planning/measure.py's; `--compile_for` asks the compiled question
of a slice (planning/report.py)."""
from typing import NamedTuple

import jax
import numpy as np
import psutil
from jax.experimental import multihost_utils

import hardware
import sharding
import utils
from engine import engine_for
from planning import measure, tradeoffs
from rundir import RunRefused
from trainer import abstract_step_args, build_trainer

GiB = 2**30


RESIDUAL_BYTES = 4                  # the residual stream is fp32 (model.Layer), whatever --model_dtype


class OutOfMemory(Exception):
    """The train step does not fit the devices' memory: one line (exit 1)."""


def check_fits(cfg, trainer, state_only=False):
    """RunRefused, in one line, when this run's planned bytes per device (`planned_bytes`) exceed what this
    process's devices of the mesh have; nothing is allocated before it, and --force skips it. The plan is a
    lower bound (no compile), so a run refused here cannot fit, and one let through still may not. state_only:
    the state and its gradients alone, which no setting the planner tries makes smaller (--fit asks this
    before it compiles any)."""
    if cfg.run.force:
        return
    refusal = _refusal(cfg, trainer, state_only)
    if jax.process_count() > 1:         # a process that stopped alone would leave the others in a collective
        refused = np.asarray(multihost_utils.process_allgather(np.int32(refusal is not None)))
        if refused.any() and refusal is None:
            refusal = (f"process(es) {', '.join(map(str, np.flatnonzero(refused)))} cannot hold this run's "
                       f"planned memory; their logs say why (--force tries anyway)")
    if refusal is not None:
        raise RunRefused(refusal)


def fit_to_devices(cfg, mesh, say=print):
    """--fit on a run: cfg's train step compiled for this mesh and, when its plan exceeds what the devices
    have, the setting of fewest compiled FLOPs that fits (planning/tradeoffs.py); returns the config to run and
    its Trainer with the step compiled (None where nothing was), and says which. Every process measures against the least
    memory any process's devices have, so all choose alike."""
    budget = shared_budget_gib(mesh)
    if budget is None:
        say("--fit: this runtime does not say its devices' memory; the run goes as given")
        return cfg, None
    as_given = measure.train_plan(cfg, mesh)
    if as_given.gib <= budget:
        say(f"--fit: the train step plans {as_given.gib:.2f} of {budget:.2f} GiB a device; the run goes as given")
        return cfg, as_given.trainer
    say(f"--fit: the train step plans {as_given.gib:.2f} GiB a device, more than the {budget:.2f} GiB it has; "
        f"compiling the settings that trade compute for memory:")
    chosen, _ = tradeoffs.cheapest_fit(cfg, mesh.size, budget, lambda c: measure.train_plan(c, mesh), say)
    if chosen is None:
        raise RunRefused(f"--fit: no setting that trades compute for memory makes this run fit {budget:.2f} GiB a "
                         f"device; a larger pp or tp, a smaller model or more devices")
    say(f"--fit: running with {tradeoffs.flags(chosen.changes)} ({chosen.gib:.2f} GiB a device, FLOPs "
        f"{chosen.flops_ratio:.2f}x the model's)")
    return chosen.cfg, chosen.trainer


def shared_budget_gib(mesh):
    """GiB a device of the mesh has, the least any process's devices have (so that all processes choose alike);
    None where a runtime does not say."""
    memory = device_memory(mesh)
    budget = np.float64(-1.0 if memory is None else memory.gib_each)
    if jax.process_count() > 1:
        budgets = np.asarray(multihost_utils.process_allgather(budget))
        budget = np.float64(-1.0) if (budgets < 0).any() else budgets.min()
    return None if budget < 0 else float(budget)


def settle_auto_remat(cfg, mesh, say=print, budget_gib=None):
    """(cfg with --remat auto settled for the mesh's devices, its StepPlan where one was compiled, else None). Where
    the fast engine would trace a training step's layers apart with nothing recomputed (engine.Fast.layer_loop: a
    TPU, up to engine.MAX_LAYERS_APART layers), auto is --remat none if that step's plan fits budget_gib a device
    (None: what the devices have, shared_budget_gib): every activation kept, nothing replayed, faster than dots'
    stacked products (docs/performance-log.md#2026-12-07-tpu-layers-apart); else, and on every other platform or model, the
    engine's auto as given (dots on a TPU)."""
    if cfg.model.remat != "auto":
        return cfg, None
    keep_all = utils.override(cfg, remat="none")
    if not engine_for(keep_all.model, mesh.devices.flat[0]).layer_loop(keep_all.model, True).apart:
        return cfg, None
    budget_gib = shared_budget_gib(mesh) if budget_gib is None else budget_gib
    if budget_gib is None:
        return cfg, None
    plan = measure.train_plan(keep_all, mesh)
    if plan.trainer is not None and plan.gib <= budget_gib:
        say(f"--remat auto: none (every activation kept), the train step planning {plan.gib:.2f} of {budget_gib:.2f} "
            f"GiB a device")
        return keep_all, plan
    say(f"--remat auto: dots (none, every activation kept, would need {plan.gib:.2f} GiB a device of {budget_gib:.2f})")
    return cfg, None


def compile_train_step(cfg, trainer, argv, say=print, program="python main.py"):
    """trainer with its train step compiled for its mesh, the compile the first step would otherwise make. On an
    accelerator its plan (measure.planned_gib) is said in one line; a step the devices cannot hold (the compiler
    refuses it, as XLA:TPU does, or its plan exceeds the memory the runtime reports) is OutOfMemory, after the
    settings that trade compute for memory are compiled (planning/tradeoffs.py) to name the cheapest that fits."""
    mesh = trainer.data_sharding.mesh
    compiled = trainer.step if isinstance(trainer.step, jax.stages.Compiled) else compile_step(    # --fit's
        trainer.step, abstract_step_args(cfg, trainer)[0], cfg, mesh, argv, say, program)
    memory, platform = device_memory(mesh), mesh.devices.flat[0].platform
    if memory is not None and platform != "cpu":     # an accelerator's own memory (a CPU's is the host's)
        gib, have = measure.planned_gib(compiled.memory_analysis(), platform), memory.gib_each
        if gib > have:
            raise OutOfMemory(does_not_fit(cfg, mesh, gib, argv, say, program))
        say(f"the train step plans {gib:.2f} of {have:.2f} GiB a device ({100 * gib / have:.0f}%)")
    return trainer._replace(step=compiled)


def compile_step(step, args, cfg, mesh, argv, say=print, program="python main.py"):
    """cfg's jitted train step compiled for args; OutOfMemory (`does_not_fit`) where the compiler refuses it
    for want of memory."""
    compiled, needed = measure.compiled_or_shortfall(step, args)
    if compiled is None:
        raise OutOfMemory(does_not_fit(cfg, mesh, needed, argv, say, program))
    return compiled


def does_not_fit(cfg, mesh, needed_gib, argv, say=print, program="python main.py"):
    """The line for a train step that needs needed_gib per device, more than the devices have: the shortfall and
    the cheapest setting that fits with its command, or that none does; the settings are compiled first
    (tradeoffs.cheapest_fit, each said as it is)."""
    memory = device_memory(mesh)
    if memory is None:                      # the runtime does not say what the devices have
        return f"out of memory: the train step needs {needed_gib:.2f} GiB a device"
    have = memory.gib_each
    say(f"out of memory: the train step needs {needed_gib:.2f} GiB a device, more than the {have:.2f} GiB it has; "
        f"compiling the settings that trade compute for memory:")
    chosen, _ = tradeoffs.cheapest_fit(cfg, mesh.size, have, lambda c: measure.train_plan(c, mesh), say)
    head = (f"out of memory: the train step needs {needed_gib:.2f} GiB a device, {memory.words} "
            f"({needed_gib - have:.2f} GiB short); ")
    if chosen is None:
        return head + "no setting that trades compute for memory fits: a larger pp or tp, a smaller model or more devices"
    return (head + f"it fits with {tradeoffs.flags(chosen.changes)} ({chosen.gib:.2f} GiB, FLOPs {chosen.flops_ratio:.2f}x "
            f"the model's): {tradeoffs.command(argv, chosen.changes, program)}")


def runtime_out_of_memory(error, what):
    """OutOfMemory for a device allocation that failed while `what` ran (a plan that fit, with other buffers
    resident), in the runtime's own sentence; None for any other error."""
    message = str(error)
    if "RESOURCE_EXHAUSTED" not in message:
        return None
    sentence = next((line.strip() for line in message.splitlines() if "not possible" in line), message.splitlines()[-1])
    return OutOfMemory(f"out of memory on the device while {what}: {sentence}")


def planned_bytes(cfg, trainer):
    """{part: bytes} one device of the mesh needs at least for a train step, from shapes alone: its shards of
    the params and of the optimizer state (with the key and routing bias), gradients the size of its
    params, and the activations every remat policy keeps, the input of each of its stage's layers for all
    of its replica's sequences of a micro-step (the schedule holds every micro-batch's until the backward)."""
    state = trainer.abstract_state
    on_device = lambda tree: sum(measure.shard_bytes(a) for a in jax.tree.leaves(tree))
    m, pp = cfg.model, cfg.run.dims.pp
    layers = m.blocks * m.layers_per_block // pp + m.first_k_dense
    return {"params": on_device(state["params"]),
            "optimizer state": on_device({k: v for k, v in state.items() if k != "params"}),
            "gradients": on_device(state["params"]),
            "activations": cfg.run.train_batch_size * m.T * m.model_dimension * RESIDUAL_BYTES * layers}


class DeviceMemory(NamedTuple):
    """The memory this process's devices of a mesh have: `bytes` shared by `sharing` devices (an accelerator's
    own: its bytes, sharing 1; CPU devices: the host's available bytes, sharing all of them), in `words`."""
    bytes: int
    sharing: int
    words: str

    @property
    def gib_each(self):
        """GiB a device has: its own, or its share of the host's."""
        return self.bytes / self.sharing / GiB


def device_memory(mesh):
    """The DeviceMemory this process's devices of the mesh have. An accelerator's own (bytes per device,
    sharing 1); CPU devices share the host's memory (bytes available now, sharing all of them). None where this
    process holds none of the mesh's devices or its runtime does not say (the run goes ahead unchecked rather
    than be measured against the wrong memory)."""
    local = [d for d in mesh.devices.flat if d.process_index == jax.process_index()]
    if not local:
        return None
    if local[0].platform != "cpu":
        limits = [_bytes_limit(d) for d in local]
        if not all(limits):
            return None
        return DeviceMemory(min(limits), 1, f"the {local[0].device_kind} devices have {min(limits) / GiB:.1f} GiB each")
    available = psutil.virtual_memory().available
    sharing = f"the {len(local)} CPU devices share" if len(local) > 1 else "the CPU device has"
    return DeviceMemory(available, len(local), f"{sharing} {available / GiB:.1f} GiB of available host memory")


def _bytes_limit(device):
    try:
        return (device.memory_stats() or {}).get("bytes_limit")
    except Exception:           # noqa: BLE001 - not implemented on some backends (bench.peak_memory)
        return None


def _refusal(cfg, trainer, state_only=False):
    """The line refusing cfg on this process's devices, or None when its plan (state_only: less the activations)
    fits."""
    mesh = trainer.data_sharding.mesh
    memory = device_memory(mesh)
    plan = {part: size for part, size in planned_bytes(cfg, trainer).items() if not state_only or part != "activations"}
    if memory is None or sum(plan.values()) * memory.sharing <= memory.bytes:
        return None
    sharing = memory.sharing
    n_mesh = cfg.run.dims.n_devices
    target = utils.PRESET_SLICES.get(cfg.preset) or next((t.name for t in hardware.tpu_slices() if t.chips == n_mesh),
                                                         "SLICE")
    smaller = _presets_that_fit(cfg, mesh, memory)
    return (f"this run (--preset {cfg.preset}) needs at least {sum(plan.values()) / GiB:.2f} GiB per device ("
            + ", ".join(f"{part} {size / GiB:.2f}" for part, size in plan.items())
            + (" GiB: the layer inputs the backward keeps)" if "activations" in plan else " GiB)")
            + (f", {sum(plan.values()) * sharing / GiB:.1f} GiB in all, and " if sharing > 1 else " and ") + memory.words
            + f"; check a slice with --compile_for {target}, pick a smaller model"
            + (f" (--preset {' or '.join(smaller)})" if smaller else "") + " or pass --force to try anyway")


def _presets_that_fit(cfg, mesh, memory):
    """The presets, smallest first, with fewer params than cfg whose plan on this mesh takes at most half of
    the DeviceMemory `memory`: the plan is a lower bound (compiled steps have needed 2-10x it), and a preset
    named here should run."""
    total = sharding.count_params(cfg.model)["total"]
    fit = []
    for name, preset in sorted(utils.PRESETS.items(), key=lambda kv: sharding.count_params(kv[1].model)["total"]):
        candidate = utils.override(preset, n_device_axis=cfg.run.dims.shape)
        try:
            utils.validate(candidate, mesh.size)
        except utils.ConfigError:
            continue
        if sharding.count_params(preset.model)["total"] >= total:
            continue
        if 2 * sum(planned_bytes(candidate, build_trainer(candidate, mesh)).values()) * memory.sharing <= memory.bytes:
            fit.append(name)
    return fit
