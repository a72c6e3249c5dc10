"""The files where the server keeps a secret (the SECRET_KEY of the embedded mode, the first
operator's password, the demo's tokens) are never readable by another user, not even for an
instant: another local user who opens one while it is readable keeps it open after a chmod."""

import os
import stat
import subprocess
import sys

from tests.support.servers import ROOT

# Runs in a child process under umask 022 (the usual default: files made 644), with an audit
# hook that looks at the file at every step the process takes (each open, chmod, link...) and
# notes every mode it had while it existed. Then makes the key as a start-up does.
WATCH = """
import os, stat, sys
from pathlib import Path
os.umask(0o022)
target = Path(sys.argv[1]) / "secret_key"
seen = set()
def look(event, args):
    try:
        seen.add(stat.S_IMODE(os.stat(target).st_mode))
    except OSError:
        pass
sys.addaudithook(look)
import mqsite.settings as s
s.VAR_DIR = Path(sys.argv[1])
key = s._secret_key()
look("end", ())
print(key)
print(" ".join(oct(m) for m in sorted(seen)))
"""


def child_env():
    env = {k: v for k, v in os.environ.items() if k != "SECRET_KEY"}
    return {**env, "DJANGO_SETTINGS_MODULE": "mqsite.settings"}


def test_it_makes_the_secret_key_file_private_from_its_first_moment(tmp_path):
    out = subprocess.run(
        [sys.executable, "-c", WATCH, str(tmp_path)],
        cwd=ROOT,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.splitlines()

    key, modes = out[0], out[1].split()
    assert len(key) >= 50
    assert modes == ["0o600"]  # never 0o644, however briefly
    assert (tmp_path / "secret_key").read_text().strip() == key
    assert [p.name for p in tmp_path.iterdir()] == ["secret_key"]  # no temporary file left


def test_processes_starting_together_all_read_one_whole_key(tmp_path):
    # supervisord starts the web servers and workers at once: each must read the same key (a
    # session signed by one is read by another), never a half-written one.
    script = "import sys; from pathlib import Path; import mqsite.settings as s; "
    script += "s.VAR_DIR = Path(sys.argv[1]); print(s._secret_key())"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", script, str(tmp_path)],
            cwd=ROOT,
            env=child_env(),
            stdout=subprocess.PIPE,
            text=True,
        )
        for _ in range(6)
    ]
    keys = {p.communicate(timeout=60)[0].strip() for p in procs}

    assert len(keys) == 1 and len(keys.pop()) >= 50
    assert stat.S_IMODE((tmp_path / "secret_key").stat().st_mode) == 0o600
