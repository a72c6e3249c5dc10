"""The one version of the server, its API documents (the OpenAPI schema at /api/schema/,
docs/asyncapi.yaml) and its clients (clients/python): the VERSION file at the top of the
repository. The server reads it here; what cannot read it (a client's pyproject.toml, the
AsyncAPI file) states it, and tests/mqsite/test_version.py checks that they agree, with the
newest release of CHANGELOG.md."""

from pathlib import Path

VERSION_FILE = Path(__file__).resolve().parent.parent / "VERSION"

VERSION = VERSION_FILE.read_text().strip()
