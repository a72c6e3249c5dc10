"""bootstrap: run by `make run` before the server starts. Makes the first operator and says
where to log in; on a fresh install (no queue yet) seeds the demo (dashboard.demo).
Idempotent; --json prints one JSON object. The password is printed once, when the operator is
made (start-up logs are kept and shared more widely than var/); later runs say which private
file holds it."""

import secrets
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import CommandError

from dashboard import demo
from mqsite.commands import ReportCommand
from mqsite.private_files import write_private

USERNAME = "admin"


def password_file():
    return Path(settings.VAR_DIR) / "operator_password"


class Command(ReportCommand):
    help = "Make the first operator (admin, random password in var/operator_password) and print the URLs."
    json_help = (
        'print {"operator": {"username", "state", "password", "password_file"}, "demo_tokens_file", "urls"}'
    )

    def add_arguments(self, parser):
        parser.add_argument(
            "--no-demo", action="store_true", help="do not seed the demo queues and subscribers"
        )

    def report(self, *args, **options):
        users = get_user_model().objects
        path = password_file()
        operator = {"username": USERNAME, "state": None, "password": None, "password_file": str(path)}
        if not users.filter(is_superuser=True).exists():
            if users.filter(username=USERNAME).exists():
                raise CommandError(
                    f"a user named {USERNAME!r} exists but is not a superuser: "
                    "make an operator with `manage.py createsuperuser`"
                )
            password = secrets.token_urlsafe(18)
            # The file first, the user after: should the user fail, the next run makes both
            # again, whereas a user whose password was never written down would be locked out.
            write_private(path, password + "\n")
            users.create_superuser(USERNAME, email="", password=password)
            operator.update(state="made", password=password)
        elif path.exists():
            password = path.read_text().strip()
            admin = users.filter(username=USERNAME, is_superuser=True).first()
            operator["state"] = "kept" if admin is not None and admin.check_password(password) else "changed"
        else:
            operator.update(state="existing", username=None, password_file=None)
        if not options["no_demo"]:
            demo.seed_if_fresh()  # only on a fresh install: while no queue exists
        base = f"http://127.0.0.1:{settings.PORT}"
        return {
            "operator": operator,
            "demo_tokens_file": str(demo.tokens_file()) if demo.tokens_file().exists() else None,
            "urls": {
                "dashboard": f"{base}/",
                "admin": f"{base}/admin/",
                "api_docs": f"{base}/api/docs/",
                "metrics": f"{base}/metrics",
                "health": f"{base}/healthz",
            },
        }

    def render(self, result):
        operator, path = result["operator"], result["operator"]["password_file"]
        if operator["state"] == "made":
            # Even at -v 0: the only time the password is shown.
            self.stdout.write(
                f"operator login: {USERNAME} / {operator['password']} (shown this once; kept in {path})"
            )
        elif operator["state"] == "kept":
            self.say(f"operator login: {USERNAME}, password in {path}")
        elif operator["state"] == "changed":
            self.say(f"operator login: the password in {path} was changed since; use your own")
        else:
            self.say("operator login: an operator exists already (manage.py createsuperuser)")
        if result["demo_tokens_file"]:
            self.say(
                f"demo:     queues db, filesystem, network; subscribers logger, dashboard, monitor "
                f"(tokens in {result['demo_tokens_file']}); traffic: `make demo` or `DEMO=1 make run`"
            )
        urls = result["urls"]
        self.say(f"dashboard: {urls['dashboard']}")
        self.say(f"admin:    {urls['admin']}")
        self.say(f"API docs: {urls['api_docs']}")
        self.say(f"metrics:  {urls['metrics']}")
        self.say(f"health:   {urls['health']}")
