"""Fault injection: real processes on loopback, a nemesis, and a checker of what arrived.

history.py   what was published (the 201/200 answers) and every delivery received
checker.py   per subscription: lost, unexpected, duplicated, out of order
cluster.py   the processes: PostgreSQL (a private cluster when it can), Redis, Daphne, workers
nemesis.py   kills, restarts and drops, one fault at a time, on a schedule
workload.py  publishers, and websocket, webhook and pull subscribers
run.py       puts them together for one bounded run; `python -m tests.faults` (the long form)
             and tests/e2e/test_faults.py (the short form) call it
"""
