"""docs/launch.md's slice table: the largest of the moe10B family (the preset widened by routed experts, every
other flag the preset's) whose train step fits each TPU slice at the guide's global batch (256 sequences of
1024 a step, 8 sequences a replica a pass, --grad_step making up the rest), found by compiling it for the
slice with libtpu's ahead-of-time compiler (planning/measure.py's train_plan, as `--compile_for` does;
requirements-tpu.txt).

    python scripts/slice_table.py            # print the table (a binary search: ~4 compiles a slice, minutes each)
    python scripts/slice_table.py --write    # and put it in docs/launch.md between its markers
"""
import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import hardware  # noqa: E402
import sharding  # noqa: E402
import utils  # noqa: E402
from planning import measure  # noqa: E402

DOC = os.path.join(ROOT, "docs", "launch.md")
BEGIN, END = "<!-- slice table: python scripts/slice_table.py --write -->", "<!-- end of the slice table -->"
SLICES = ("v4-32", "v4-64", "v4-128")
EXPERTS = (8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 256)
GLOBAL_BATCH, PER_PASS = 256, 8         # sequences a step; sequences a replica a pass


def family(n_experts, slice_name):
    """moe10B with n_experts routed experts on the slice's mesh (dp, 2, 2), at the guide's global batch."""
    dp = hardware.tpu_slice(slice_name).chips // 4
    return utils.override(utils.PRESETS["moe10B"], n_experts=n_experts, n_device_axis=(dp, 2, 2),
                          train_batch_size=PER_PASS, grad_step=GLOBAL_BATCH // (dp * PER_PASS))


def plan(n_experts, slice_name):
    """(GiB a chip, FLOPs over the model's) of the family member's train step on the slice; None: invalid there."""
    cfg, target = family(n_experts, slice_name), hardware.tpu_slice(slice_name)
    try:
        utils.validate(cfg, target.chips)
    except utils.ConfigError:
        return None
    plan = measure.train_plan(cfg, measure.target_mesh(cfg, target))
    gib, ratio = plan.gib, plan.flops_ratio
    print(f"  {slice_name} {n_experts} experts: {gib:.2f} GiB" + (f", FLOPs {ratio:.2f}x" if ratio else ""),
          file=sys.stderr, flush=True)
    return gib, ratio


def largest_that_fits(slice_name):
    """(largest fitting expert count or None, its plan, the next count, its plan), by binary search over EXPERTS
    (a plan grows with the experts)."""
    usable = hardware.tpu_slice(slice_name).hbm_bytes / measure.GiB
    plans = {}

    def fits(i):
        if i not in plans:
            plans[i] = plan(EXPERTS[i], slice_name)
        return plans[i] is not None and plans[i][0] <= usable
    low, high = -1, len(EXPERTS)          # EXPERTS[low] fits (or none), EXPERTS[high] does not (or beyond)
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if fits(mid) else (low, mid)
    at = lambda i: (EXPERTS[i], plans.get(i)) if 0 <= i < len(EXPERTS) else (None, None)
    if 0 <= high < len(EXPERTS) and high not in plans:
        fits(high)
    return (*at(low), *at(high))


def row(slice_name):
    target = hardware.tpu_slice(slice_name)
    dp = target.chips // 4
    experts, fit, following, over = largest_that_fits(slice_name)
    params = lambda e: sharding.count_params(family(e, slice_name).model)["total"] / 1e9
    mesh = f"({dp}, 2, 2), {PER_PASS} x {GLOBAL_BATCH // (dp * PER_PASS)} passes"
    largest = "none" if experts is None else f"{experts} experts: {params(experts):.2f}B"
    planned = "—" if fit is None else f"{fit[0]:.2f} GiB, {fit[1]:.2f}x"
    after = "—" if following is None else (f"{following} experts ({params(following):.2f}B): "
                                           + ("not valid on this mesh" if over is None else f"{over[0]:.2f} GiB"))
    return f"| {slice_name} ({target.chips}) | {mesh} | {largest} | {planned} | {after} |"


def table():
    lines = ["| slice (chips) | mesh, sequences a replica x passes | largest that fits | plan a chip, FLOPs / model's "
             "| the next size |", "|---|---|---|---|---|"]
    return "\n".join(lines + [row(s) for s in SLICES])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--write", action="store_true", help=f"put the table in {os.path.relpath(DOC, ROOT)}")
    args = parser.parse_args()
    measure.compile_only_libtpu(hardware.tpu_slice(SLICES[0]))
    text = table()
    print(text)
    if args.write:
        doc = open(DOC).read()
        start, end = doc.index(BEGIN) + len(BEGIN), doc.index(END)
        written = doc[:start] + "\n" + text + "\n" + doc[end:]
        with open(DOC + ".tmp", "w") as f:
            f.write(written)
        os.replace(DOC + ".tmp", DOC)


if __name__ == "__main__":
    main()
