"""The modules import each other without a cycle (main.py at the top; collectives.py, hlo.py, hardware.py,
metrics_schema.py, parallel_dims.py, utils.py and data/ at the bottom), counting imports inside functions too: a
module can then be read, tested and replaced on its own. The rules are by folder: the top level is the guide's code;
engine/ is the engine, whose one door is the package itself (engine/__init__.py: `engine_for` and the seams' two
engines), so no module outside engine/ imports a file inside it; data/ is below everything and imports
nothing of the top level; evals/ holds the downstream tasks and their scoring; planning/ is "will it fit?",
whose `--compile_for` report and H200 step-time estimate the training run never imports. In tests/, no test
module imports another: what tests share is in a helper module."""
import ast
import os
import subprocess
import sys

from ceiling import CEILING_S

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


FOLDERS = ("data", "engine", "evals", "planning")


def project_modules():
    """{module name: path} of the repository's Python modules: the top level's, and those of each of FOLDERS
    ("engine" itself is engine/__init__.py)."""
    found = {}
    for folder, prefix in ((ROOT, ""), *((os.path.join(ROOT, f), f + ".") for f in FOLDERS)):
        for name in os.listdir(folder):
            if name == "__init__.py" and prefix:
                found[prefix[:-1]] = os.path.join(folder, name)
            elif name.endswith(".py") and name != "__init__.py":
                found[prefix + name[:-3]] = os.path.join(folder, name)
    return found


def imported_modules(path, modules, at_import=False):
    """The modules of the set `modules` that the file at `path` imports, anywhere in its code (a type checker's
    `if TYPE_CHECKING:` imports too: they tie the modules as much as a reader goes); at_import: only those its
    import runs (outside functions)."""
    imported = set()
    for node in (_outside_functions if at_import else ast.walk)(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            # `from engine import products` imports the module engine.products (a package's own
            # __init__ runs first in Python, but a submodule's import does not depend on it)
            names = {f"{node.module}.{alias.name}" for alias in node.names}
            imported |= (names & modules) | ({node.module} if names - modules else set())
    return imported & modules


def _outside_functions(tree):
    """ast.walk that does not enter a function's body."""
    todo = [tree]
    while todo:
        node = todo.pop()
        yield node
        todo += [child for child in ast.iter_child_nodes(node)
                 if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))]


def import_graph():
    """{module: the project modules it imports, anywhere in its code}."""
    modules = project_modules()
    return {name: sorted(imported_modules(path, set(modules)) - {name}) for name, path in modules.items()}


def find_cycle(graph):
    """One import cycle as a list of modules (the first repeated at the end), or None."""
    state = {}                          # 1: on the current path, 2: done

    def visit(node, path):
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt, path + [nxt])
                if cycle:
                    return cycle
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state:
            cycle = visit(start, [start])
            if cycle:
                return cycle
    return None


def folder(module):
    """The folder a module lives in ("" for the top level)."""
    return module.split(".")[0] if module.split(".")[0] in FOLDERS else ""


def test_the_modules_import_each_other_without_a_cycle():
    graph = import_graph()
    assert {"main", "model", "sharding", "pipeline", "trainer", "checkpoints", "rundir", "hlo", "engine",
            "engine.products", "data.shards"} <= set(graph)
    bottom = ("hlo", "hardware", "metrics_schema", "collectives", "parallel_dims")
    assert all(graph[m] == [] for m in bottom) and graph["utils"] == ["hardware", "parallel_dims"], \
        "nothing of the project below these"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_engine_has_one_door_and_data_is_at_the_bottom():
    graph = import_graph()
    through_a_side_door = {m: [i for i in imported if folder(i) == "engine" and i != "engine"]
                           for m, imported in graph.items() if folder(m) != "engine"}
    assert not any(through_a_side_door.values()), through_a_side_door
    upward = {m: [i for i in imported if folder(i) == ""] for m, imported in graph.items() if folder(m) == "data"}
    assert not any(upward.values()), upward
    assert graph["model"] == ["collectives", "stacking"] and graph["stacking"] == [], "the model's math calls the seams"


def test_the_training_run_imports_neither_the_compile_for_report_nor_the_step_time_estimate():
    """planning/: the run checks its fit (planning.fit) and compiles and measures (planning.measure); the
    `--compile_for` report is main.py's for that flag alone (imported inside the function that runs it), and
    the H200 step-time estimate is the report's."""
    graph = import_graph()
    importers = lambda module: sorted(m for m, imported in graph.items() if module in imported)
    assert importers("planning.report") == ["main"]
    assert importers("planning.step_time") == ["planning.report"]
    modules = project_modules()
    reached, todo = set(), ["bench", "trainer", *imported_modules(modules["main"], set(modules), at_import=True)]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += graph[module]
    assert {"planning.fit", "planning.measure", "trainer"} <= reached
    assert not reached & {"planning.report", "planning.step_time"}, sorted(reached)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": []}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": [], "c": ["a", "b"]}) is None


def imports_among_test_modules():
    """{tests/test_*.py module: the tests/test_*.py modules it imports, anywhere in its code}."""
    tests = os.path.join(ROOT, "tests")
    modules = {name[:-3] for name in os.listdir(tests) if name.startswith("test_") and name.endswith(".py")}
    either_name = modules | {f"tests.{m}" for m in modules}
    return {name: sorted({i.removeprefix("tests.") for i in imported_modules(os.path.join(tests, name + ".py"),
                                                                            either_name)} - {name})
            for name in sorted(modules)}


def test_no_test_module_imports_another():
    """A test module holds tests, and what several share is in a helper module (any tests/*.py not named
    test_*.py: model_util.py, run_util.py, data_util.py, ...): a test module imported by another runs its
    module-level code there, and a change to it, or its removal, breaks tests it does not hold."""
    graph = imports_among_test_modules()
    assert {"test_main", "test_model", "test_layout"} <= set(graph)
    imports = {m: imported for m, imported in graph.items() if imported}
    assert imports == {}, imports


def test_importing_main_loads_no_pyarrow():
    """A TPU VM's image may lack pyarrow: only the olmo_* tasks read Arrow files (evals.tasks._olmo_rows imports it)."""
    proc = subprocess.run([sys.executable, "-c", "import sys, main; print(sorted(m for m in sys.modules if 'arrow' in m))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=CEILING_S)
    assert proc.returncode == 0 and proc.stdout.strip() == "[]", proc.stdout + proc.stderr[-2000:]
