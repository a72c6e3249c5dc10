"""Publish-to-receive latency over websockets at a steady rate. Run with `make bench`.

One subscriber holds a live websocket to the real server (Daphne) and acks what it gets; a
publisher sends RATE messages a second for SECONDS seconds, each with its send time in the
payload. The subscriber's clock is the same (time.monotonic, same process), so receive minus
send is the latency. Two ways of running:

- embedded: a new SQLite file, no Redis (the in-memory channel layer), ONE Daphne process
  serving both the publisher and the subscriber;
- services: PostgreSQL (`mqsite_wsbench`, dropped and made again) and Redis (db 9, flushed),
  TWO Daphne processes: the publisher talks to one, the subscriber to the other, so every
  wake-up crosses Redis.

Two publishers: `rest` (POST /api/queues/bench/messages, one after the other on one keep-alive
connection: a slow answer delays the next send) and `ws` (`publish` frames on a websocket of
its own, sent on schedule without waiting for the `published` answers).

Every run must deliver every message exactly once, every publish must succeed, and
`queuestats` must count them all acked. Prints a Markdown table and writes
bench/results/ws_latency-<UTC time>.json.
"""

import argparse
import json
import math
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from contextlib import nullcontext
from datetime import UTC, datetime
from pathlib import Path

import redis
from harness import (  # bench/, the script's own directory, is first on sys.path
    PAYLOAD_BYTES,
    RESULTS,
    ROOT,
    Client,
    fresh_database,
    git,
    machine,
    manage,
    message,
    provision,
    server,
)
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

PG_DB = "mqsite_wsbench"
REDIS_URL = "redis://127.0.0.1:6379/9"
RATE = 200  # messages per second
SECONDS = 10  # of publishing: RATE * SECONDS messages are measured
WARMUP = 20  # messages sent (at RATE) and received before the measured ones; not counted
ACK_EVERY = 0.005  # the subscriber acks what it got at most this many seconds later
PUBLISH_LIMIT = 120.0  # seconds: a publisher that cannot keep the rate stops after this long
DRAIN_LIMIT = 120.0  # seconds after the last publish for the answers and deliveries to come
CONNECT_LIMIT = 30.0  # seconds to connect and get "subscribed"
MODES = ("embedded", "services")
PUBLISHERS = ("rest", "ws")


class Subscriber(threading.Thread):
    """One websocket, subscribed to `bench`; records (phase, i, sent, received, delivery id,
    attempt) for every message frame and acks in batches of what arrived within ACK_EVERY."""

    def __init__(self, url):
        super().__init__(daemon=True)
        self.url = url
        self.ready, self.stopping = threading.Event(), threading.Event()
        self.received, self.other_frames, self.error, self.acks_sent = [], [], None, 0

    def count(self, phase):
        return sum(1 for r in self.received if r[0] == phase)

    def run(self):
        try:
            with connect(self.url, open_timeout=10, close_timeout=5, max_size=None) as ws:
                ws.send(json.dumps({"type": "subscribe", "queue": "bench"}))
                deadline = time.monotonic() + CONNECT_LIMIT
                while True:
                    frame = json.loads(ws.recv(timeout=max(deadline - time.monotonic(), 0.01)))
                    if frame.get("type") == "subscribed":
                        break
                    self.other_frames.append(frame)
                self.ready.set()
                self.loop(ws)
        except Exception as exc:  # reported in the results; the run then fails its check
            self.error = repr(exc)
        finally:
            self.ready.set()

    def loop(self, ws):
        unacked, first_unacked = [], 0.0
        while not self.stopping.is_set():
            wait = max(first_unacked + ACK_EVERY - time.monotonic(), 0) if unacked else 0.05
            try:
                raw = ws.recv(timeout=wait)
            except TimeoutError:
                raw = None
            now = time.monotonic()  # the receive time: before any parsing
            if raw is not None:
                frame = json.loads(raw)
                if frame.get("type") == "message":
                    p = frame["payload"]
                    self.received.append((p["phase"], p["i"], p["sent"], now, frame["id"], frame["attempt"]))
                    if not unacked:
                        first_unacked = now
                    unacked.append(frame["id"])
                else:
                    self.other_frames.append(frame)
            if unacked and (raw is None or now - first_unacked >= ACK_EVERY):
                ws.send(json.dumps({"type": "ack", "ids": unacked}))
                self.acks_sent += 1
                unacked = []
        if unacked:
            ws.send(json.dumps({"type": "ack", "ids": unacked}))
            self.acks_sent += 1


def paced(count, rate):
    """Yield (i, due) on schedule: sleep until message i is due (t0 + i/rate), or at once when
    behind; stop early after PUBLISH_LIMIT seconds."""
    t0 = time.monotonic()
    for i in range(count):
        due = t0 + i / rate
        now = time.monotonic()
        if now < due:
            time.sleep(due - now)
        elif now - t0 > PUBLISH_LIMIT:
            return
        yield i, due


def publish_rest(port, token, phase, count, rate):
    """POST each message on one keep-alive connection. Returns per message (due, sent, answered)
    and the error answers."""
    client, timings, errors = Client(port, token), [], []
    try:
        for i, due in paced(count, rate):
            sent = time.monotonic()
            status, body = client.request(
                "POST", "/api/queues/bench/messages", message(i, phase=phase, sent=sent)
            )
            timings.append((due, sent, time.monotonic()))
            if status != 201:
                errors.append(f"{status}: {body[:200].decode(errors='replace')}")
    finally:
        client.close()
    return timings, errors


def publish_ws(port, token, phase, count, rate):
    """Send `publish` frames on schedule on one websocket; a reader thread takes the answers."""
    timings, answered, errors = [], {}, []
    with connect(f"ws://127.0.0.1:{port}/ws/?token={token}", open_timeout=10, close_timeout=5) as ws:

        def read():
            try:
                while len(answered) + len(errors) < len(timings) or not sending_done.is_set():
                    frame = json.loads(ws.recv(timeout=DRAIN_LIMIT))
                    if frame.get("type") == "published":
                        answered[frame["ref"]] = time.monotonic()
                    else:
                        errors.append(json.dumps(frame)[:200])
            except Exception as exc:
                errors.append(f"reader: {exc!r}")

        sending_done = threading.Event()
        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            for i, due in paced(count, rate):
                sent = time.monotonic()
                msg = message(i, phase=phase, sent=sent)
                ws.send(json.dumps({"type": "publish", "queue": "bench", **msg, "ref": i}))
                timings.append((due, sent))
        except ConnectionClosed as exc:  # the run goes on with what was sent, and fails its check
            errors.append(f"the server closed the publisher's socket after {len(timings)} frames: {exc}")
        finally:
            sending_done.set()
        reader.join(DRAIN_LIMIT + 1)
    missing = len(timings) - len(answered)
    if missing:
        errors.append(f"{missing} publish frames were not answered 'published'")
    return [(due, sent, answered.get(i)) for i, (due, sent) in enumerate(timings)], errors


def percentiles(values):
    """Nearest-rank p50, p95, p99, max and the mean, in ms."""
    if not values:
        return None
    s = sorted(values)

    def rank(p):
        return s[max(math.ceil(p / 100 * len(s)) - 1, 0)]

    out = {f"p{p}": rank(p) for p in (50, 95, 99)}
    out |= {"max": s[-1], "min": s[0], "mean": sum(s) / len(s)}
    return {k: round(v * 1000, 2) for k, v in out.items()}


def queue_stats(env):
    rows = [r for r in json.loads(manage(env, "queuestats", "--json"))["queues"] if r["queue"] == "bench"]
    keys = ("published", "pending", "inflight", "acked", "dead")
    return {k: sum(r[k] for r in rows) for k in keys}


def wait_until(check, limit, step=0.05):
    deadline = time.monotonic() + limit
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(step)
    return True


def run(mode, publisher, rate, seconds):
    """One mode with one publisher, on a fresh database and fresh servers. The database and
    the server logs stay in /tmp/mqwsbench-* when something failed."""
    workdir = Path(tempfile.mkdtemp(prefix="mqwsbench-"))
    print(f"{mode} / {publisher}: {workdir}")
    try:
        result = measure(mode, publisher, rate, seconds, workdir)
    except Exception as exc:  # recorded; the other runs go on
        result = {
            "mode": mode,
            "publisher": publisher,
            "error": f"{exc.__class__.__name__}: {exc}",
            "ok": False,
        }
        print(f"  failed: {result['error']}")
    if result["ok"]:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"  FAILED {result.get('checks', '')}; kept the database and server logs in {workdir}")
        result["kept"] = str(workdir)
    return result


def measure(mode, publisher, rate, seconds, workdir):
    total = rate * seconds
    env = {**os.environ, "MQ_THROTTLE_RATE": "1000000/s", "DEBUG": "false"}
    if mode == "embedded":
        env["DATABASE_URL"], db_version = fresh_database("sqlite", workdir, None)
        env.pop("REDIS_URL", None)  # the in-memory channel layer
    else:
        env["DATABASE_URL"], db_version = fresh_database("postgresql", workdir, PG_DB)
        env["REDIS_URL"] = REDIS_URL
        redis.Redis.from_url(REDIS_URL, socket_timeout=5).flushdb()
    manage(env, "migrate", "--noinput")
    sub_token = provision(env)  # `bencher`: publishes to and subscribes to every queue
    # The publisher is a subscriber of its own that subscribes to nothing: a websocket of
    # `bencher` itself would share bencher's deliveries with the measuring socket.
    pub_token = manage(env, "createsubscriber", "benchpub", "--publish", "bench").strip().splitlines()[-1]
    publish = publish_rest if publisher == "rest" else publish_ws
    result = {"mode": mode, "publisher": publisher, "rate": rate, "target": total, "db_version": db_version}
    stats = {}
    with server(env, workdir / "daphne-1.log") as port1:
        second = server(env, workdir / "daphne-2.log") if mode == "services" else nullcontext(port1)
        with second as port2:
            sub = Subscriber(f"ws://127.0.0.1:{port2}/ws/?token={sub_token}")
            sub.start()
            try:
                if not sub.ready.wait(CONNECT_LIMIT + 15) or sub.error:
                    raise RuntimeError(f"the subscriber did not subscribe: {sub.error}")
                _, warm_errors = publish(port1, pub_token, "warmup", WARMUP, rate)
                wait_until(lambda: sub.count("warmup") >= WARMUP or not sub.is_alive(), DRAIN_LIMIT)
                timings, errors = publish(port1, pub_token, "measured", total, rate)
                wait_until(lambda: sub.count("measured") >= len(timings) or not sub.is_alive(), DRAIN_LIMIT)
                drained = time.monotonic()
            finally:
                sub.stopping.set()
                sub.join(10)
            # The server writes acks after the socket sent them: wait until it counts every
            # message the subscriber got (and acked) as acked.
            got = len({r[:2] for r in sub.received})

            def all_acked():
                stats.update(queue_stats(env))
                return stats["acked"] >= got

            wait_until(all_acked, 30, step=0.5)
    result |= summarise(timings, errors + warm_errors, sub, total, drained)
    result["queuestats"] = stats
    result["loadavg_after"] = os.getloadavg()  # other work on the machine skews the numbers
    checks = {
        "all_published": len(timings) == total and not result["publish_error_count"],
        "all_received_once": result["received"] == total and result["duplicates"] == 0,
        "subscriber_ok": sub.error is None and not sub.other_frames,
        "db_all_acked": stats.get("published") == WARMUP + total == stats.get("acked"),
    }
    result["checks"], result["ok"] = checks, all(checks.values())
    lat = result["latency_ms"] or {}
    print(
        f"  received {result['received']} of {total}, p50 {lat.get('p50')} ms, p99 {lat.get('p99')} ms, "
        f"max {lat.get('max')} ms, published at {result['publish_rate']}/s, ok={result['ok']}"
    )
    return result


def summarise(timings, errors, sub, total, drained):
    got = [r for r in sub.received if r[0] == "measured"]
    first = {}
    for r in got:
        first.setdefault(r[1], r)
    latencies = [r[3] - r[2] for r in first.values()]
    sends = [t[1] for t in timings]
    answers = [t[2] - t[1] for t in timings if t[2] is not None]
    lag = [t[1] - t[0] for t in timings]
    span = sends[-1] - sends[0] if len(sends) > 1 else 0
    # Latency second by second of sending: a backlog that builds up shows as a rising p50.
    timeline = []
    for second in range(math.ceil(span) + 1 if sends else 0):
        window = [r[3] - r[2] for r in first.values() if second <= r[2] - sends[0] < second + 1]
        if window:
            p = percentiles(window)
            timeline.append({"second": second, "messages": len(window), "p50": p["p50"], "max": p["max"]})
    return {
        "published": len(timings),
        "publish_seconds": round(span, 3),
        "publish_rate": round((len(sends) - 1) / span, 1) if span else None,
        "publish_errors": errors[:5],
        "publish_error_count": len(errors),
        # How late sends were against the schedule: a slow REST answer delays the next send.
        "behind_schedule_ms": percentiles(lag),
        "publish_answer_ms": percentiles(answers),
        "received": len(first),
        # What the server delivered per second, from the first send to the last receive: below
        # the publish rate, a backlog builds up and the latency grows with it.
        "delivered_rate": round(len(first) / (max(r[3] for r in first.values()) - sends[0]), 1)
        if first
        else None,
        "duplicates": len(got) - len(first),
        "redelivered": sum(1 for r in got if r[5] > 1),
        "missing": sorted(set(range(total)) - first.keys())[:20],
        "drain_seconds_after_last_send": round(drained - sends[-1], 3) if sends else None,
        "latency_ms": percentiles(latencies),
        "timeline": timeline,
        "ack_frames": sub.acks_sent,
        "subscriber_error": sub.error,
        "other_frames": sub.other_frames[:5],
    }


def table(rows):
    lines = [
        "| mode | publisher | received | published /s | delivered /s | p50 ms | p95 ms | p99 ms | max ms "
        "| publish answer p50 ms | load after |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['mode']} | {r['publisher']} | failed: {r['error'][:60]} |" + " |" * 8)
            continue
        lat, ans = r["latency_ms"] or {}, r["publish_answer_ms"] or {}
        cells = [r["mode"], r["publisher"], f"{r['received']} of {r['target']}", str(r["publish_rate"])]
        cells += [str(r["delivered_rate"])] + [str(lat.get(k)) for k in ("p50", "p95", "p99", "max")]
        cells += [str(ans.get("p50")), f"{r['loadavg_after'][0]:.1f}"]
        lines.append(f"| {' | '.join(cells)} |")
    return "\n".join(lines)


def versions():
    out = {}
    try:
        out["redis"] = redis.Redis.from_url(REDIS_URL, socket_timeout=5).info("server")["redis_version"]
    except redis.RedisError as exc:
        out["redis"] = f"unavailable: {exc}"
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--publishers", nargs="+", choices=PUBLISHERS, default=list(PUBLISHERS))
    parser.add_argument("--rate", type=int, default=RATE)
    parser.add_argument("--seconds", type=int, default=SECONDS)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that the servers are stopped
    # Four client threads share the GIL: switch often, so one does not delay another's receive.
    sys.setswitchinterval(0.0005)
    now, host = datetime.now(UTC), machine()
    rows = []
    for mode in args.modes:
        for publisher in args.publishers:
            rows.append(run(mode, publisher, args.rate, args.seconds))

    print()
    print(table(rows))
    result = {
        "benchmark": "ws_latency",
        "date": now.isoformat(timespec="seconds"),
        "git_commit": git("rev-parse", "HEAD"),
        "git_dirty": bool(git("status", "--porcelain", "--untracked-files=no")),
        "machine": host,
        "versions": versions(),
        "rate": args.rate,
        "seconds": args.seconds,
        "payload_bytes": PAYLOAD_BYTES,
        "warmup_messages": WARMUP,
        "ack_every_ms": ACK_EVERY * 1000,
        "results": rows,
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"ws_latency-{now.strftime('%Y%m%dT%H%M%SZ')}.json"
    path.write_text(json.dumps(result, indent=2) + "\n")
    print(f"\nmachine: {result['machine']}\nwritten: {path.relative_to(ROOT)}")
    if not all(r["ok"] for r in rows):
        sys.exit("FAILED: a message was lost, duplicated or not acked, or a publish failed")


if __name__ == "__main__":
    main()
