"""The programs `make run` starts (mqsite/supervisord.conf), as command lines, for what starts
them outside supervisord (the tests, the benchmarks): so that they run what production runs."""

import configparser
import shlex
from pathlib import Path

CONF = Path(__file__).with_name("supervisord.conf")


def programs():
    """{name: argv} of each [program:NAME] and [fcgi-program:NAME], its %(here)s resolved,
    without the `setpriv --pdeathsig SIGNAL` that makes it die with supervisord: a caller that
    is not supervisord stops what it starts itself."""
    conf = configparser.ConfigParser(interpolation=None)
    conf.read(CONF)
    out = {}
    for section in conf.sections():
        kind, _, name = section.partition(":")
        if kind not in ("program", "fcgi-program"):
            continue
        command = conf[section].get("command", "").replace("%(here)s", str(CONF.parent)).replace("%%", "%")
        args = shlex.split(command)
        if args[:2] == ["setpriv", "--pdeathsig"]:
            args = args[3:]
        out[name] = args
    return out
