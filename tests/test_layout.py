"""The modules import each other without a cycle (main.py at the top, collectives.py, hlo.py, utils.py and
the data tokenizers at the bottom), counting imports inside functions too: a module can then be read,
tested and replaced on its own. The guide's model reaches the engine only through the seams it is handed
(engine.py): it imports none of the engine's files."""
import ast
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def project_modules():
    """{module name: path} of the repository's Python modules (top level and data/)."""
    found = {}
    for folder, prefix in ((ROOT, ""), (os.path.join(ROOT, "data"), "data.")):
        for name in os.listdir(folder):
            if name.endswith(".py") and name != "__init__.py":
                found[prefix + name[:-3]] = os.path.join(folder, name)
    return found


def import_graph():
    """{module: the project modules it imports, anywhere in its code}."""
    modules = project_modules()
    graph = {}
    for name, path in modules.items():
        imported = set()
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                imported |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported |= {node.module} | {f"{node.module}.{alias.name}" for alias in node.names}
        graph[name] = sorted(imported & set(modules) - {name})
    return graph


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


ENGINE = {"engine", "products", "attention", "experts", "fsdp"}


def test_the_modules_import_each_other_without_a_cycle():
    graph = import_graph()
    assert {"main", "model", "sharding", "pipeline", "trainer", "checkpoints", "rundir", "hlo"} <= set(graph)
    assert graph["hlo"] == [] and graph["utils"] == [] and graph["collectives"] == [], "these import nothing of the project"
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_model_and_the_schedule_call_the_engine_only_through_its_seams():
    graph = import_graph()
    assert graph["model"] == ["collectives", "stacking"] and graph["stacking"] == []
    assert not (ENGINE - {"engine"}) & set(graph["pipeline"]), graph["pipeline"]


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": ["b"], "b": ["c"], "c": ["a"], "d": []}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": ["b"], "b": [], "c": ["a", "b"]}) is None
