"""Every array name's shape suffix uses only the letters docs/model.md's legend lists ("Shape letters"),
each a dim, and lowercase ones a part of their uppercase dim (or k, the experts per token): a name like
`x_BTD` reads the same in every file. Checked on the code's identifiers (names, arguments, attributes),
not its prose."""
import ast
import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FOLDERS = ("", "engine", "data", "evals", "planning", "scripts", "tests")


def legend_letters():
    """The letters of the legend's table, and the lowercase part of each uppercase one."""
    text = open(os.path.join(ROOT, "docs", "model.md")).read()
    table = text[text.index("### Shape letters"):].split("\n\n")[2]
    letters = set(re.findall(r"^\| ([A-Za-z]) \|", table, re.M)) | set(re.findall(r"\| \S+.*?\| ([A-Za-z]) \|", table))
    return letters | {c.lower() for c in letters if c.isupper()}


def shape_suffix(name):
    """"x_BTD" -> "BTD"; None for a name without one (no uppercase letter after its last underscore, or a
    CONSTANT)."""
    head, _, suffix = name.rpartition("_")
    if head and head[0].islower() and suffix.isalpha() and any(c.isupper() for c in suffix):
        return suffix
    return None


def identifiers(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            yield node.id, node.lineno
        elif isinstance(node, ast.arg):
            yield node.arg, node.lineno
        elif isinstance(node, ast.Attribute):
            yield node.attr, node.lineno


def unlisted(letters, paths):
    found = []
    for path in paths:
        for name, line in identifiers(ast.parse(open(path).read())):
            suffix = shape_suffix(name)
            if suffix and set(suffix) - letters:
                found.append(f"{os.path.relpath(path, ROOT)}:{line}: {name} ({''.join(sorted(set(suffix) - letters))})")
    return sorted(set(found))


def test_every_shape_suffix_letter_is_in_the_legend():
    letters = legend_letters()
    assert {"B", "T", "D", "J", "Z", "k", "h", "b"} <= letters and "A" not in letters, sorted(letters)
    paths = [p for f in FOLDERS for p in glob.glob(os.path.join(ROOT, f, "*.py"))]
    assert len(paths) > 50
    assert unlisted(letters, paths) == []


def test_the_check_finds_an_unlisted_letter(tmp_path):
    path = tmp_path / "m.py"
    path.write_text("def f(x_BTD, y_BTY, N_MAX, keys_):\n    return x_BTD.shape, ROWS_T\n")
    assert shape_suffix("x_BTD") == "BTD" and shape_suffix("ROWS_T") is None and shape_suffix("keys_") is None
    assert unlisted(set("BTD"), [str(path)]) == [f"{os.path.relpath(path, ROOT)}:1: y_BTY (Y)"]
