"""The SQLite backend's writer lock (mqsite/workarounds/sqlite): within a process, a write
transaction that waits for another starts as soon as that one commits, not after SQLite's
busy-handler sleeps."""

import threading
import time

from django.db.utils import ConnectionHandler

HOLD_SECS = 0.3


def test_a_waiting_write_transaction_starts_as_soon_as_the_one_before_commits(tmp_path, django_db_blocker):
    # A database of its own (not the test database): the same on either test pass.
    # Best of three: on a loaded machine one thread's wake-up can take a few ms, while SQLite's
    # busy handler, whose steps line up the same way each time, would be late in all three.
    with django_db_blocker.unblock():
        waits = [_race(tmp_path / f"writer{n}.sqlite3") for n in range(3)]
    # SQLite's own busy handler would have slept in steps of 25 to 100 ms by now.
    assert min(waits) < 0.01, waits


def _race(path):
    handler = ConnectionHandler(
        {
            "default": {
                "ENGINE": "mqsite.workarounds.sqlite",
                "NAME": str(path),
                "OPTIONS": {"transaction_mode": "IMMEDIATE", "timeout": 30},
            }
        }
    )
    with handler["default"].cursor() as cursor:
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("CREATE TABLE t (n INTEGER)")
    handler["default"].close()
    committed, began = [], []
    first_in = threading.Event()

    def write(n, hold, times):
        connection = handler["default"]  # one per thread
        connection.set_autocommit(False, force_begin_transaction_with_broken_autocommit=True)
        began.append(time.monotonic())
        first_in.set()
        with connection.cursor() as cursor:
            cursor.execute("INSERT INTO t VALUES (%s)", [n])
        time.sleep(hold)
        connection.commit()
        times.append(time.monotonic())
        connection.set_autocommit(True)
        connection.close()

    first = threading.Thread(target=write, args=(1, HOLD_SECS, committed))
    first.start()
    first_in.wait(5)
    second = threading.Thread(target=write, args=(2, 0, []))
    second.start()
    first.join(10)
    second.join(10)
    assert len(began) == 2 and committed
    with handler["default"].cursor() as cursor:
        cursor.execute("SELECT n FROM t ORDER BY n")
        assert cursor.fetchall() == [(1,), (2,)]
    handler.close_all()
    return began[1] - committed[0]
