"""manage.py commands run in the test's own process (Django's call_command), as an operator
types them: what they print on stdout (stderr is dropped)."""

import io
import json

from django.core.management import call_command


def command_output(*args, stdin=None):
    out = io.StringIO()
    extra = {"stdin": io.StringIO(stdin)} if stdin is not None else {}
    call_command(*args, stdout=out, stderr=io.StringIO(), **extra)
    return out.getvalue()


def listen(*args):
    """`manage.py listen ...`: the deliveries it printed, one JSON object a line."""
    return [json.loads(line) for line in command_output("listen", *args).splitlines()]
