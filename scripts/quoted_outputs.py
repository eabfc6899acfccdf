"""The commands' outputs that docs/ quotes, regenerated from the tree, so that a quote cannot drift from
what the command prints.

A quoted output is a fenced block right after a marker line:

    <!-- output of: python main.py --preset moe1B --compile_for v4-64 -->

The block holds `$ COMMAND` and then what the command printed (stdout and stderr as a terminal shows
them). Tags after the command, in brackets, say how to compare:

    [numbers vary]   the wording is held, every number masked (a training run's losses and speeds move
                     between machines); without it every number is held but a time in seconds
    [tested]         cheap (seconds): tests/test_docs.py runs the check on it
    [from TEXT]      the quote starts at the first line that starts with TEXT
    [samples]        of the samples a training run prints, the first and the last are quoted

Each command runs in an empty temporary directory (a run's files land there, not in the checkout), with
`python X.py` meaning this interpreter and the checkout's X.py.

    python scripts/quoted_outputs.py --check [FILE.md ...]    # exit 1 with a diff where a quote drifted
    python scripts/quoted_outputs.py --write [FILE.md ...]    # rewrite the quotes (takes minutes)
    python scripts/quoted_outputs.py --list                   # every quoted command, with its tags
"""
import argparse
import difflib
import glob
import os
import re
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MARKER = re.compile(r"^<!-- output of: (?P<command>.+?)(?P<tags>(?: \[[^\]]+\])*) -->$")
TAG = re.compile(r"\[([^\]]+)\]")
# a time in seconds (compile times, a run's duration) moves with the machine's load
SECONDS = re.compile(r"\b\d+(\.\d+)? s\b")
NUMBER = re.compile(r"\d[\d,]*(\.\d+)?(e[+-]?\d+)?")
# what a slow machine adds while it waits (planning/report.py's progress note)
PROGRESS = re.compile(r"^\s*\.\.\. still compiling ")


class Quote:
    """One marked block of `path`: its command, tags and the lines between its fences (`start`, `end`:
    the indices of the fence lines)."""

    def __init__(self, path, lines, marker_at):
        m = MARKER.match(lines[marker_at])
        self.path, self.command = path, m.group("command")
        self.tags = TAG.findall(m.group("tags"))
        self.start = marker_at + 1
        if not lines[self.start].startswith("```"):
            raise SystemExit(f"{path}:{marker_at + 1}: an output marker must be followed by a fenced block")
        self.end = next((i for i in range(self.start + 1, len(lines)) if lines[i].startswith("```")), None)
        if self.end is None:
            raise SystemExit(f"{path}:{self.start + 1}: the fenced block never closes")
        self.quoted = lines[self.start + 1:self.end]

    def where(self):
        return f"{os.path.relpath(self.path, ROOT)}:{self.start}"

    def from_text(self):
        return next((t[len("from "):] for t in self.tags if t.startswith("from ")), None)

    def run(self):
        """`$ COMMAND` and the output lines this quote keeps."""
        argv = shlex.split(self.command)
        if argv[0] == "python":
            script = os.path.join(ROOT, argv[1])
            argv = [sys.executable, *([script] if os.path.exists(script) else [argv[1]]), *argv[2:]]
        with tempfile.TemporaryDirectory() as work:
            proc = subprocess.run(argv, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                  env=dict(os.environ, PYTHONPATH=ROOT))
        lines = [line.rstrip() for line in proc.stdout.splitlines() if not PROGRESS.match(line)]
        start = self.from_text()
        if start is not None:
            lines = lines[next((i for i, line in enumerate(lines) if line.startswith(start)), 0):]
        if "samples" in self.tags:
            lines = first_and_last_sample(lines)
        return [f"$ {self.command}", *lines]

    def masked(self, lines):
        pattern = NUMBER if "numbers vary" in self.tags else SECONDS
        return [pattern.sub(lambda m: NUMBER.sub("N", m.group()), line) for line in lines]


def first_and_last_sample(lines):
    """A training run's output without the samples between its first and its last: a sample is a
    `sample @ STEP:` line and the text after it, up to the next line the loop prints."""
    loop_line = re.compile(r"^(step |task @|sample @|goodput |final:|WARNING|warning)")
    samples, i = [], 0
    while i < len(lines):
        if lines[i].startswith("sample @"):
            j = i + 1
            while j < len(lines) and not loop_line.match(lines[j]):
                j += 1
            samples.append((i, j))
            i = j
        else:
            i += 1
    drop = {k for a, b in samples[1:-1] for k in range(a, b)}
    return [line for k, line in enumerate(lines) if k not in drop]


def quotes(paths):
    for path in paths:
        with open(path) as f:
            lines = f.read().split("\n")
        for i, line in enumerate(lines):
            if MARKER.match(line):
                yield Quote(path, lines, i)


def drift(quote, fresh):
    """The unified diff between the quote and the fresh output, both masked; empty when they agree."""
    return "\n".join(difflib.unified_diff(quote.masked(quote.quoted), quote.masked(fresh), quote.where(),
                                          "the command now", lineterm="", n=1))


def write(path, fresh_by_start):
    with open(path) as f:
        lines = f.read().split("\n")
    for start, (end, fresh) in sorted(fresh_by_start.items(), reverse=True):
        lines[start + 1:end] = fresh
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write("\n".join(lines))
    os.replace(tmp, path)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = p.add_mutually_exclusive_group(required=True)
    mode.add_argument("--check", action="store_true", help="rerun each quoted command; exit 1 where a quote drifted")
    mode.add_argument("--write", action="store_true", help="rerun each quoted command and rewrite its quote")
    mode.add_argument("--list", action="store_true", help="list the quoted commands")
    p.add_argument("--tested", action="store_true", help="only the quotes tagged [tested]")
    p.add_argument("files", nargs="*", help="markdown files (default: README.md and docs/*.md)")
    a = p.parse_args(argv)
    files = [os.path.abspath(f) for f in a.files] or [os.path.join(ROOT, "README.md"),
                                                       *sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))]
    selected = [q for q in quotes(files) if not a.tested or "tested" in q.tags]
    drifted, rewrites = 0, {}
    for q in selected:
        if a.list:
            print(f"{q.where()}: {q.command}" + "".join(f" [{t}]" for t in q.tags))
            continue
        fresh = q.run()
        if a.write:
            rewrites.setdefault(q.path, {})[q.start] = (q.end, fresh)
            print(f"{q.where()}: {q.command}: {len(fresh)} lines")
            continue
        diff = drift(q, fresh)
        drifted += bool(diff)
        print(diff or f"{q.where()}: {q.command}: as quoted")
    for path, fresh_by_start in rewrites.items():
        write(path, fresh_by_start)
    if drifted:
        print(f"{drifted} of {len(selected)} quoted outputs drifted: python scripts/quoted_outputs.py --write")
    return 1 if drifted else 0


if __name__ == "__main__":
    sys.exit(main())
