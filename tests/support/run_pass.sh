#!/usr/bin/env bash
# One pass of the suite (the Makefile's test-* targets): run_pass.sh sqlite|postgres NAME [pytest args]
#
# `make test` runs several passes at once, so each has what it writes to of its own: its test
# database (a SQLite file, or a PostgreSQL database dropped afterwards), its job folder (the
# embedded mode's broker, MQ_CELERY_DIR) and its Redis (MQ_TEST_REDIS: a private redis-server
# on a free port, or the machine's own when REDIS=machine). Exits with pytest's status.
set -u
backend=$1 name=$2
shift 2
bin=${BIN:-.venv/bin}
id="$name-$$"
# MQ_TEST_REPORTS=DIR: each pass also writes a JUnit XML report there (every test's time).
if [ -n "${MQ_TEST_REPORTS:-}" ]; then
    mkdir -p "$MQ_TEST_REPORTS"
    set -- --junitxml="$MQ_TEST_REPORTS/$name.xml" "$@"
fi
export MQ_CELERY_DIR="var/celery-test-$id"

cleanup() {
    [ -n "${redis_pid:-}" ] && kill "$redis_pid" 2>/dev/null
    rm -rf "$MQ_CELERY_DIR" "var/test-$id.sqlite3"*
}
trap cleanup EXIT

if [ "${REDIS:-private}" = machine ]; then
    export MQ_TEST_REDIS=redis://127.0.0.1:6379
else
    port=$("$bin/python" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no >/dev/null &
    redis_pid=$!
    export MQ_TEST_REDIS="redis://127.0.0.1:$port"
fi

if [ "$backend" = sqlite ]; then
    unset DATABASE_URL
    export MQ_TEST_SQLITE="var/test-$id.sqlite3"
    "$bin/pytest" -q --create-db --durations=10 "$@"
    exit $?
fi

# pytest-django cannot drop its database while a connection of a child process lingers (it
# warns and leaves it): drop it here, keeping pytest's exit status.
server=${PG_SERVER:-postgres://postgres@127.0.0.1:5432}
db="mqsite_${id//-/_}"
DATABASE_URL="$server/$db" "$bin/pytest" -q --create-db --durations=10 "$@"
status=$?
psql "$server/postgres" -qc "DROP DATABASE IF EXISTS \"test_$db\" WITH (FORCE)" >/dev/null 2>&1
exit $status
