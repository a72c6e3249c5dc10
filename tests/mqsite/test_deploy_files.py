"""The deployment files (deploy/) as far as this machine can check them without systemd running
or a Docker daemon (docs/deploy.md says what is not): systemd's own verifier on the units, and
that the units, the image and the compose file run what `make run` runs (mqsite/supervisord.conf)
and that the nginx site's limits fit the server's. tests/e2e/test_nginx.py runs the site itself."""

import re
import shlex
import shutil
import subprocess
from pathlib import Path

import yaml
from django.conf import settings

from delivery.bounds import MAX_WAIT_SECS
from mqsite import run_programs
from tests.support.servers import ROOT

DEPLOY = ROOT / "deploy"
UNITS = sorted((DEPLOY / "systemd").iterdir())
# No skip when it is missing: `make test` installs it (the Makefile's test tools).
SYSTEMD_ANALYZE = shutil.which("systemd-analyze") or "systemd-analyze"


def exec_start(unit):
    (line,) = [x for x in (DEPLOY / "systemd" / unit).read_text().splitlines() if x.startswith("ExecStart=")]
    return shlex.split(line.removeprefix("ExecStart=").replace("%%", "%"))


def compose_services():
    return yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]


def image_command():
    """The Dockerfile's CMD: `sh -c "exec daphne ..."`, as the argv the shell runs."""
    (line,) = [x for x in (DEPLOY / "Dockerfile").read_text().splitlines() if x.startswith("CMD ")]
    shell = yaml.safe_load(line.removeprefix("CMD "))  # a JSON array
    assert shell[:2] == ["sh", "-c"]
    return shlex.split(shell[2].removeprefix("exec "))


def essence(argv):
    """A command line less what differs by where it runs: the program's folder, the listening
    socket (supervisord's fd 0, systemd's fd 3, a container's address and port), the beat
    schedule file's place, and beat embedded in a worker (make run's, until beat runs alone)."""
    out, args = [argv[0].rsplit("/", 1)[-1]], iter(argv[1:])
    for arg in args:
        if arg in ("--fd", "-b", "-p", "-s"):
            next(args)
        elif arg != "-B":
            out.append(arg)
    return out


def test_systemd_verifies_the_units(tmp_path):
    # The units as installed, but pointing at this checkout (its .venv's programs must exist)
    # and at an environment file of the test's
    env_file = tmp_path / "mqsite.env"
    env_file.write_text("")
    for unit in UNITS:
        text = unit.read_text().replace("/opt/mqsite", str(ROOT))
        (tmp_path / unit.name).write_text(text.replace("/etc/mqsite/mqsite.env", str(env_file)))
    names = [u.name.replace("@.service", "@1.service") for u in UNITS]
    done = subprocess.run(
        [SYSTEMD_ANALYZE, "verify", *names], cwd=tmp_path, capture_output=True, text=True, timeout=60
    )
    assert (done.returncode, done.stdout + done.stderr) == (0, "")


def test_the_units_and_the_containers_run_what_make_run_runs():
    programs = {name: essence(argv) for name, argv in run_programs.programs().items()}
    services = compose_services()
    assert essence(exec_start("mqsite-web@.service")) == programs["web"]
    assert essence(image_command()) == programs["web"]
    for unit, program in [("webhooks", "worker"), ("maintenance", "maintenance"), ("analytics", "analytics")]:
        assert essence(exec_start(f"mqsite-{unit}.service")) == programs[program], unit
        assert essence(services[unit]["command"]) == programs[program], unit
    # One beat, on its own, the same in both; make run's own when it runs beat alone
    beat = essence(exec_start("mqsite-beat.service"))
    assert beat[:4] == ["celery", "-q", "-A", "mqsite"] and beat[4] == "beat"
    assert essence(services["beat"]["command"]) == beat
    assert programs.get("beat", beat) == beat
    assert services["beat"]["deploy"]["replicas"] == 1
    assert not any("-B" in exec_start(u.name) for u in UNITS if u.suffix == ".service")


def test_the_nginx_site_fits_the_servers_limits():
    site = (DEPLOY / "nginx" / "mqsite.conf").read_text()
    # it proxies to where the web processes listen: the socket unit, and compose's published port
    (upstream,) = re.findall(r"^\s*server (\S+);", site, re.MULTILINE)
    socket_unit = (DEPLOY / "systemd" / "mqsite-web.socket").read_text()
    assert f"ListenStream={upstream}\n" in socket_unit
    assert f"{upstream}:8000" in compose_services()["web"]["ports"]
    (size,) = re.findall(r"client_max_body_size (\d+)m;", site)
    assert int(size) * 1024 * 1024 == settings.MQ_MAX_BODY_BYTES  # the default's
    web = run_programs.programs()["web"]
    ping = int(web[web.index("--ping-interval") + 1])
    (read_timeout,) = re.findall(r"proxy_read_timeout (\d+)s;", site)
    # a quiet websocket (pinged) and a long poll (answered within MAX_WAIT_SECS) outlive it
    assert int(read_timeout) > max(ping, MAX_WAIT_SECS) + 10
    # /static/ is served from where collectstatic puts the files by default (var/static of the
    # checkout, /opt/mqsite in the site file)
    assert f"location {settings.STATIC_URL} {{" in site
    (root,) = re.findall(r"root /opt/mqsite/(\S+);", site)
    default_static_root = (settings.VAR_DIR / "static").relative_to(settings.BASE_DIR)
    assert Path(root) / settings.STATIC_URL.strip("/") == default_static_root
