"""What scripts rely on of every manage.py command (docs/commands.md, "In scripts"): --json
prints one JSON document with the documented keys, a failure is one line on stderr and an exit
code that says what happened, -v 0 is quiet, and the long commands show progress on stderr."""

import io
import json
import os
import subprocess
import sys

import pytest
from django.conf import settings
from django.core.management import CommandError, call_command

from delivery import ledger, publishing
from delivery.models import Delivery, Status
from mqsite.commands import EXIT_BUSY, EXIT_ERROR, EXIT_USAGE, Progress
from tests.analytics.locks import archive_held_elsewhere
from tests.support import servers
from tests.support.fields import PUBLISHED_FIELDS

# The keys of each command's --json document, as docs/commands.md lists them.
DOCUMENTED_KEYS = {
    "createqueue": {
        "queue",
        "created",
        "changed",
        "ordered",
        "max_attempts",
        "ack_timeout",
        "retention_days",
        "ttl_secs",
        "lag_alert_secs",
    },
    "createsubscriber": {"subscriber", "created", "publish", "subscribe", "webhook_secret", "token"},
    "pausesubscription": {"subscriptions"},
    "webhook": {
        "subscriber",
        "webhook_url",
        "disabled",
        "disabled_since",
        "disabled_after",
        "failures",
        "first_failure_at",
        "last_error",
        "last_success_at",
        "changed",
    },
    "rotatewebhooksecret": {
        "subscriber",
        "webhook_secret",
        "previous_signs_until",
        "grace_secs",
        "webhook_url",
    },
    "bootstrap": {"operator", "demo_tokens_file", "urls"},
    "publish": PUBLISHED_FIELDS,
    "eventschema": {"queue", "event", "schema_version", "cleared"},
    "queuestats": {"queues"},  # and "groups" when an ordered queue has work
    "redeliver": {"redelivered"},
    "recounttallies": {"kept_counts"},
    "archive": {"messages", "deliveries"},
    "compactarchive": {"partitions", "files_before", "files_after"},
    "prunearchive": {"partitions", "files", "bytes"},
    "analyze": {"events", "subscribers"},
    "sparkclasses": {"path", "made", "skipped"},
    "demo": {"published", "acked", "nacked", "via", "at"},
    "ensuremigrated": {"missing", "migrated"},
}

INVOCATIONS = {
    "createqueue": ["audit"],
    "createsubscriber": ["app", "--subscribe", "db"],
    "pausesubscription": ["logger", "db"],
    "webhook": ["status", "logger"],
    "rotatewebhooksecret": ["logger", "--grace-secs", "0"],
    "bootstrap": ["--no-demo"],
    "publish": ["db", "create", '{"a": 1}'],
    "eventschema": ["db", "create", "--clear"],
    "queuestats": [],
    "redeliver": [],
    "recounttallies": [],
    "archive": ["--older-than-days", "0"],
    "compactarchive": [],
    "prunearchive": ["--older-than-days", "30"],
    "analyze": [],
    "sparkclasses": [],
    "demo": ["--count", "3", "--rate", "200", "--server-wait", "0", "--poison-every", "0"],
    "ensuremigrated": [],
}


def run(*args, stdin=None):
    """(stdout, stderr) of the command run in this process."""
    out, err = io.StringIO(), io.StringIO()
    extra = {"stdin": io.StringIO(stdin)} if stdin is not None else {}
    call_command(*args, stdout=out, stderr=err, **extra)
    return out.getvalue(), err.getvalue()


@pytest.fixture
def world(subscribed, logger, archive_dir, var_dir, settings):
    """A queue with two subscribers, one message owed to each; the logger has a webhook."""
    logger.webhook_url = "https://example.com/hook"
    logger.save()
    settings.MQ_SPARK_CLASS_ARCHIVE = ""
    publishing.publish(subscribed, [publishing.prepare("create", {"n": 1})])
    return subscribed


def test_every_reporting_command_is_listed_here():
    found = {
        name[: -len(".py")]
        for app in ("queues", "subscribers", "delivery", "dashboard", "analytics")
        for name in os.listdir(settings.BASE_DIR / app / "management" / "commands")
        if name.endswith(".py") and name != "__init__.py"
    }
    # listen prints a stream of JSON lines (one delivery each) rather than one document.
    assert found - {"listen"} == set(DOCUMENTED_KEYS)


@pytest.mark.parametrize("command", sorted(INVOCATIONS))
def test_it_prints_one_json_document_with_the_documented_keys(world, command):
    if command == "demo":
        call_command("bootstrap", stdout=io.StringIO())  # seeds the demo queues and subscribers

    out, _ = run(command, *INVOCATIONS[command], "--json")

    document = json.loads(out)  # one document, nothing else on stdout
    assert isinstance(document, dict)
    assert set(document) == DOCUMENTED_KEYS[command]


def test_the_manual_lists_each_documents_keys():
    manual = (settings.BASE_DIR / "docs" / "commands.md").read_text()
    documents = manual[manual.index("## JSON documents") :]
    for command, keys in DOCUMENTED_KEYS.items():
        [row] = [line for line in documents.splitlines() if line.startswith(f"| `{command}` |")]
        assert all(f'"{key}"' in row for key in keys), (command, row)


def test_a_subscription_answer_is_the_same_with_and_without_json(world, logger):
    lines, _ = run("pausesubscription", "logger", "db")
    document, _ = run("pausesubscription", "logger", "db", "--resume", "--json")

    paused = [json.loads(line) for line in lines.splitlines()]
    resumed = json.loads(document)["subscriptions"]
    assert [s["paused"] for s in paused] == [True] and [s["paused"] for s in resumed] == [False]
    assert set(paused[0]) == set(resumed[0])


def test_quiet_prints_only_what_the_command_is_for(world):
    out, err = run("createqueue", "audit", "-v", "0")
    assert (out, err) == ("", "")

    out, err = run("createsubscriber", "logger", "--subscribe", "db", "-v", "0")
    assert len(out.splitlines()) == 1 and " " not in out.strip()  # the token alone
    assert err == ""  # not even "it existed: it has a new token"


def test_the_long_commands_say_how_far_they_are_on_stderr_a_line_a_step(world, make_queue, logger, peer):
    publishing.publish(make_queue("other"), [publishing.prepare("x", {})])
    for subscriber in (logger, peer):  # all acked, so that all of it may be archived
        ledger.ack_deliveries(subscriber, [d["id"] for d in ledger.lease_deliveries(subscriber, limit=10)])
    deliveries = Delivery.objects.count()
    assert deliveries == Delivery.objects.filter(status=Status.ACKED).count() == 2
    # (analyze before the archive has anything: no Spark run)
    _, err = run("analyze", "--json")
    steps = [line.split(" [")[0] for line in err.splitlines()]
    assert steps[0] == "analyze: holds the archive" and steps[-1] == "analyze: stored the results"

    out, err = run("archive", "--older-than-days", "0")

    assert json.loads(out) == {"messages": 2, "deliveries": deliveries}
    lines = err.splitlines()
    assert [line.split(":")[:2] for line in lines] == [["archive", " db"], ["archive", " other"]]
    assert "\r" not in err  # a log keeps lines, not a redrawn bar

    out, err = run("recounttallies")
    assert out.startswith("counted again:")
    assert "recounttallies: counted the deliveries" in err and len(err.splitlines()) == 5

    _, quiet = run("recounttallies", "-v", "0")
    assert quiet == ""
    _, more = run("recounttallies", "-v", "2")
    assert more.splitlines()[0] == "recounttallies: writers wait until the new counts are committed"


class Terminal(io.StringIO):
    def isatty(self):
        return True


def test_on_a_terminal_progress_is_a_bar():
    terminal = Terminal()

    with Progress(terminal, desc="archive", unit="messages", total=None, verbosity=1) as progress:
        progress.step("db: 2000 messages", n=2000)
        progress.step("db: 500 messages", n=500)

    assert "\r" in terminal.getvalue() and "2500 messages" in terminal.getvalue()


def test_a_busy_archive_is_its_own_exit_code(world, settings):
    settings.MQ_ANALYZE_LOCK_WAIT_SECS = 0
    with archive_held_elsewhere():
        # prunearchive with a retention to apply: without one it has nothing to hold the lock for
        for command in ("archive", "compactarchive", "prunearchive", "analyze"):
            with pytest.raises(CommandError, match="another archive run") as raised:
                run(command, *INVOCATIONS[command])
            assert raised.value.returncode == EXIT_BUSY


# --- real runs: what a script sees --------------------------------------------------------------


def manage(*args, env=None):
    """A real `manage.py` run against the test database."""
    return subprocess.run(
        [sys.executable, "manage.py", *args],
        cwd=settings.BASE_DIR,
        env={**os.environ, "DATABASE_URL": servers.test_database_url(), **(env or {})},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def assert_one_line_error(done, code, command, says):
    assert done.returncode == code, done.stderr
    assert done.stdout == ""
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith(f"manage.py {command}: ") and says in done.stderr, done.stderr
    assert len(done.stderr.strip().splitlines()) == 1


def test_a_real_run_fails_with_one_line_and_the_exit_code_that_says_why(transactional_db, archive_dir):
    assert_one_line_error(
        manage("publish", "nope", "create", "{}", "--json"), EXIT_ERROR, "publish", "no queue named 'nope'"
    )
    # Options that parse but do not go together are a usage error, as a bad option is.
    assert_one_line_error(
        manage("analyze", "--since", "2026-02-02", "--until", "2026-01-01"), EXIT_USAGE, "analyze", "after"
    )
    with archive_held_elsewhere():
        done = manage("archive", "--json", env={"MQ_ARCHIVE_DIR": str(archive_dir)})
    assert_one_line_error(done, EXIT_BUSY, "archive", "busy: another archive run")


def test_a_real_run_without_its_database_says_so_in_one_line(tmp_path):
    done = manage("queuestats", env={"DATABASE_URL": f"sqlite:///{tmp_path}/no/such/folder/db.sqlite3"})

    assert_one_line_error(done, EXIT_ERROR, "queuestats", "the database")
    assert "--traceback" in done.stderr  # how to see more


def test_a_real_run_shows_progress_on_stderr_and_is_quiet_at_v0(transactional_db):
    done = manage("recounttallies")
    quiet = manage("recounttallies", "-v", "0", "--json")

    assert done.returncode == 0 and done.stdout.startswith("counted again:")
    steps = [line.split(" [")[0] for line in done.stderr.splitlines()]
    assert steps[-1] == "recounttallies: counted the webhook attempts" and len(steps) == 5
    assert quiet.returncode == 0 and quiet.stderr == ""
    assert set(json.loads(quiet.stdout)) == {"kept_counts"}
