"""Files that hold a secret (the SECRET_KEY, the first operator's password, the demo's tokens):
made readable by their owner only from the moment they exist, whatever the umask. A file
written first and chmod-ed after could be opened by another user in between, and an open file
stays readable after the chmod."""

import os
import tempfile
from pathlib import Path

PRIVATE_MODE = 0o600


def write_private(path, text):
    """Write `text` to `path`, made or replaced with mode 600 (never readable by others)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, PRIVATE_MODE)
    os.fchmod(fd, PRIVATE_MODE)  # O_CREAT's mode does not apply to a file that existed already
    with os.fdopen(fd, "w") as f:
        f.write(text)


def read_or_create_private(path, make):
    """The text of `path`; when it does not exist, `make()` written there first, mode 600.

    Processes started together (supervisord starts the web servers and workers at once) must
    all read the same text: each writes a private temporary file whole, then links it into
    place, which fails if another was first; so no process ever reads a half-written file."""
    path = Path(path)
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")  # mode 600
        try:
            with os.fdopen(fd, "w") as f:
                f.write(make())
            try:
                os.link(tmp, path)
            except FileExistsError:
                pass  # another process made it first: use theirs
        finally:
            os.unlink(tmp)
    return path.read_text().strip()
