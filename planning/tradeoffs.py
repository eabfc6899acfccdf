"""What makes a plan fit: the few settings that trade compute for memory, each compiled, and the cheapest in
compiled FLOPs that fits (`cheapest_fit`). `--compile_for` prints it with the exact command when a plan does
not fit; `--fit` runs (or rehearses) with it. Pure config logic: the caller compiles (`plan` below is
planning/measure.py's compile of the train step for a slice, or of this run's mesh).

The settings that save memory, one change each (`memory_changes`):
  --remat full                           every layer recomputed in the backward (one more forward's FLOPs)
  --train_batch_size B/N --grad_step N   the same global batch in N passes, each keeping 1/N of the activations
  --micro_batch_size 2M                  smaller micro-batches: less of the pipeline's bubble, smaller buffers (pp > 1)
  --expert_parallel                      each dp rank keeps E/dp whole experts instead of gathering them all (dp > 1)
  --fsdp_gather tick                     a stage's weights gathered at each tick, not held for the step
and the one that saves compute (`compute_changes`): --remat dots where the config recomputes whole layers,
worth compiling only beside one that saves memory (--grad_step's passes pay for keeping the products).
"""
import itertools
from typing import Callable, NamedTuple

import utils

GRAD_STEP_FACTORS = (2, 4)


class Plan(NamedTuple):
    """One compiled setting: its flag changes ({} as given), the config, its train step's GiB per chip, compiled
    FLOPs over the model's and collective GiB per chip (None: the compiler refused it, saying at most what it
    needs), and what the caller's compile returned beside them (measure.StepPlan's trainer)."""
    changes: dict
    cfg: object
    gib: float | None
    flops_ratio: float | None
    collective_gib: float | None
    trainer: object

    def fits(self, budget_gib):
        return self.gib is not None and self.gib <= budget_gib


def memory_changes(cfg):
    """The single changes that trade compute (or collective bytes) for memory and that cfg does not have
    already: [{flag: value}]. Validity on the mesh is checked by the caller (utils.validate)."""
    m, r, o = cfg.model, cfg.run, cfg.optim
    dims = r.dims
    found = []
    if m.remat != "full":
        found.append({"remat": "full"})
    for n in GRAD_STEP_FACTORS:
        if r.train_batch_size % (n * r.micro_batch_size) == 0:
            found.append({"train_batch_size": r.train_batch_size // n, "grad_step": o.grad_step * n})
    if dims.pp > 1 and r.train_batch_size % (2 * r.micro_batch_size) == 0:  # one stage keeps every micro-batch's values
        found.append({"micro_batch_size": 2 * r.micro_batch_size})
    if dims.dp > 1 and m.n_experts and not m.expert_parallel:                # a lone dp rank holds every expert anyway
        found.append({"expert_parallel": True})
    if m.fsdp_gather == "step" and dims.fsdp_per_slice > 1:
        found.append({"fsdp_gather": "tick"})
    return found


def compute_changes(cfg):
    """The changes that save compute for memory: [{flag: value}]."""
    return [{"remat": "dots"}] if cfg.model.remat == "full" else []


def candidates(cfg, n_devices):
    """The settings to compile, in the order tried, as groups of [(changes, cfg)], each valid for cfg on
    n_devices: the single memory changes; each of them with a compute change (cheaper when it fits); two
    memory changes together (`cheapest_fit` compiles these only when nothing before fits). A pair never
    changes one flag twice (--grad_step 2 and 4 are alternatives, not a product)."""
    def valid(change):
        candidate = utils.override(cfg, **change)
        try:
            utils.validate(candidate, n_devices)
        except utils.ConfigError:
            return None
        return change, candidate

    def group(changes):
        return [c for c in map(valid, changes) if c]
    singles = memory_changes(cfg)
    disjoint = lambda pairs: [a | b for a, b in pairs if not a.keys() & b.keys()]
    return (group(singles), group(disjoint(itertools.product(compute_changes(cfg), singles))),
            group(disjoint(itertools.combinations(singles, 2))))


def cheapest_fit(cfg, n_devices, budget_gib, plan: Callable, say=print):
    """(the Plan chosen or None, every Plan compiled): the groups of `candidates` compiled in turn, the last
    (two memory changes) only when nothing before fits; of those that fit, the cheapest (`cost`). plan(cfg) ->
    a measure.StepPlan (GiB, compiled FLOPs over the model's, collective GiB, the compiled trainer); say(line)
    reports each as it is compiled."""
    singles, with_compute, pairs = candidates(cfg, n_devices)
    compiled = []
    for group in (singles + with_compute, pairs):
        for change, candidate in group:
            compiled.append(Plan(change, candidate, **plan(candidate)._asdict()))
            say(setting_line(compiled[-1], budget_gib))
        fitting = [p for p in compiled if p.fits(budget_gib)]
        if fitting:
            return min(fitting, key=cost), compiled
    return None, compiled


def cost(p):
    """What the choice minimises: compiled FLOPs (to 1%: closer than that is noise against the step's other
    costs), then collective bytes (to a GiB: another pass or gathering at every tick moves more), then memory."""
    return round(p.flops_ratio or float("inf"), 2), round(p.collective_gib or float("inf")), p.gib


def flags(change):
    """A change as command-line flags, in the CLI's spelling: {"grad_step": 2} -> "--grad_step 2"."""
    value = lambda v: str(v).lower() if isinstance(v, bool) else str(v)
    return " ".join(f"--{name} {value(v)}" for name, v in change.items())


def setting_line(p, budget_gib):
    """One compiled setting in a line: its flags, GiB a chip, whether that fits, its FLOPs and collectives."""
    verdict = "the compiler refused it" if p.gib is None else f"{p.gib:6.2f} GiB {'fits' if p.fits(budget_gib) else 'over'}"
    return f"  {flags(p.changes):<44} {verdict}" + (
        f", FLOPs {p.flops_ratio:.2f}x the model's, collectives {p.collective_gib:.2f} GiB" if p.flops_ratio else "")


def command(argv, change, program="python main.py"):
    """The command line argv with change applied: each changed flag's old occurrence removed (`--f v`, `--f=v`,
    or a bare boolean `--f`), the new values appended."""
    kept, skip = [], False
    words = list(argv)
    for i, word in enumerate(words):
        if skip:
            skip = False
            continue
        name = word[2:].split("=")[0] if word.startswith("--") else None
        if name in change:
            has_value = "=" not in word and i + 1 < len(words) and not words[i + 1].startswith("--")
            skip = has_value
            continue
        kept.append(word)
    return " ".join([program, *map(_quoted, kept), flags(change)]).strip()


def _quoted(word):
    return word if word and all(c.isalnum() or c in "-_=./,:" for c in word) else "'" + word.replace("'", "'\\''") + "'"
