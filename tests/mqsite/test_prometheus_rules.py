"""The operations manual's Prometheus alert rules (docs/operations/prometheus-rules.yml) are
valid rules, and alert when they should: promtool's own check and the unit tests of
prometheus-rules.test.yml (the p95 latency above 2 s for 5 minutes, no live worker, new dead
letters, a disabled webhook scraped on two machines). That every metric they name is on a real
scrape is tests/e2e/test_metrics_histograms.py's."""

import re
import shutil
import subprocess
from pathlib import Path

import pytest

OPERATIONS = Path(__file__).resolve().parents[2] / "docs" / "operations"


@pytest.fixture(scope="module")
def promtool():
    found = shutil.which("promtool")
    assert found, "promtool is missing: apt-get install prometheus (make test installs it)"
    return found


def run(promtool, *args):
    done = subprocess.run([promtool, *args], cwd=OPERATIONS, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout


def test_the_rules_file_is_valid(promtool):
    assert re.search(r"SUCCESS: \d+ rules found", run(promtool, "check", "rules", "prometheus-rules.yml"))


def test_the_alerts_fire_when_they_should_and_not_before(promtool):
    assert "SUCCESS" in run(promtool, "test", "rules", "prometheus-rules.test.yml")
