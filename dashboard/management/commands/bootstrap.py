"""bootstrap: run by `make run` before the server starts. Makes the first operator and says
where to log in; on a fresh install (no queue yet) seeds the demo (dashboard.demo).
Idempotent. The password is printed once, when the operator is made (start-up logs are kept and
shared more widely than var/); later runs say which private file holds it."""

import secrets
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand, CommandError

from dashboard import demo
from mqsite.private_files import write_private

USERNAME = "admin"


def password_file():
    return Path(settings.VAR_DIR) / "operator_password"


class Command(BaseCommand):
    help = "Make the first operator (admin, random password in var/operator_password) and print the URLs."

    def add_arguments(self, parser):
        parser.add_argument(
            "--no-demo", action="store_true", help="do not seed the demo queues and subscribers"
        )

    def handle(self, *args, **options):
        users = get_user_model().objects
        path = password_file()
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
            self.stdout.write(f"operator login: {USERNAME} / {password} (shown this once; kept in {path})")
        elif path.exists():
            password = path.read_text().strip()
            admin = users.filter(username=USERNAME, is_superuser=True).first()
            if admin is not None and admin.check_password(password):
                self.stdout.write(f"operator login: {USERNAME}, password in {path}")
            else:
                self.stdout.write(f"operator login: the password in {path} was changed since; use your own")
        else:
            self.stdout.write("operator login: an operator exists already (manage.py createsuperuser)")
        if not options["no_demo"]:
            demo.seed_if_fresh()  # only on a fresh install: while no queue exists
        if demo.tokens_file().exists():
            self.stdout.write(
                f"demo:     queues db, filesystem, network; subscribers logger, dashboard, monitor "
                f"(tokens in {demo.tokens_file()}); traffic: `make demo` or `DEMO=1 make run`"
            )
        base = f"http://127.0.0.1:{settings.PORT}"
        self.stdout.write(f"dashboard: {base}/")
        self.stdout.write(f"admin:    {base}/admin/")
        self.stdout.write(f"API docs: {base}/api/docs/")
        self.stdout.write(f"metrics:  {base}/metrics")
        self.stdout.write(f"health:   {base}/healthz")
