"""The long form of the fault run: `python -m tests.faults --messages N --minutes M`.

It makes a database of its own — in the services mode a private PostgreSQL cluster, which the
nemesis also crashes and restarts (the machine's PostgreSQL is never touched; without the
PostgreSQL binaries it uses a fresh database there and does not restart it); in the embedded
mode a SQLite file — runs once, prints the figures, writes them to var/faults/, and exits 0
only if nothing was lost, unexpected or out of order. It stops by itself: the run is bounded
by --minutes, plus at most 30 s for the last publishes and 5 minutes of drain.
"""

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import psycopg

MACHINE_PG = "postgres://postgres@127.0.0.1:5432"


def parse(argv):
    p = argparse.ArgumentParser(prog="python -m tests.faults", description=__doc__.split("\n\n")[0])
    p.add_argument("--messages", type=int, default=100_000)
    p.add_argument("--minutes", type=float, default=25)
    p.add_argument("--mode", choices=("services", "embedded"), default="services")
    p.add_argument("--seed", type=int, default=int(time.time()))
    p.add_argument("--no-postgres-restarts", action="store_true", help="do not crash PostgreSQL")
    p.add_argument("--no-faults", action="store_true", help="a baseline: the same run, no nemesis")
    p.add_argument("--faults", help="only these faults, comma-separated (see tests/faults/nemesis.py)")
    p.add_argument("--fault-interval", type=float, nargs=2, default=(5, 15), metavar=("MIN", "MAX"))
    p.add_argument("--ordered-share", type=float, default=0.05)
    return p.parse_args(argv)


def prepare_database(args, scratch):
    """Returns (DATABASE_URL, the PrivatePostgres or None, a cleanup function)."""
    from tests.faults.cluster import PrivatePostgres

    if args.mode == "embedded":
        return f"sqlite:///{scratch / 'faults.sqlite3'}", None, lambda: None
    if PrivatePostgres.available():
        pg = PrivatePostgres()
        pg.start()
        pg.create_database("mqsite_faults")
        return pg.url("mqsite_faults"), pg, pg.stop
    name = f"mqsite_faults_{os.getpid()}"
    with psycopg.connect(f"{MACHINE_PG}/postgres", autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')

    def drop():
        with psycopg.connect(f"{MACHINE_PG}/postgres", autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return f"{MACHINE_PG}/{name}", None, drop


def main(argv=None):
    args = parse(argv)
    # SIGTERM (a CI timeout, `kill`) unwinds like Ctrl-C, so the processes are stopped.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    scratch = Path(tempfile.mkdtemp(prefix="mq-faults-run-"))
    url, pg, cleanup = prepare_database(args, scratch)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    try:
        os.environ["DATABASE_URL"] = url
        os.environ.pop("REDIS_URL", None)  # the harness itself talks to the database only
        os.environ["MQ_CELERY_DIR"] = str(scratch / "celery")
        os.environ.setdefault("DJANGO_SETTINGS_MODULE", "mqsite.settings")
        import django

        django.setup()
        from django.core.management import call_command

        from tests.faults.run import Config, run, summary, workdir

        call_command("migrate", verbosity=0)
        out = workdir() / f"{args.mode}-{stamp}"
        config = Config(
            messages=args.messages,
            minutes=args.minutes,
            services=args.mode == "services",
            postgres=None if args.no_postgres_restarts else pg,
            ordered_share=args.ordered_share,
            nemesis_interval_secs=tuple(args.fault_interval),
            drain_share=0.15,
            # An ordered subscription drains one message per round trip (the head, then the
            # next): a pull client behind by hundreds needs minutes under load.
            min_drain_secs=300,
            seed=args.seed,
            history_path=f"{out}-history.jsonl",
            faults=() if args.no_faults else tuple(args.faults.split(",")) if args.faults else None,
            extra_env={"MQ_CELERY_DIR": str(scratch / "celery")},
        )
        print(
            f"fault run: {args.mode} mode, {args.messages} messages, {args.minutes} minutes, seed {args.seed}"
        )
        sys.stdout.flush()
        result = run(config)
    finally:
        if pg is not None and pg.log.exists():
            shutil.copy(
                pg.log, Path(__file__).resolve().parents[2] / "var" / "faults" / f"{stamp}-postgres.log"
            )
        cleanup()
    text = summary(result)
    print(text)
    result["report"] = result["report"].as_dict()
    result["seed"] = args.seed
    result["command"] = "python -m tests.faults " + " ".join(sys.argv[1:] if argv is None else argv)
    Path(f"{out}.json").write_text(json.dumps(result, indent=2, default=str))
    print(f"written: {out}.json (history: {out}-history.jsonl)")
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
