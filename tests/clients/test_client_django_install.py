"""mqclient.django as its users get it: a new virtualenv, `pip install "./clients/python[django]"`
from a copy of the checkout (so the package's file list is what is tested, not the source tree
on a path), a project made by `django-admin startproject` and `startapp`, the settings the docs
give; then orders committed and rolled back reach a real server once each, and none rolled back.
The rest of the app's behaviour is tested on tests/support/mqshop (test_client_django.py)."""

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest
from django.db import connection

from queues.models import Message
from tests.support.servers import ROOT

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(
        connection.vendor != "sqlite",
        reason="the Django project, whatever the server's database: the SQLite pass of make test runs it",
    ),
]

MODELS = """
from django.db import models


class Order(models.Model):
    item = models.CharField(max_length=100)
"""

SETTINGS = """
import os

INSTALLED_APPS += ["shop", "mqclient.django"]
MQ = {
    "URL": os.environ["MQ_URL"],
    "TOKEN": os.environ["MQ_TOKEN"],
    "MODEL_EVENTS": {"shop.Order": {"queue": "db", "events": ["create", "update", "delete"]}},
}
"""

ORDERS = """
import django
django.setup()
from django.db import transaction
from shop.models import Order

for i in range(12):
    try:
        with transaction.atomic():
            Order.objects.create(item=f"item-{i}")
            if i % 4 == 3:
                raise RuntimeError("rolled back")
    except RuntimeError:
        pass
"""


def run(args, cwd, env, timeout=180):
    done = subprocess.run(args, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{args}: {done.stdout[-2000:]}{done.stderr[-2000:]}"
    return done.stdout


def test_a_new_project_with_the_client_installed_from_the_checkout_publishes_what_commits(
    tmp_path, server, logger
):
    # given the client package copied out of the checkout and installed into a new virtualenv
    source = tmp_path / "mqclient-source"
    shutil.copytree(ROOT / "clients" / "python", source, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    venv = tmp_path / "venv"
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("PYTHONPATH", "DJANGO_SETTINGS_MODULE", "VIRTUAL_ENV")
    }
    run([sys.executable, "-m", "venv", str(venv)], tmp_path, env)
    python = str(venv / "bin" / "python")
    run([python, "-m", "pip", "install", "--quiet", f"{source}[django]"], tmp_path, env)
    # and a project made as Django's tutorial makes one, with the settings of the docs
    run([str(venv / "bin" / "django-admin"), "startproject", "site1"], tmp_path, env)
    project = tmp_path / "site1"
    run([python, "manage.py", "startapp", "shop"], project, env)
    (project / "shop" / "models.py").write_text(textwrap.dedent(MODELS))
    with open(project / "site1" / "settings.py", "a") as settings:
        settings.write(textwrap.dedent(SETTINGS))
    env = {**env, "MQ_URL": server.http, "MQ_TOKEN": logger.token, "DJANGO_SETTINGS_MODULE": "site1.settings"}
    run([python, "manage.py", "makemigrations", "shop", "-v", "0"], project, env)
    run([python, "manage.py", "migrate", "-v", "0"], project, env)
    assert "no issues" in run([python, "manage.py", "check"], project, env)
    # when a script of the project commits 9 orders and rolls 3 back, and exits
    (project / "orders.py").write_text(textwrap.dedent(ORDERS))
    run([python, "orders.py"], project, env)
    # then the server has each committed order once, in order (its relay thread sent them
    # before the script's exit), and no rolled-back one
    payloads = [json.loads(m.payload_json) for m in Message.objects.filter(queue__name="db").order_by("seq")]
    assert [(p["model"], p["fields"]["item"]) for p in payloads] == [
        ("shop.order", f"item-{i}") for i in range(12) if i % 4 != 3
    ]
    # and `mqrelay --once` finds nothing left to send
    assert run([python, "manage.py", "mqrelay", "--once"], project, env).strip() == "sent 0, refused 0"
