"""The settings page's table, made from mqsite/settings.py itself at each docs build.

Every setting the server reads from the environment is a call in mqsite/settings.py:
`env.<type>("NAME", default=...)` or one of its checked forms (`_positive_int("NAME", default)`
and its kin). This hook finds those calls with `ast` and renders each name, its type, its
default as written in the code, and the comment written above it, in place of the marker
`<!-- settings-table -->` in docs/settings.md. A new setting therefore shows in the manual
without anyone writing it there, and tests/mqsite/test_docs.py fails if one has no comment.
"""

import ast
import html
from pathlib import Path

SETTINGS_PY = Path(__file__).resolve().parents[2] / "mqsite" / "settings.py"
MARKER = "<!-- settings-table -->"

# django-environ's readers, and the checked readers settings.py defines on top of them.
ENV_TYPES = {
    "str": "text",
    "int": "whole number",
    "float": "number",
    "bool": "true/false",
    "list": "comma-separated list",
    "db": "database URL",
}
CHECKED_TYPES = {
    "_positive_int": "whole number > 0",
    "_whole_number": "whole number ≥ 0",
    "_positive_float": "number > 0",
    "_spark_conf": "JSON object",
}


def _reader(call):
    """The type a call reads its variable as, or None when the call reads no variable."""
    func = call.func
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "env":
        return ENV_TYPES.get(func.attr)
    if isinstance(func, ast.Name):
        return CHECKED_TYPES.get(func.id)
    return None


def _default(call, source):
    expr = next((kw.value for kw in call.keywords if kw.arg == "default"), None)
    if expr is None and len(call.args) > 1:
        expr = call.args[1]
    return ast.get_source_segment(source, expr) if expr is not None else None


def _is_comment(line):
    # A section's banner ("# --- Database ---") is a heading, not a setting's comment.
    return line.strip().startswith("#") and not line.strip().startswith("# ---")


def _comment_above(lines, lineno):
    """The `#` lines right above line `lineno` (1-based), joined; '' when there are none."""
    found = []
    index = lineno - 2
    while index >= 0 and _is_comment(lines[index]):
        found.append(lines[index].strip().lstrip("#").strip())
        index -= 1
    return " ".join(reversed(found))


def environment_settings(path=SETTINGS_PY):
    """[{name, type, default, comment}] for every variable settings.py reads, in file order.

    The comment is the one right above the call's own line when the call sits inside a larger
    statement (a dict, a function) and has one, else the one above its statement. A variable
    read twice (SECRET_KEY: is it set, then its value) is listed once, with its first default.
    """
    source = Path(path).read_text()
    lines = source.splitlines()
    tree = ast.parse(source)
    statement_of = {}
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt):
                for inner in ast.walk(child):
                    statement_of.setdefault(id(inner), child)
    found = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or _reader(node) is None:
            continue
        first = node.args[0] if node.args else None
        if not isinstance(first, ast.Constant) or not isinstance(first.value, str):
            continue
        name = first.value
        if name in found:
            continue
        statement = statement_of.get(id(node))
        comment = _comment_above(lines, node.lineno)
        if not comment and statement is not None:
            comment = _comment_above(lines, statement.lineno)
        found[name] = {
            "name": name,
            "type": _reader(node),
            "default": _default(node, source),
            "comment": comment,
            "line": node.lineno,
        }
    return sorted(found.values(), key=lambda s: s["line"])


def _cell(text):
    """Text for a table cell: no HTML of its own, no pipe that would split the row."""
    return html.escape(text, quote=False).replace("|", "\\|").replace("\n", " ")


def _code_cell(text):
    """A default as code: a code span keeps its characters as they are, so only the pipe."""
    return "`" + text.replace("|", "\\|").replace("\n", " ") + "`"


def settings_table(path=SETTINGS_PY):
    rows = ["| variable | type | default (as the code says) | what it is |", "| --- | --- | --- | --- |"]
    for s in environment_settings(path):
        default = _code_cell(s["default"]) if s["default"] is not None else "none"
        rows.append(f"| `{s['name']}` | {s['type']} | {default} | {_cell(s['comment'])} |")
    return "\n".join(rows)


def on_page_markdown(markdown, page, config, files):
    """mkdocs hook: fill the marker of the settings page."""
    if MARKER in markdown:
        return markdown.replace(MARKER, settings_table())
    return markdown
