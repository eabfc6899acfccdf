"""Every code name the docs cite exists: docs/*.md and README.md, so a rename cannot leave a page behind.

What counts as a code name (conservative, so that prose never fails the test):
- an inline code span (between backticks, outside fenced blocks) that is a path ending in .py or .sh
  (`pipeline.py`, `engine/products.py`, `scripts/gpu_bench.sh`): it must exist relative to the repository
  root or to docs/;
- an inline span that is a command whose script is such a path (`python main.py --preset moe1B ...`,
  `bench.py --grad_error`, `JAXFORMER_SLOW_TESTS=1 pytest tests/test_pod.py`): the script must exist;
- an inline span of identifiers joined by dots, optionally followed by a call's parentheses, whose first
  part is a project module (`sharding.tp_sum`, `products.mm`, `engine.products.mm`, `engine.Fast.mlp`,
  `loss.summarise(...)`): the module is
  found by its path from the root (`engine.products` is engine/products.py, `engine` is
  engine/__init__.py) or by its base name among the project's Python files (top level, data/, engine/,
  evals/, planning/, scripts/, tests/), then each further part in the module's AST: a top-level def, class, assignment or
  import, then a class's members (defs, assignments in its body, `self.x = ...` in its methods). A part
  after a function or a plain value is not followed. A name whose first part is not the project's
  (`jax.lax.psum`, `optax.adamw`, `jnp.einsum`, `nnx.Param`, and class-first names such as the guide's
  `MoE.scatter` or `Transformer.run_blocks`) is not checked; nor is a dotted span whose
  last part is a file extension other than py/sh (`metrics.jsonl`, `data.md`). A first part that names a
  module since renamed (FORMER_MODULES: `experts.triton_grouped`) fails.
- a line of a fenced code block that runs a script the same way (`python scripts/refit_estimate.py ...`,
  `bash scripts/gpu_bench.sh`): the script must exist. Nothing else in fenced blocks is read (their
  Python and JSON would be noise).

And every relative link between the pages resolves: its file exists and so does its anchor, an explicit
`<a id="...">` (docs/performance-log.md's dated sections have one each) or a heading's GitHub anchor.
"""
import ast
import functools
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ceiling import CEILING_S

ROOT = Path(__file__).resolve().parent.parent
MODULE_DIRS = ("", "data", "engine", "evals", "planning", "scripts", "tests")
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]

DOTTED = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+(?:\(.*\))?")
PATH = re.compile(r"[\w./-]*\w\.(?:py|sh)")
# Modules that were renamed or moved: a name that starts with one is the old file's, not an outside library's.
FORMER_MODULES = {"experts": "engine/expert_kernels.py", "attention": "engine/attention_kernels.py",
                  "evaluate": "evals/scoring.py", "pod": "planning/ (report.py, measure.py, step_time.py)",
                  "planner": "planning/tradeoffs.py"}
OTHER_EXTENSIONS = {"md", "json", "jsonl", "gz", "txt", "toml", "yaml", "yml", "cfg", "pb", "png", "csv",
                    "html", "npy", "npz", "lock", "ini", "log", "safetensors", "tar", "zip", "xplane"}
# a command: environment assignments, an interpreter (or none), then the script
COMMAND = re.compile(r"(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:(?:\S*/)?(?:python3?(?:\.\d+)?|bash|sh|pytest)\s+)?"
                     r"(?P<script>[\w./-]*\w\.(?:py|sh))(?:\s|$)")
MODULE_COMMAND = re.compile(r"(?:[A-Z_][A-Z0-9_]*=\S*\s+)*(?:\S*/)?python3?(?:\.\d+)?\s+-m\s+(?P<module>[\w.]+)")


@functools.cache
def project_files():
    return tuple(path for folder in MODULE_DIRS for path in sorted((ROOT / folder).glob("*.py")))


@functools.cache
def modules_by_name():
    """Module name -> its files: each file's base name (a package's __init__.py: the package's name)."""
    names = {}
    for path in project_files():
        name = path.parent.name if path.name == "__init__.py" else path.stem
        names.setdefault(name, []).append(path)
    return names


@functools.cache
def tree_of(path):
    return ast.parse(path.read_text())


def _bound_names(target):
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for element in target.elts for n in _bound_names(element)]
    return []


def _statements(body):
    """A body's statements, those inside its top-level if/try/with blocks included."""
    for node in body:
        yield node
        if isinstance(node, (ast.If, ast.Try, ast.With)):
            nested = list(node.body) + list(getattr(node, "orelse", [])) + list(getattr(node, "finalbody", []))
            for handler in getattr(node, "handlers", []):
                nested += handler.body
            yield from _statements(nested)


def members(body, is_class=False):
    """Name -> its definition node (None for a plain value or an import) bound by a module's or class's body."""
    found = {}
    for node in _statements(body):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            found[node.name] = node
        elif isinstance(node, ast.Assign):
            for target in node.targets:
                found.update(dict.fromkeys(_bound_names(target)))
        elif isinstance(node, (ast.AnnAssign, ast.AugAssign)):
            found.update(dict.fromkeys(_bound_names(node.target)))
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            found.update(dict.fromkeys((alias.asname or alias.name).split(".")[0] for alias in node.names))
    if is_class:  # attributes the methods set on self
        for node in body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for inner in ast.walk(node):
                    targets = inner.targets if isinstance(inner, ast.Assign) else (
                        [inner.target] if isinstance(inner, (ast.AnnAssign, ast.AugAssign)) else [])
                    for target in targets:
                        if (isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name)
                                and target.value.id == "self"):
                            found.setdefault(target.attr, None)
    return found


def chain_exists(body, parts, is_class=False):
    """Whether the attribute chain `parts` is bound in `body` (a module's or a class's)."""
    if not parts:
        return True
    found = members(body, is_class)
    if parts[0] not in found:
        return False
    node = found[parts[0]]
    if isinstance(node, ast.ClassDef):
        return chain_exists(node.body, parts[1:], is_class=True)
    return True  # a function or a value: what follows it is not followed


def module_files(parts):
    """The files of module `parts` (a tuple of names): by its path from the root, or by its base name."""
    path = ROOT.joinpath(*parts)
    for candidate in (path.with_name(path.name + ".py"), path / "__init__.py"):
        if candidate in project_files():
            return [candidate]
    if len(parts) == 1:
        return modules_by_name().get(parts[0], [])
    return []


def dotted_problem(name):
    """None if the dotted name resolves (or is not the project's), else what is missing."""
    parts = name.split("(")[0].split(".")
    if parts[-1] in OTHER_EXTENSIONS:
        return None
    for i in range(len(parts), 0, -1):  # the longest leading part that names a module
        files = module_files(tuple(parts[:i]))
        if files:
            if any(chain_exists(tree_of(path).body, parts[i:]) for path in files):
                return None
            where = ", ".join(str(path.relative_to(ROOT)) for path in files)
            return f"{'.'.join(parts[i:])} is not defined in {where}"
    if parts[0] in FORMER_MODULES:
        return f"module {parts[0]} is now {FORMER_MODULES[parts[0]]}"
    return None  # not a project name


def path_problem(path, page_dir):
    if (ROOT / path).exists() or (page_dir / path).exists():
        return None
    return f"no file {path}"


def command_problem(line, page_dir):
    """What is wrong with a command line's script or `-m` module, or None (also when it is no command)."""
    command = COMMAND.match(line)
    if command:
        return path_problem(command["script"], page_dir)
    command = MODULE_COMMAND.match(line)
    if command:
        parts = tuple(command["module"].split("."))
        if (parts[0] in modules_by_name() or (ROOT / parts[0] / "__init__.py").is_file()) and not module_files(parts):
            return f"no module {command['module']}"
    return None


def span_problem(span, page_dir):
    """What is wrong with one inline code span, or None (also when it is not a code name)."""
    span = " ".join(span.split())
    if PATH.fullmatch(span):
        return path_problem(span, page_dir)
    if DOTTED.fullmatch(span):
        return dotted_problem(span)
    return command_problem(span, page_dir)


INLINE = re.compile(r"(?<!`)(`+)(?!`)(.+?)(?<!`)\1(?!`)", re.S)
FENCE = re.compile(r"^\s*(```|~~~)")


def code_names(text):
    """(line number, inline span) for every inline code span, and (line number, line) of fenced blocks."""
    inline, fenced = [], []
    lines = text.split("\n")
    paragraph, start, in_fence = [], 0, False

    def flush():
        joined = "\n".join(paragraph)
        for match in INLINE.finditer(joined):
            inline.append((start + joined.count("\n", 0, match.start()) + 1, match.group(2).strip()))

    for number, line in enumerate(lines):
        if FENCE.match(line):
            flush()
            paragraph, in_fence = [], not in_fence
            continue
        if in_fence:
            fenced.append((number + 1, line))
        elif line.strip():
            if not paragraph:
                start = number
            paragraph.append(line)
        else:
            flush()
            paragraph = []
    flush()
    return inline, fenced


def page_problems(page):
    """Every broken code name of a page, as 'page:line: name: what is wrong'."""
    label = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
    inline, fenced = code_names(page.read_text())
    problems = [f"{label}:{number}: `{span}`: {problem}" for number, span in inline
                if (problem := span_problem(span, page.parent))]
    problems += [f"{label}:{number}: {line.strip()}: {problem}" for number, line in fenced
                 if (problem := command_problem(line.strip(), page.parent))]
    return problems


LINK = re.compile(r"\]\((?!https?:|mailto:)(?P<path>[^)\s#]*)(?:#(?P<anchor>[^)\s]*))?\)")
EXPLICIT_ANCHOR = re.compile(r'<a id="([^"]+)"></a>')


def github_slug(heading):
    """The anchor GitHub gives a heading: lowercase, punctuation but '-' and '_' dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


@functools.cache
def anchors_of(page):
    """Every anchor a page has: explicit <a id> and its headings' (a repeated heading's get -1, -2, ...)."""
    found, seen, in_fence = set(EXPLICIT_ANCHOR.findall(page.read_text())), {}, False
    for line in page.read_text().split("\n"):
        if FENCE.match(line):
            in_fence = not in_fence
        elif not in_fence and (heading := re.match(r"#{1,6} (.*)", line)):
            slug = github_slug(heading[1])
            found.add(slug if slug not in seen else f"{slug}-{seen[slug]}")
            seen[slug] = seen.get(slug, 0) + 1
    return found


def link_problems(page):
    """Every relative link of a page whose file or anchor does not exist, as 'page:line: link: what'."""
    label = page.relative_to(ROOT) if page.is_relative_to(ROOT) else page.name
    problems, in_fence = [], False
    for number, line in enumerate(page.read_text().split("\n"), 1):
        if FENCE.match(line):
            in_fence = not in_fence
            continue
        for link in [] if in_fence else LINK.finditer(line):
            target = (page.parent / link["path"]).resolve() if link["path"] else page
            if not target.exists():
                problems.append(f"{label}:{number}: {link[0]}: no file {link['path']}")
            elif link["anchor"] and target.suffix == ".md" and link["anchor"] not in anchors_of(target):
                problems.append(f"{label}:{number}: {link[0]}: no anchor #{link['anchor']} in {target.name}")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_link_between_the_docs_resolves(page):
    problems = link_problems(page)
    assert not problems, "links to a file or anchor that does not exist:\n" + "\n".join(problems)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_code_name_in_the_docs_exists(page):
    problems = page_problems(page)
    assert not problems, "code names the page cites that do not exist:\n" + "\n".join(problems)


def test_the_checker_finds_a_missing_name_and_accepts_real_ones(tmp_path):
    docs = ROOT / "docs"
    # real: a top-level function, a submodule of the engine package by its path and by its base name, the
    # package and a class in it, a package's module, paths, commands; external names, a guide's class
    # (`MoE.scatter`: a first part that is no module is not checked) and other files
    for span in ["loss.summarise", "engine.products.mm", "products.mm", "engine", "engine.Fast",
                 "engine.engine_for", "data.tokenize_local", "engine/products.py",
                 "scripts/gpu_bench.sh", "python main.py --preset tiny", "bench.py --grad_error",
                 "python -m data.tokenize_local --resume", "loss.summarise(ce_sum, ...)",
                 "jax.lax.psum", "optax.adamw", "MoE.scatter", "metrics.jsonl", "data.md"]:
        assert span_problem(span, docs) is None, span
    # made up: a missing function, a missing member of a real class, a module's old file, a missing
    # script, a missing module run with -m
    for span in ["loss.no_such_function", "engine.Fast.no_such_method",
                 "engine/no_such_file.py", "no_such_file.py", "python no_such_script.py --flag",
                 "python -m data.no_such_module", "products.no_such_product", "experts.triton_grouped"]:
        assert span_problem(span, docs), span
    page = tmp_path / "page.md"
    page.write_text("Prose with `loss.summarise` and\n`loss.not_there`, ``a `backticked` span``.\n\n"
                    "```bash\npython not_there.py --flag\n`loss.also_not_there` in a fence is not read\n```\n")
    assert page_problems(page) == [
        "page.md:2: `loss.not_there`: not_there is not defined in loss.py",
        "page.md:5: python not_there.py --flag: no file not_there.py"], page_problems(page)


# A word left for a figure still to come: a line of one capitalised word (TOKRATE once stood in docs/data.md where
# the tokenizing rate goes), or a note to self
PLACEHOLDER = re.compile(r"^\s*[A-Z][A-Z0-9_]{3,}\s*$|\b(?:TODO|TBD|FIXME|XXX)\b")


def placeholders(page):
    """["page:line: text"] for each placeholder outside a code fence."""
    found, fenced = [], False
    for number, line in enumerate(page.read_text().splitlines(), 1):
        fenced ^= line.lstrip().startswith("```")
        if not fenced and PLACEHOLDER.search(line):
            found.append(f"{page.name}:{number}: {line.strip()}")
    return found


@pytest.mark.parametrize("page", PAGES + [ROOT / "data" / "README.md"], ids=lambda page: str(page.relative_to(ROOT)))
def test_no_placeholder_is_left_in_the_docs(page):
    assert not placeholders(page), "a placeholder where a figure or text belongs:\n" + "\n".join(placeholders(page))


def test_the_placeholder_check_finds_one(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("Tokenizing runs at\nTOKRATE\nand `BUCKET` is a name to fill in, TODO: time it\n```\nNAME\n```\n")
    assert placeholders(page) == ["page.md:2: TOKRATE", "page.md:3: and `BUCKET` is a name to fill in, TODO: time it"]


def test_the_link_checker_finds_a_missing_anchor_and_file(tmp_path):
    page = tmp_path / "page.md"
    page.write_text('# A page\n\n<a id="kept-1"></a>\n## Its (`first`) section, 2026\n\n[here](#kept-1), '
                    "[heading](#its-first-section-2026), [gone](#not-here), [file](other.md), [web](https://x.y/#z)\n")
    assert link_problems(page) == ["page.md:6: ](#not-here): no anchor #not-here in page.md",
                                   "page.md:6: ](other.md): no file other.md"], link_problems(page)


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))


def test_the_cheap_quoted_outputs_are_what_the_commands_print():
    """A quote tagged [tested] (scripts/quoted_outputs.py) is rerun and compared; a changed message, or a
    quote edited by hand, fails."""
    check = [sys.executable, str(ROOT / "scripts" / "quoted_outputs.py"), "--check", "--tested"]
    proc = subprocess.run(check, capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 0 and "as quoted" in proc.stdout, proc.stdout + proc.stderr


def test_a_drifted_quote_is_found_and_rewritten(tmp_path):
    """--check holds every number but a time in seconds; --write puts the command's output in its place."""
    command = "python -c \"print(1.5, 's', 7)\""
    page = tmp_path / "page.md"
    page.write_text(f"<!-- output of: {command} -->\n```\n$ {command}\n2.5 s 8\n```\n")
    quoted_outputs = [sys.executable, str(ROOT / "scripts" / "quoted_outputs.py")]
    drifted = subprocess.run([*quoted_outputs, "--check", str(page)], capture_output=True, text=True)
    assert drifted.returncode == 1 and "-N s 8\n+N s 7" in drifted.stdout, drifted.stdout
    subprocess.run([*quoted_outputs, "--write", str(page)], check=True, capture_output=True)
    assert page.read_text() == f"<!-- output of: {command} -->\n```\n$ {command}\n1.5 s 7\n```\n"
    assert subprocess.run([*quoted_outputs, "--check", str(page)], capture_output=True).returncode == 0
