"""The Content-Security-Policy on every page a browser renders (dashboard, admin, API docs),
from a real server: scripts from this origin's files only, connections to this origin only.
tests/e2e/test_browser.py proves the pages still work under it in Chromium."""

import re
import urllib.request

import httpx
import pytest

from subscribers.provisioning import create_subscriber

pytestmark = pytest.mark.django_db(transaction=True)

INLINE_SCRIPT = re.compile(r"<script(?![^>]*\bsrc=)[^>]*>|<[^>]*\son(?:click|submit|load|change)\s*=", re.I)


def policy(response):
    value = response.headers.get("Content-Security-Policy", "")
    return dict((d.split(" ", 1) + [""])[:2] for d in (p.strip() for p in value.split(";")) if d)


def test_the_pages_carry_a_policy_that_runs_no_inline_script(server, operator):
    browser = httpx.Client(base_url=server.http)
    login = browser.get("/admin/login/")
    browser.post(
        "/admin/login/?next=/",
        data={
            "username": "op",
            "password": "op-password-1",
            "csrfmiddlewaretoken": browser.cookies["csrftoken"],
            "next": "/",
        },
        headers={"Referer": f"{server.http}/admin/login/"},
    )
    for url in ("/", "/admin/", "/admin/subscribers/subscriber/", "/admin/tools/head-of-line/", "/api/docs/"):
        r = browser.get(url)
        assert r.status_code == 200, url
        rules = policy(r)
        assert rules["script-src"] == "'self'", url
        assert rules["connect-src"] == "'self'" and rules["object-src"] == "'none'", url
        assert rules["frame-ancestors"] == "'none'", url
        assert not INLINE_SCRIPT.search(r.text), f"{url} has an inline script, which the policy blocks"
    assert policy(login)["script-src"] == "'self'"
    # Swagger UI's start-up script is a file of its own, served by the app.
    script = browser.get("/api/docs/?script=")
    assert script.status_code == 200 and "SwaggerUIBundle" in script.text


def test_a_bearer_token_call_goes_without_the_policy(server, db_queue):
    _, token = create_subscriber("app", publish=["db"])
    req = urllib.request.Request(f"{server.http}/api/queues", headers={"Authorization": f"Bearer {token}"})
    with urllib.request.urlopen(req, timeout=10) as r:
        assert r.status == 200 and r.headers.get("Content-Security-Policy") is None
