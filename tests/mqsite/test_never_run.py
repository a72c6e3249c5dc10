"""`make test` fails when a test is skipped by every pass (tests/support/never_run.py), so that
two rules that each leave a test to the other pass cannot hide it."""

from tests.support import never_run

CASE = '<testcase classname="tests.x" name="{name}">{body}</testcase>'
SKIP = '<skipped message="{why}"/>'


def report(folder, name, cases):
    body = "".join(CASE.format(name=n, body=SKIP.format(why=why) if why else "") for n, why in cases)
    xml = f'<testsuites><testsuite name="pytest">{body}</testsuite></testsuites>'
    (folder / f"{name}.xml").write_text(xml)


def test_a_test_every_pass_skipped_is_named_with_each_reason(tmp_path, capsys):
    report(tmp_path, "sqlite-rest", [("test_left", "the PostgreSQL pass runs it"), ("test_both", None)])
    report(tmp_path, "postgres-rest", [("test_left", "the SQLite pass runs it"), ("test_both", None)])
    assert never_run.main(tmp_path) == 1
    err = capsys.readouterr().err
    assert "never run: tests.x::test_left" in err
    assert "postgres-rest: the SQLite pass runs it" in err
    assert "sqlite-rest: the PostgreSQL pass runs it" in err
    assert "test_both" not in err


def test_a_test_one_pass_ran_passes(tmp_path):
    report(tmp_path, "sqlite-rest", [("test_here", None)])
    report(tmp_path, "postgres-rest", [("test_here", "no database in it: the SQLite pass runs it")])
    assert never_run.main(tmp_path) == 0


def test_no_reports_is_a_failure_not_a_pass(tmp_path):
    assert never_run.main(tmp_path) == 1
