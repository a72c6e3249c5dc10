"""The shape every manage.py command of this project shares, so that scripts can rely on it
(docs/commands.md):

- `--json`: the command's result as one JSON document on stdout, nothing else there;
- exit codes: 0 done, 1 error, 2 usage, 3 busy (another run holds what it needs: try later);
  an error is one line on stderr, `manage.py NAME: error: ...`, never a traceback (unless
  `--traceback`);
- `-v 0` prints only the result (the JSON, a token, a secret...), `-v 1` adds summaries and
  progress on stderr, `-v 2` adds detail;
- progress of a long run on stderr: a bar on a terminal, a line per step otherwise.

A command subclasses ReportCommand, returns its result from `report()` as a dict, and prints
it for people in `render()`.
"""

import json
import sys
import time

from django.core.exceptions import ImproperlyConfigured
from django.core.management.base import (
    BaseCommand,
    CommandError,
    SystemCheckError,
    handle_default_options,
)
from django.db import DatabaseError, connections
from rest_framework.utils.encoders import JSONEncoder

EXIT_DONE = 0
EXIT_ERROR = 1
EXIT_USAGE = 2  # argparse's own code for a bad command line
EXIT_BUSY = 3
EXIT_INTERRUPTED = 130  # the shell's code for Ctrl-C


class UsageError(CommandError):
    """Options that parse but do not go together (--since after --until)."""

    def __init__(self, message):
        super().__init__(message, returncode=EXIT_USAGE)


class Busy(CommandError):
    """Another run holds what the command needs; running it again later is the answer."""

    def __init__(self, message):
        super().__init__(message, returncode=EXIT_BUSY)


def as_json(document):
    # DRF's encoder: times as the REST API writes them (ISO 8601, 'Z').
    return json.dumps(document, cls=JSONEncoder, ensure_ascii=False)


class ReportCommand(BaseCommand):
    """A command with --json, its exit codes, -v and progress (the module's docstring).

    Subclasses implement `report(*args, **options)` returning the JSON document (a dict, or
    None when the command printed its output itself) and `render(result)` for the text output;
    `json_help` says what the document holds.
    """

    json_help = "print the result as one JSON object"
    # False for a command whose output is a stream of JSON lines already (listen).
    json_flag = True

    def create_parser(self, prog_name, subcommand, **kwargs):
        parser = super().create_parser(prog_name, subcommand, **kwargs)
        if self.json_flag:
            parser.add_argument("--json", action="store_true", help=self.json_help)
        self._name = subcommand
        return parser

    def execute(self, *args, **options):
        self.verbosity = options.get("verbosity", 1)
        self.json = options.get("json", False)
        return super().execute(*args, **options)

    def handle(self, *args, **options):
        result = self.report(*args, **options)
        if result is None:
            return
        if self.json:
            self.stdout.write(as_json(result))
        else:
            self.render(result)

    def report(self, *args, **options):
        raise NotImplementedError

    def render(self, result):
        """The text output; by default the document itself."""
        self.stdout.write(as_json(result))

    # --- output by verbosity ------------------------------------------------------------------

    def say(self, line):
        """A summary for people on stdout: not with --json (stdout holds the document) nor -v 0."""
        if not self.json and self.verbosity >= 1:
            self.stdout.write(line)

    def note(self, line, level=1):
        """A remark on stderr (a warning, what a run is doing) from verbosity `level` on."""
        if self.verbosity >= level:
            self.stderr.write(line)

    def detail(self, line):
        self.note(line, level=2)

    def progress(self, desc, unit="steps", total=None):
        return Progress(self.stderr, desc=desc, unit=unit, total=total, verbosity=self.verbosity)

    # --- errors as exit codes ----------------------------------------------------------------

    def run_from_argv(self, argv):
        """Django's, with every failure one line on stderr and its exit code."""
        self._called_from_command_line = True
        self._name = argv[1]
        parser = self.create_parser(argv[0], argv[1])
        options = parser.parse_args(argv[2:])  # a bad command line exits 2 here (argparse)
        cmd_options = vars(options)
        args = cmd_options.pop("args", ())
        handle_default_options(options)
        try:
            self.execute(*args, **cmd_options)
        except SystemCheckError as exc:
            if options.traceback:
                raise
            self.stderr.write(str(exc), lambda x: x)  # formats itself
            sys.exit(exc.returncode)
        except CommandError as exc:
            if options.traceback:
                raise
            self._fail(f"{'busy' if exc.returncode == EXIT_BUSY else 'error'}: {exc}", exc.returncode)
        except KeyboardInterrupt:
            self._fail("interrupted", EXIT_INTERRUPTED)
        except Exception as exc:
            if options.traceback:
                raise
            self._fail(f"error: {describe(exc)} (--traceback shows where)", EXIT_ERROR)
        finally:
            try:
                connections.close_all()
            except ImproperlyConfigured:  # settings never loaded
                pass

    def _fail(self, text, code):
        sys.stderr.write(f"manage.py {self._name}: {text}\n")
        sys.exit(code)


def describe(exc):
    """One line for an unexpected failure."""
    first = (str(exc).strip().splitlines() or [""])[0]
    if isinstance(exc, DatabaseError):
        # Unreachable, or not migrated (`no such table`, `relation ... does not exist`).
        return f"the database: {first or type(exc).__name__}"
    return f"{type(exc).__name__}: {first}" if first else type(exc).__name__


class Progress:
    """The progress of a long run on stderr: a tqdm bar on a terminal, otherwise a line per
    step (logs and pipes keep lines, not carriage returns), nothing at -v 0."""

    def __init__(self, stderr, *, desc, unit, total, verbosity):
        # Django's OutputWrapper ends every write with a newline; the bar needs the raw stream.
        self.stream = getattr(stderr, "_out", stderr)
        self.desc = desc
        self.quiet = verbosity < 1
        self.started = time.monotonic()
        self.bar = None
        if not self.quiet and _isatty(self.stream):
            # Imported here: 30 ms every command (queuestats is run often) would pay otherwise.
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=desc, unit=f" {unit}", file=self.stream, dynamic_ncols=True)

    def step(self, note, n=1):
        """`n` more units done; `note` says what (the line, or the bar's tail)."""
        if self.quiet:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(note, refresh=False)
            self.bar.update(n)
            return
        self.stream.write(f"{self.desc}: {note} [{time.monotonic() - self.started:.1f} s]\n")
        self.stream.flush()

    def close(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        self.close()


def _isatty(stream):
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
