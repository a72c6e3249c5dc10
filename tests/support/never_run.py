"""Fail when a test was skipped by every pass of `make test`: each pass may leave a test to
another (tests/conftest.py, a module's own skipif), and two such rules can each leave it to the
other, so that it never runs and its failures hide. Reads the passes' JUnit reports.

    python tests/support/never_run.py DIR     # DIR/<pass>.xml, as run_pass.sh writes them
"""

import sys
import xml.etree.ElementTree as ET
from pathlib import Path


def never_run(folder):
    """{(module, test): [the reasons each pass gave]} of the tests no pass ran."""
    ran, skipped = set(), {}
    for report in sorted(Path(folder).glob("*.xml")):
        # pytest's own reports of this run, not untrusted input.
        for case in ET.parse(report).iter("testcase"):  # noqa: S314
            key = (case.get("classname"), case.get("name"))
            skip = case.find("skipped")
            if skip is None:
                ran.add(key)
            else:
                skipped.setdefault(key, []).append(f"{report.stem}: {skip.get('message', '')}")
    return {key: reasons for key, reasons in skipped.items() if key not in ran}


def main(folder):
    if not list(Path(folder).glob("*.xml")):
        print(f"never_run: no JUnit report in {folder}", file=sys.stderr)
        return 1
    missed = never_run(folder)
    for (module, test), reasons in sorted(missed.items()):
        print(f"never run: {module}::{test}", file=sys.stderr)
        for reason in reasons:
            print(f"    skipped by {reason}", file=sys.stderr)
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
