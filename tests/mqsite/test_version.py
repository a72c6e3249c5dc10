"""One version (the VERSION file, mqsite/version.py) for the server, its API documents, its
Python client and the newest release of CHANGELOG.md, so that a client, a schema and a server
of one release say the same thing about it."""

import re
import tomllib
from pathlib import Path

import yaml

from mqsite.version import VERSION

ROOT = Path(__file__).resolve().parents[2]


def test_it_is_a_semantic_version():
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION)


def test_the_openapi_schema_says_it(client):
    assert client.get("/api/schema/?format=json").json()["info"]["version"] == VERSION


def test_the_asyncapi_document_says_it():
    assert yaml.safe_load((ROOT / "docs" / "asyncapi.yaml").read_text())["info"]["version"] == VERSION


def test_the_python_client_says_it():
    package = ROOT / "clients" / "python"
    project = tomllib.loads((package / "pyproject.toml").read_text())["project"]
    # read, not imported: the mqclient installed may be another checkout's
    [stated] = re.findall(r'^__version__ = "(.+)"$', (package / "mqclient" / "__init__.py").read_text(), re.M)
    assert project["version"] == stated == VERSION


def test_the_changelog_newest_release_is_it_with_an_upgrade_note():
    text = (ROOT / "CHANGELOG.md").read_text()
    releases = re.findall(r"^## \[([^\]]+)\]", text, re.MULTILINE)
    assert releases and releases[0] == VERSION
    newest = text.split(f"## [{VERSION}]", 1)[1].split("\n## [", 1)[0]
    assert "### Upgrading" in newest  # what operators must do


def test_there_is_a_licence():
    assert (ROOT / "LICENSE").read_text().startswith("MIT License")
