"""The JavaScript client as a package (clients/js): what `npm install ./clients/js` gives a
project, its hand-written declarations, and the server still serving the very same file at
/static/mq/mqclient.js (one source: delivery/static/mq/mqclient.js is a link to it)."""

import json
import re
import shutil
import subprocess

from django.core.management import call_command
from django.test import override_settings

from tests.support.servers import ROOT

PACKAGE = ROOT / "clients" / "js"
MODULE = PACKAGE / "mqclient.js"
DECLARATIONS = PACKAGE / "mqclient.d.ts"
# No skip when they are missing: `make test` installs the nodejs package, which brings npm
# (the Makefile's test tools), so a missing one is a broken setup, which a skip would hide.
NODE, NPM = shutil.which("node") or "node", shutil.which("npm") or "npm"


def test_the_server_serves_the_package_file_byte_for_byte(client):
    response = client.get("/static/mq/mqclient.js")
    assert response.status_code == 200
    assert "javascript" in response["Content-Type"]
    assert b"".join(response.streaming_content) == MODULE.read_bytes()


def test_collectstatic_copies_the_package_file_not_a_dangling_link(tmp_path):
    with override_settings(STATIC_ROOT=tmp_path):
        call_command("collectstatic", interactive=False, verbosity=0)
    collected = tmp_path / "mq" / "mqclient.js"
    assert not collected.is_symlink()
    assert collected.read_bytes() == MODULE.read_bytes()


def test_the_package_says_what_a_project_needs_to_import_it():
    package = json.loads((PACKAGE / "package.json").read_text())
    assert package["type"] == "module" and not package.get("dependencies")
    assert package["exports"]["."] == {"types": "./mqclient.d.ts", "default": "./mqclient.js"}
    assert package["types"] == "./mqclient.d.ts" and package["engines"]["node"] == ">=20"
    assert package["version"] == (ROOT / "VERSION").read_text().strip()
    for name in package["files"]:
        assert (PACKAGE / name).is_file()


def test_every_export_and_option_of_the_module_is_declared():
    """tsc is not installed offline here: the declarations are checked against the module's
    own exports (as Node sees them) and its options (DEFAULTS) by name."""
    exports = subprocess.run(
        [
            NODE,
            "--input-type=module",
            "-e",
            f"console.log(JSON.stringify(Object.keys(await import({json.dumps(str(MODULE))}))))",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    )
    names = json.loads(exports.stdout)
    assert {"connect", "MQError"} <= set(names)
    declared = DECLARATIONS.read_text()
    for name in names:
        assert re.search(
            rf"^export (declare )?(function|class|const|interface|type) {name}\b", declared, re.M
        ), name
    defaults = re.search(r"^const DEFAULTS = \{(.*?)^\};", MODULE.read_text(), re.M | re.S).group(1)
    options = re.search(r"^export interface ConnectOptions \{(.*?)^\}", declared, re.M | re.S).group(1)
    for option in re.findall(r"^  (\w+):", defaults, re.M):
        assert re.search(rf"^  {option}\?:", options, re.M), option
    for method in ("on", "subscribe", "publish", "extend", "seek", "close"):
        assert re.search(rf"^  (async )?{method}[(<]", MODULE.read_text(), re.M), method
        assert re.search(rf"^  {method}[(<]", declared, re.M), method


def test_npm_install_from_a_checkout_and_import_it_under_node(tmp_path):
    project = tmp_path / "app"
    project.mkdir()
    (project / "package.json").write_text(json.dumps({"name": "app", "private": True, "type": "module"}))
    subprocess.run(
        [NPM, "install", "--offline", "--no-audit", "--no-fund", str(PACKAGE)],
        cwd=project,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    (project / "main.js").write_text(
        'import { connect, MQError } from "mqclient";\n'
        'import { createRequire } from "node:module";\n'
        'const pkg = createRequire(import.meta.url)("mqclient/package.json");\n'
        "let refused = null;\n"
        'try { connect({ url: "http://127.0.0.1:1" }); } catch (e) { refused = e.message; }\n'
        'const error = new MQError("closed", "gone");\n'
        "console.log(JSON.stringify({ name: pkg.name, types: pkg.types, refused, code: error.code }));\n"
    )
    ran = subprocess.run([NODE, "main.js"], cwd=project, capture_output=True, text=True, timeout=30)
    assert ran.returncode == 0, ran.stderr
    assert json.loads(ran.stdout) == {
        "name": "mqclient",
        "types": "./mqclient.d.ts",
        "refused": "connect() needs a token (a string)",
        "code": "closed",
    }
    installed = project / "node_modules" / "mqclient"
    assert (installed / "mqclient.d.ts").read_bytes() == DECLARATIONS.read_bytes()
