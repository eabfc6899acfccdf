"""What makes a plan fit: the few settings that trade compute for memory, each compiled, and the cheapest in
compiled FLOPs that fits (`cheapest_fit`). `--compile_for` prints it with the exact command when a plan does
not fit; `--fit` runs (or rehearses) with it. Pure config logic: the caller compiles (`plan` below is
pod.py's compile of the train step for a slice, or of this run's mesh).

The settings, one change each (`changes`); when none of them fits alone, each two of them together:
  --remat full                           every layer recomputed in the backward (one more forward's FLOPs)
  --train_batch_size B/N --grad_step N   the same global batch in N passes, each keeping 1/N of the activations
  --micro_batch_size 2M                  smaller micro-batches: less of the pipeline's bubble, smaller buffers
  --expert_parallel                      each dp rank keeps E/dp whole experts instead of gathering them all
"""
import itertools
from typing import Callable, NamedTuple

import utils

GRAD_STEP_FACTORS = (2, 4)


class Plan(NamedTuple):
    """One compiled setting: its flag changes ({} as given), GiB per chip of its train step and its compiled
    FLOPs over the model's (None: the compiler refused it without saying how much it needs), and the config."""
    changes: dict
    gib: float | None
    flops_ratio: float | None
    cfg: object

    def fits(self, budget_gib):
        return self.gib is not None and self.gib <= budget_gib


def changes(cfg):
    """The single changes that trade compute (or collective bytes) for memory and that cfg does not have
    already: [{flag: value}]. Validity on the mesh is checked by the caller (utils.validate)."""
    m, r, o = cfg.model, cfg.run, cfg.optim
    found = []
    if m.remat != "full":
        found.append({"remat": "full"})
    for n in GRAD_STEP_FACTORS:
        if r.train_batch_size % (n * r.micro_batch_size) == 0:
            found.append({"train_batch_size": r.train_batch_size // n, "grad_step": o.grad_step * n})
    if r.train_batch_size % (2 * r.micro_batch_size) == 0:
        found.append({"micro_batch_size": 2 * r.micro_batch_size})
    if m.n_experts and not m.expert_parallel:
        found.append({"expert_parallel": True})
    return found


def candidates(cfg, n_devices):
    """(the single changes, the pairs of them) valid for cfg on n_devices, each as [(changes, cfg)]. A pair
    never changes one flag twice (grad_step 2 and 4 are alternatives, not a product)."""
    def valid(change):
        candidate = utils.override(cfg, **change)
        try:
            utils.validate(candidate, n_devices)
        except utils.ConfigError:
            return None
        return change, candidate
    singles = [c for c in map(valid, changes(cfg)) if c]
    pairs = [valid(a | b) for (a, _), (b, _) in itertools.combinations(singles, 2) if not a.keys() & b.keys()]
    return singles, [p for p in pairs if p]


def cheapest_fit(cfg, n_devices, budget_gib, plan: Callable, say=print):
    """(the Plan chosen or None, every Plan compiled): the single changes are compiled first, the pairs only
    when none of them fits; of those that fit, the fewest compiled FLOPs, then the fewest passes, then the least memory (`cost`). plan(cfg) ->
    (GiB, compiled FLOPs over the model's), either None where the compiler does not say; say(line) reports each
    as it is compiled."""
    compiled = []
    for group in candidates(cfg, n_devices):
        for change, candidate in group:
            compiled.append(Plan(change, *plan(candidate), candidate))
            say(describe(compiled[-1], budget_gib))
        fitting = [p for p in compiled if p.fits(budget_gib)]
        if fitting:
            return min(fitting, key=cost), compiled
    return None, compiled


def cost(p):
    """What the choice minimises: compiled FLOPs (to 1%: closer than that is noise against the step's other
    costs), then passes over the batch (each pass gathers the weights again), then memory."""
    return round(p.flops_ratio or float("inf"), 2), p.cfg.optim.grad_step, p.gib


def flags(change):
    """A change as command-line flags, in the CLI's spelling: {"grad_step": 2} -> "--grad_step 2"."""
    value = lambda v: str(v).lower() if isinstance(v, bool) else str(v)
    return " ".join(f"--{name} {value(v)}" for name, v in change.items())


def describe(p, budget_gib):
    """One compiled setting in a line: its flags, GiB a chip, whether that fits, its FLOPs ratio."""
    verdict = "the compiler refused it" if p.gib is None else f"{p.gib:6.2f} GiB {'fits' if p.fits(budget_gib) else 'over'}"
    return f"  {flags(p.changes):<44} {verdict}" + (f", FLOPs {p.flops_ratio:.2f}x the model's" if p.flops_ratio else "")


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
