"""Refit the H200 estimate (`--compile_for h200`) on steps timed on an H200, and say how well each form fits.

  python scripts/refit_estimate.py SOURCE [SOURCE ...] [--write [PATH]]

A SOURCE is scripts/gpu_bench.sh's archive (gpu_bench.tar.gz) or a directory of runs: for each run NAME,
NAME.json (bench.py's JSON line, or scripts/compile_h200.py's record) with the measured step_time_median_s,
NAME.hlo.txt (the train step's optimized HLO) and, where the run was profiled, NAME.kernels.json (bench.py
--profile: each kernel's time per step by the HLO instruction it ran). Each run's HLO goes through the
kernel census (hlo.kernel_census); its roofline seconds by class of kernel, its kernel count and, with
kernel times, each class's measured seconds are the calibration's data. The script prints every run
against every calibration of step_time.FORMS (and the kernel-times factors), and with --write stores the runs
where planning/step_time.py reads them (default step_time.H200_CALIBRATION), so that `--compile_for h200`
estimates from them.
"""
import argparse
import json
import os
import re
import sys
import tarfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hardware  # noqa: E402
import hlo  # noqa: E402
from planning import step_time  # noqa: E402


def read_source(source):
    """{file name: text} of a directory or a .tar.gz archive (its files at any depth, by base name)."""
    if os.path.isdir(source):
        return {name: open(os.path.join(source, name)).read() for name in os.listdir(source)
                if os.path.isfile(os.path.join(source, name))}
    with tarfile.open(source) as archive:
        return {os.path.basename(m.name): archive.extractfile(m).read().decode() for m in archive.getmembers() if m.isfile()}


def _key(name):
    """An HLO instruction's name as a kernel may carry it: XLA names a fusion's kernel after the
    instruction, with '_' for '.' and '-'."""
    return re.sub(r"[.\-]", "_", name)


# Library kernels by their names, for a kernel whose trace event names no HLO instruction (a kernel launched
# inside a CUDA graph can lose its annotation): cuDNN's attention, then cuBLAS's and CUTLASS's GEMMs.
LIBRARY_KERNELS = (("attention", ("fmha", "sdpa", "flash")), ("gemm", ("gemm", "nvjet", "xmma", "cutlass")))


def kernel_seconds(census, kernels):
    """({class: measured seconds per step}, unmatched seconds per step) of a run's kernel times, each joined to
    its census row by HLO instruction (the trace's hlo_op, else the kernel's own name), else classed by a
    library kernel's name (LIBRARY_KERNELS); what neither places is unmatched (copies, host syncs)."""
    by_key = {_key(name): row["class"] for name, row in census["by_name"].items()}
    measured, unmatched = {c: 0.0 for c in step_time.CLASSES}, 0.0
    for k in kernels["kernels"]:
        cls = (by_key.get(_key(k.get("hlo_op") or "")) or by_key.get(_key(k["name"]))
               or next((c for c, words in LIBRARY_KERNELS if any(w in k["name"].lower() for w in words)), None))
        if cls is None:
            unmatched += k["ms_per_step"] / 1e3
        else:
            measured["memory" if cls == "collective" else cls] += k["ms_per_step"] / 1e3
    return measured, unmatched


def runs_of(source):
    """The calibration rows of every run in `source` with a step time and an HLO."""
    files = read_source(source)
    meta = json.loads(files.get("meta.json", "{}"))
    rows = []
    for name in sorted(n[:-len(".hlo.txt")] for n in files if n.endswith(".hlo.txt")):
        lines = [line for line in files.get(name + ".json", "").splitlines() if line.startswith("{")]
        record = json.loads(lines[-1]) if lines else {}
        if not record.get("step_time_median_s"):
            print(f"{source}: {name} has no measured step time; skipped", file=sys.stderr)
            continue
        census = hlo.kernel_census(files[name + ".hlo.txt"], step_time.GPU_GEMM_FLOPS, hardware.GpuTarget("h200", 1).hbm_bandwidth)
        row = {"name": name, "tree": record.get("tree") or meta.get("commit", "?"),
               "timed": record.get("timed") or meta.get("date", "?"),
               "source": record.get("source") or "HLO the GPU compiled (autotuned)",
               "flags": " ".join([f"{k}={v}" for k, v in record.get("env", {}).items()] + record["flags"]) if "flags" in record
               else meta.get("flags", {}).get(name), "step_s": record["step_time_median_s"],
               "kernels": census["kernels"], "roofline_s": step_time.class_seconds(census)}
        if name + ".kernels.json" in files:
            row["kernel_s"], row["unmatched_s"] = kernel_seconds(census, json.loads(files[name + ".kernels.json"]))
        rows.append(row)
    return rows


def print_report(runs, fits, stored=None, out=sys.stdout):
    """Each run's roofline by class and its step as each fit on every run predicts it (and the band the
    stored calibration gives it); then each fit's factors and how far off it was on the runs it did not see."""
    whole = [f for f in fits if f["held_out"] is None]
    print(f"{'run':<20} {'step ms':>8} {'kernels':>8} {'GEMMs':>7} {'attn':>6} {'memory':>7}  (roofline ms)  predicted by: "
          + " | ".join(f["form"] for f in whole), file=out)
    for r in runs:
        s = r["roofline_s"]
        predicted = [step_time.predict(f, s, r["kernels"]) for f in whole]
        print(f"{r['name']:<20} {r['step_s'] * 1e3:8.1f} {r['kernels']:8,} {s['gemm'] * 1e3:7.1f} {s['attention'] * 1e3:6.1f} "
              f"{s['memory'] * 1e3:7.1f}  " + " | ".join(f"{p * 1e3:.1f} ({100 * (p / r['step_s'] - 1):+.1f}%)" for p in predicted),
              file=out)
        if stored:
            point, low, high, _, _ = step_time.estimate(s, r["kernels"], stored["runs"])
            print(f"  the stored calibration's estimate: {point * 1e3:.1f} ms, band {low * 1e3:.1f}-{high * 1e3:.1f} ms: the "
                  f"measured step is {'inside' if low <= r['step_s'] <= high else 'OUTSIDE'} it", file=out)
        if r.get("kernel_s"):
            k = r["kernel_s"]
            print("  kernel times: " + ", ".join(f"{c} {k[c] * 1e3:.1f} ms (x {k[c] / s[c]:.3g})" for c in step_time.CLASSES if s[c])
                  + f"; not in the census {r['unmatched_s'] * 1e3:.1f} ms; outside the census's kernels "
                  f"{(r['step_s'] - sum(k.values())) * 1e3:.1f} ms", file=out)
    print("fits on every run: GEMMs, attention, memory-bound factors; overhead; worst error on a held-out run", file=out)
    for f in whole:
        overhead = f"{f['per_kernel'] * 1e6:.3g} µs per kernel" if "per_kernel" in f else f"{f['per_step'] * 1e3:.3g} ms per step"
        errors = [abs(step_time.predict(g, r["roofline_s"], r["kernels"]) / r["step_s"] - 1)
                  for g in fits if g["form"] == f["form"] and g["held_out"] for r in runs if r["name"] == g["held_out"]]
        print(f"  {f['form']:<24} x {f['factors']['gemm']:.3g}, x {f['factors']['attention']:.3g}, "
              f"x {f['factors']['memory']:.3g}; {overhead}" + (f"; {100 * max(errors):.1f}%" if errors else ""), file=out)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("sources", nargs="+", help="gpu_bench.tar.gz archives or directories of runs")
    parser.add_argument("--write", nargs="?", const=step_time.H200_CALIBRATION, metavar="PATH",
                        help=f"store the runs as the estimate's calibration (default path: {step_time.H200_CALIBRATION})")
    parser.add_argument("--against", default=step_time.H200_CALIBRATION, metavar="PATH",
                        help="the calibration to hold the runs against (default: the stored one); '' for none")
    args = parser.parse_args(argv)
    runs = [r for source in args.sources for r in runs_of(source)]
    if not runs:
        sys.exit("no run with a measured step time and an HLO in " + ", ".join(args.sources))
    try:
        stored = step_time.load_calibration(args.against) if args.against else None
    except (OSError, ValueError) as e:
        print(f"no calibration to hold the runs against: {e}", file=sys.stderr)
        stored = None
    fits = step_time.calibrations(runs)
    print_report(runs, fits, stored)
    if args.write:
        calibration = {"rates": {"gemm_flops": step_time.GPU_GEMM_FLOPS, "hbm_bandwidth": hardware.GpuTarget("h200", 1).hbm_bandwidth},
                       "runs": runs}
        with open(args.write, "w") as f:
            json.dump(calibration, f, indent=1)
            f.write("\n")
        print(f"wrote {args.write}: {step_time.calibrated_on(calibration)}")
    return runs, fits


if __name__ == "__main__":
    main()
