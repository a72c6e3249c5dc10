"""The manual in docs/: its settings table covers every setting the server reads.

docs/settings.md's table is made at build time by docs/hooks/settings_table.py from the calls
in mqsite/settings.py; these tests hold that list to an independent reading of the same file
(a plain text search), and to the rule that each setting has its comment (its line in the
table). `mkdocs build --strict`, which `make test` runs, checks the links.
"""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SETTINGS_PY = ROOT / "mqsite" / "settings.py"


def load_hook():
    path = ROOT / "docs" / "hooks" / "settings_table.py"
    spec = importlib.util.spec_from_file_location("settings_table", path)
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def grepped_settings():
    """Every variable name settings.py hands to a reader: env.<type>("NAME" or a checked
    reader (_positive_int("NAME" and its kin), found as text, not through the hook's ast walk."""
    text = SETTINGS_PY.read_text()
    return set(re.findall(r'\b(?:env\.[a-z]+|_[a-z_]+)\(\s*"([A-Z][A-Z0-9_]*)"', text))


def test_it_lists_every_variable_settings_py_reads():
    listed = {s["name"] for s in load_hook().environment_settings()}
    assert listed == grepped_settings()
    assert {"DATABASE_URL", "REDIS_URL", "SECRET_KEY", "DB_POOL_MAX_SIZE", "LOG_LEVEL"} <= listed


def test_it_gives_every_setting_its_comment_type_and_default():
    for setting in load_hook().environment_settings():
        assert setting["comment"], f"{setting['name']} has no comment above it in mqsite/settings.py"
        assert setting["type"]
        assert setting["default"] is not None, f"{setting['name']} has no default"


def test_it_fills_the_settings_page_with_a_row_for_each():
    hook = load_hook()
    page = (ROOT / "docs" / "settings.md").read_text()
    assert hook.MARKER in page
    rendered = hook.on_page_markdown(page, page=None, config=None, files=None)
    assert hook.MARKER not in rendered
    for name in grepped_settings():
        assert f"| `{name}` |" in rendered


def test_no_other_module_reads_the_environment():
    """Settings come from settings.py alone, so that the table is the whole list: no app module
    reads os.environ or os.getenv (setting DJANGO_SETTINGS_MODULE's default aside). The example
    project (examples/) is another project, with settings of its own, as are the clients."""
    readers = []
    elsewhere = {".venv", "tests", "bench", "docs", "clients", "examples", "var"}
    for path in ROOT.glob("*/**/*.py"):
        parts = path.relative_to(ROOT).parts
        if parts[0] in elsewhere or path == SETTINGS_PY:
            continue
        for line in path.read_text().splitlines():
            if re.search(r"os\.environ(?!\.setdefault\(\"DJANGO_SETTINGS_MODULE\")|os\.getenv", line):
                readers.append(f"{path.relative_to(ROOT)}: {line.strip()}")
    assert readers == []


def test_the_asyncapi_document_names_the_frames_the_socket_handles():
    """docs/asyncapi.yaml describes /ws/: the frame types it says a client sends are exactly
    those the consumer has a handler for, and it describes each frame the server sends."""
    import yaml

    from delivery.consumers import DeliveryConsumer

    doc = yaml.safe_load((ROOT / "docs" / "asyncapi.yaml").read_text())
    assert doc["asyncapi"].startswith("3.")

    def resolve(schema):
        if "$ref" in schema:
            return doc["components"]["schemas"][schema["$ref"].rsplit("/", 1)[1]]
        return schema

    def types(operation):
        names = [ref["$ref"].rsplit("/", 1)[1] for ref in doc["operations"][operation]["messages"]]
        payloads = [resolve(doc["components"]["messages"][name]["payload"]) for name in names]
        return {payload["properties"]["type"]["const"] for payload in payloads}

    assert types("receiveClientFrames") == set(DeliveryConsumer.handlers)
    answers = {"authenticated", "subscribed", "unsubscribed", "published", "receipt", "pong", "error"}
    assert types("sendServerFrames") == answers | {"message", "messages"}
