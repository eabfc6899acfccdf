"""The H200 step-time estimate of `--compile_for h200` (planning/report.py): every kernel of the compiled step
at the roofline of an H200's rates (`hlo.kernel_census`), then a factor per class of kernel and a time per
kernel (or per step) calibrated by least squares to steps timed on an H200. The timed runs are in
H200_CALIBRATION, which scripts/refit_estimate.py writes (docs/performance-log.md#2026-12-03-h200-estimate-band):

    step = sum over classes of factor x roofline seconds + overhead

The point estimate is one calibration's; the band spans every form calibrated on all runs and with each run
held out in turn (`estimate`). The training run never imports this (tests/test_layout.py)."""
import json
import os
from typing import NamedTuple

import numpy as np

import hardware

GPU_GEMM_FLOPS = 779e12             # bf16 GEMM FLOP/s measured on an H200 (8192^3): the roofline's rate, not MFU's peak
H200_CALIBRATION = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts",
                                "h200_calibration.json")


# The forms calibrated to timed steps: which classes of kernel share a factor, and whether the time beside the
# kernels' grows with their number or is the same every step. The steps timed on 2026-11-30 all had about
# 12k kernels, so their times cannot tell those two apart, and today's programs have far fewer: the band
# spans both. A timed run's per-kernel times (scripts/gpu_bench.sh) give the factors directly ("kernel times").
FORMS = {
    "one factor, per kernel": ((("gemm", "attention", "memory"),), "per_kernel"),
    "one factor, per step": ((("gemm", "attention", "memory"),), "per_step"),
    "GEMMs apart, per kernel": ((("gemm",), ("attention", "memory")), "per_kernel"),
    "per class, per kernel": ((("gemm",), ("attention",), ("memory",)), "per_kernel"),
    "per class, per step": ((("gemm",), ("attention",), ("memory",)), "per_step"),
}
POINT_FORMS = ("kernel times", "per class, per kernel")     # the point estimate's, the first the runs allow
CLASSES = ("gemm", "attention", "memory")


def class_seconds(census):
    """Roofline seconds of a census by the classes the estimate calibrates; collectives (not calibrated: no
    timed run had any) with the memory-bound kernels."""
    c = census["classes"]
    return {"gemm": c["gemm"]["roofline_s"], "attention": c["attention"]["roofline_s"],
            "memory": c["memory"]["roofline_s"] + c["collective"]["roofline_s"]}


def load_calibration(path=H200_CALIBRATION):
    """The calibration file: {"rates", "runs": the timed steps}; ValueError where its runs were costed at other
    rates than these."""
    with open(path) as f:
        calibration = json.load(f)
    if calibration["rates"] != {"gemm_flops": GPU_GEMM_FLOPS, "hbm_bandwidth": hardware.GpuTarget("h200", 1).hbm_bandwidth}:
        raise ValueError(f"its runs were costed at other rates ({calibration['rates']}): run scripts/refit_estimate.py")
    return calibration


def calibrated_on(calibration):
    """What a calibration file's runs are, in one line."""
    runs = calibration["runs"]
    by_source = {}
    for r in runs:
        by_source.setdefault((r["tree"], r["timed"], r["source"]), []).append(r["name"])
    return "; ".join(f"{len(names)} steps timed on an H200 on {timed} at {tree} ({', '.join(names)}), costed on "
                     f"the {source}" for (tree, timed, source), names in by_source.items())


def least_squares(runs, form):
    """The factors and overhead of one of FORMS that minimise the squared relative errors of the runs'
    step times: {"form", "factors": {class: f}, "per_kernel" or "per_step": seconds}. A factor of GEMMs
    or attention is at least 1 (nothing multiplies faster than the measured GEMM rate); memory's and the
    overhead at least 0 (bytes counted can be found in the L2 cache)."""
    from scipy.optimize import lsq_linear
    groups, overhead = FORMS[form]
    X = np.array([[sum(r["roofline_s"][c] for c in g) for g in groups] + [r["kernels"] if overhead == "per_kernel" else 1.0]
                  for r in runs])
    y = np.array([r["step_s"] for r in runs])
    lower = [1.0 if set(g) & {"gemm", "attention"} else 0.0 for g in groups] + [0.0]
    x = lsq_linear(X / y[:, None], np.ones(len(y)), bounds=(lower, np.inf)).x
    return {"form": form, "factors": {c: float(f) for g, f in zip(groups, x) for c in g}, overhead: float(x[-1])}


def kernel_time_factors(runs):
    """The factors straight from runs with per-kernel times: each class's measured time over its roofline
    time, and the step's time outside the kernels matched to the census (launch gaps, copies, host syncs)
    per kernel."""
    return {"form": "kernel times",
            "factors": {c: sum(r["kernel_s"][c] for r in runs) / sum(r["roofline_s"][c] for r in runs) for c in CLASSES},
            "per_kernel": max(0.0, sum(r["step_s"] - sum(r["kernel_s"].values()) for r in runs) / sum(r["kernels"] for r in runs))}


def _subsets(runs, parameters):
    """(None, runs) where the runs are at least as many as a form's parameters, then (name, the other runs)
    for each run while more runs than parameters remain."""
    if len(runs) >= parameters:
        yield None, runs
    if len(runs) - 1 > parameters:
        for i, r in enumerate(runs):
            yield r["name"], runs[:i] + runs[i + 1:]


def calibrations(runs):
    """Every calibration the band is made of: each form's least squares on all runs and with each run held
    out in turn, and the kernel-times factors where runs have kernel times."""
    solved = [least_squares(subset, form) | {"held_out": held_out} for form, (groups, _) in FORMS.items()
              for held_out, subset in _subsets(runs, len(groups) + 1)]
    timed = [r for r in runs if r.get("kernel_s") and all(r["roofline_s"][c] for c in CLASSES)]
    return solved + [kernel_time_factors(subset) | {"held_out": held_out} for held_out, subset in _subsets(timed, 1)]


def predict(calibration, seconds, kernels):
    """The step seconds one calibration gives a program of these class roofline seconds and kernels."""
    return (sum(calibration["factors"][c] * seconds[c] for c in CLASSES)
            + calibration.get("per_kernel", 0.0) * kernels + calibration.get("per_step", 0.0))


class Estimate(NamedTuple):
    """Step seconds: the point, the band's low and high, the calibration the point comes from and every
    calibration of the band."""
    seconds: float
    low: float
    high: float
    calibration: dict
    band: list


def estimate(seconds, kernels, runs):
    """The Estimate for a program of these class roofline seconds and kernels."""
    band = calibrations(runs)
    point = next(c for form in POINT_FORMS for c in band if c["form"] == form and c["held_out"] is None)
    predictions = [predict(c, seconds, kernels) for c in band]
    return Estimate(predict(point, seconds, kernels), min(predictions), max(predictions), point, band)

