"""The comparison's workloads, W1a to W7, and the drivers that run them against any system: a
peer of systems.py or this server (ours.py). Each system gives them prepare, publisher,
stored and unacked (systems.py's docstring).

A 200-byte JSON payload; each run stops at its size or after `limit` seconds:

  W1a    publish one at a time, each waiting for its confirm (201 for us)       20,000 messages
  W1a-8  W1a from 8 clients at once, each one at a time (ours over REST only)   20,000 messages
  W1b    publish in batches of 100, each batch confirmed                        20,000 messages
  W2     fan-out: 1 publisher, 10 subscribers each acking every message          5,000 messages
  W3     500 messages/s for 10 s to one live subscriber: publish-to-receive latency
  W4     catch-up: 50,000 messages waiting for a subscriber that connects, received and acked
  W5     W1b and W4 again with 10 million delivery rows already in the database
  W6     W3 again with 10,000 idle subscribers connected (ours only)
  W7     ordered drain: an ordered queue of 500 waiting messages, ONE consumer acking each
         the moment it has it (ours: socket, REST pull, webhook; RabbitMQ: a quorum queue with a
         single active consumer and a prefetch of 1); every message in publish order   500 messages

A driver returns one result: its figure (`value`, `unit`), its counts and errors, and the
`checks` that make it ok (every message confirmed, stored, received and acked in the store).
"""

import asyncio
import json
import math
import multiprocessing
import random
import statistics
import time

import subscriber_processes
from harness import message
from systems import MAX_BATCH_FRAME

# The workloads run for us over every transport (W5 and W6 are run beside them: compare.py;
# W7's webhook too, after the transports).
OURS_WORKLOADS = ("W1a", "W1a-8", "W1b", "W2", "W3", "W4", "W7")
# The peers that run W7: those with a way to hand a queue out one message at a time in order.
ORDERED_PEERS = ("rabbitmq",)
W7_MIN = 200  # W7's size at least, whatever the scale: fewer would time little but start-up
W2_SUBSCRIBERS = 10
W3_RATE = 500
WARMUP = 50
W1A_CLIENTS = 8  # W1a-8: what several REST clients of one server get together
# Run names (and so queue names) of the workloads, whose own names are not valid queue names.
RUN_NAMES = {"W1a-8": "w1a8"}
REST_ONLY = {"W1a-8"}

# Full sizes; --scale multiplies them.
SIZES = {
    "W1a": 20_000,
    "W1a-8": 20_000,
    "W1b": 20_000,
    "W2": 5_000,
    "W3": 10,  # seconds at W3_RATE
    "W4": 50_000,
    "W5": 10_000_000,  # delivery rows already there
    "W6": 10_000,  # idle subscribers
    "W7": 500,
}


def scaled(scale, w3_rate=W3_RATE, w6_connections=None, w5_rows=None):
    """The sizes of a run: SIZES times `scale` (W3's seconds at least 2), W3's rate, and the
    W6 and W5 counts when given."""
    sizes = {k: max(int(v * scale), 1) for k, v in SIZES.items()}
    sizes["W3"] = max(SIZES["W3"] * scale, 2.0)
    sizes["W7"] = max(int(SIZES["W7"] * scale), W7_MIN)
    sizes["W3_rate"] = w3_rate
    if w6_connections:
        sizes["W6"] = w6_connections
    if w5_rows:
        sizes["W5"] = w5_rows
    return sizes


def payload(i, phase, sent=0.0):
    return message(i, phase=phase, sent=sent)["payload"]


def pct(values, p):
    s = sorted(values)
    return s[max(math.ceil(p / 100 * len(s)) - 1, 0)] if s else None


def ms(x):
    return None if x is None else round(x * 1000, 2)


async def wait_unacked_zero(system, run, n, limit=30.0):
    """What the store still counts as not acked, polled until 0 (acks may be written after
    the client sent them) or `limit` seconds."""
    deadline = time.monotonic() + limit
    while True:
        left = await system.unacked(run, n)
        if left == 0 or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.5)


# --- the workloads ---------------------------------------------------------------------------------


async def w1(system, run, total, batch, limit, clients=1):
    """`clients` publishers at once, each sending its next batch once the last is confirmed."""
    await system.prepare(run, 1)
    pubs = [await system.publisher(run) for _ in range(clients)]
    latencies, errors = [], []
    ok = i = 0
    started = time.perf_counter()
    deadline = time.monotonic() + limit

    async def client(pub):
        nonlocal ok, i
        while i < total and time.monotonic() < deadline and len(errors) < 10:
            n = min(batch, total - i)
            batch_payloads = [payload(i + k, "w1") for k in range(n)]
            i += n
            t = time.perf_counter()
            try:
                if batch == 1:
                    await pub.one(batch_payloads[0])
                else:
                    await pub.many(batch_payloads)
                ok += n
            except Exception as exc:
                errors.append(f"{exc.__class__.__name__}: {exc}"[:300])
            latencies.append(time.perf_counter() - t)

    try:
        await asyncio.gather(*(client(p) for p in pubs))
    finally:
        seconds = time.perf_counter() - started
        for pub in pubs:
            await pub.close()
    stored = await system.stored(run, 1)
    return {
        "messages": ok,
        "target": total,
        "seconds": round(seconds, 3),
        "value": round(ok / seconds, 1),
        "unit": "msg/s",
        "clients": clients,
        "request_ms": {"p50": ms(pct(latencies, 50)), "p99": ms(pct(latencies, 99))},
        "errors": errors[:5],
        "time_limited": i < total,
        # No confirmed message may be missing; one the server stored but could not confirm (its
        # socket closed first) is the at-least-once case a client resends.
        "stored_unconfirmed": stored - ok,
        "server_closed_socket": getattr(pub, "reconnects", 0),
        "checks": {"no_errors": not errors, "confirmed_all_stored": stored >= ok, "stored": stored},
    }


def delivery_frames(res):
    """What the batch consumers counted of their `messages` frames, for the JSON (WS batch)."""
    return {"delivery_frames": res["frames"]} if res.get("frames") else {}


def received(records, phase):
    """Distinct message numbers of `phase`, and how many arrived more than once."""
    got = [r for r in records if r[0] == phase]
    distinct = {r[1] for r in got}
    return distinct, len(got) - len(distinct)


async def w2(system, run, total, limit, subscribers=W2_SUBSCRIBERS):
    spec = await system.prepare(run, subscribers, consumer="ws")
    group = subscriber_processes.Subscribers(spec, subscribers, total, "w2", limit)
    await asyncio.get_running_loop().run_in_executor(None, group.start)
    pub = await system.publisher(run)
    started = time.monotonic()
    errors = []
    try:
        for first in range(0, total, 100):
            if time.monotonic() - started > limit:
                errors.append("publishing hit the time limit")
                break
            await pub.many([payload(i, "w2") for i in range(first, min(first + 100, total))])
    except Exception as exc:
        errors.append(f"{exc.__class__.__name__}: {exc}"[:300])
    published_in = time.monotonic() - started
    await pub.close()
    res = await group.result()
    counts, dups = [], 0
    for recs in res["records"]:
        distinct, d = received(recs, "w2")
        counts.append(len(distinct))
        dups += d
    finished = [t for t in res["done_at"] if t is not None]
    seconds = (max(finished) - started) if len(finished) == subscribers else None
    left = await wait_unacked_zero(system, run, subscribers)
    deliveries = subscribers * total
    return {
        "messages": total,
        "subscribers": subscribers,
        "deliveries": sum(counts),
        "target": deliveries,
        "seconds": None if seconds is None else round(seconds, 3),
        "publish_seconds": round(published_in, 3),
        "value": None if seconds is None else round(deliveries / seconds, 1),
        "unit": "acked deliveries/s",
        "duplicates": dups,
        **delivery_frames(res),
        "errors": errors + ([res["error"]] if res["error"] else []),
        "checks": {
            "all_received": counts == [total] * subscribers,
            "no_errors": not errors and not res["error"],
            "store_all_acked": left == 0,
        },
    }


async def w3(system, run, seconds, limit, rate=W3_RATE):
    total = int(rate * seconds)
    spec = await system.prepare(run, 1, consumer="ws")
    group = subscriber_processes.Subscribers(spec, 1, total, "w3", limit + seconds)
    await asyncio.get_running_loop().run_in_executor(None, group.start)
    pub = await system.publisher(run)
    errors, tasks = [], []

    async def send(p):
        try:
            await pub.one(p)
        except Exception as exc:
            errors.append(f"{exc.__class__.__name__}: {exc}"[:300])

    async def paced(phase, count):
        # The send time in the payload is the time the message was due: a publisher that
        # falls behind (the server answers slowly) shows as latency, not as a slower rate.
        t0 = time.monotonic()
        for i in range(count):
            due = t0 + i / rate
            delay = due - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            if time.monotonic() - t0 > seconds + limit:
                errors.append(f"publishing hit the time limit after {i} messages")
                break
            tasks.append(asyncio.ensure_future(send(payload(i, phase, sent=due))))

    await paced("warmup", WARMUP)
    await asyncio.sleep(0.5)
    started = time.monotonic()
    await paced("w3", total)
    # Confirms still owed are waited for, but not past the limit.
    _, late = await asyncio.wait(tasks, timeout=limit) if tasks else (None, set())
    for task in late:
        task.cancel()
    if late:
        errors.append(f"{len(late)} publishes not confirmed within {limit:.0f} s of the last send")
    publish_seconds = time.monotonic() - started
    await pub.close()
    res = await group.result()
    first = {}
    for r in res["records"][0]:
        if r[0] == "w3":
            first.setdefault(r[1], r)
    lat = [r[3] - r[2] for r in first.values()]
    _, dups = received(res["records"][0], "w3")
    left = await wait_unacked_zero(system, run, 1)
    return {
        "messages": len(first),
        "target": total,
        "rate": rate,
        "publish_seconds": round(publish_seconds, 3),
        "value": ms(pct(lat, 99)),
        "unit": "p99 ms",
        "latency_ms": {
            "p50": ms(pct(lat, 50)),
            "p95": ms(pct(lat, 95)),
            "p99": ms(pct(lat, 99)),
            "max": ms(max(lat)) if lat else None,
            "mean": ms(statistics.fmean(lat)) if lat else None,
        },
        "duplicates": dups,
        **delivery_frames(res),
        "errors": errors[:5] + ([res["error"]] if res["error"] else []),
        "checks": {
            "all_received": len(first) == total,
            "no_errors": not errors and not res["error"],
            "store_all_acked": left == 0,
        },
    }


async def fill_backlog(system, run, total, tag):
    """Publish `total` messages (tagged `tag`) in batches of 100 before any consumer connects
    (W4's and W7's backlog; not measured); the seconds it took."""
    pub = (
        await system.backlog_publisher(run)
        if hasattr(system, "backlog_publisher")
        else await system.publisher(run)
    )
    fill = time.monotonic()
    try:
        for first in range(0, total, 100):
            await pub.many([payload(i, tag) for i in range(first, min(first + 100, total))])
    finally:
        await pub.close()
    return time.monotonic() - fill


async def w4(system, run, total, limit, consumer="ws"):
    spec = await system.prepare(run, 1, consumer=consumer)
    fill = await fill_backlog(system, run, total, "w4")
    stored = await system.stored(run, 1)
    group = subscriber_processes.Subscribers(spec, 1, total, "w4", limit)
    await asyncio.get_running_loop().run_in_executor(None, group.start)
    res = await group.result()
    distinct, dups = received(res["records"][0], "w4")
    done = res["done_at"][0]
    seconds = None if done is None else done - group.started_at
    left = await wait_unacked_zero(system, run, 1)
    return {
        "messages": len(distinct),
        "target": total,
        "backlog_fill_seconds": round(fill, 2),
        "seconds": None if seconds is None else round(seconds, 3),
        "value": None if seconds is None else round(total / seconds, 1),
        "unit": "msg/s received+acked",
        "duplicates": dups,
        **delivery_frames(res),
        "errors": [res["error"]] if res["error"] else [],
        "checks": {
            "backlog_stored": stored == total,
            "all_received": len(distinct) == total,
            "no_errors": not res["error"],
            "store_all_acked": left == 0,
        },
    }


def in_order(numbers, total):
    """W7's checks on the message numbers as the consumer got them (published as 0, 1, 2 ...):
    arrivals after a later message (out of order; a redelivery of an earlier one counts, one of
    the message just got does not), arrivals more than once, and numbers never got."""
    out_of_order, top = 0, -1
    for i in numbers:
        out_of_order += i < top
        top = max(top, i)
    distinct = set(numbers)
    return {
        "out_of_order": out_of_order,
        "duplicates": len(numbers) - len(distinct),
        "missing": len(set(range(total)) - distinct),
    }


def cycle_ms(times):
    """Percentiles of the gaps between consecutive arrivals: W7's time per message (receive,
    ack, and the next one handed out and sent), and how many took over 100 ms (a wait for a
    timer or a sweep rather than for work)."""
    gaps = [b - a for a, b in zip(times, times[1:], strict=False)]
    return {p: ms(pct(gaps, q)) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))} | {
        "max": ms(max(gaps)) if gaps else None,
        "over_100ms": sum(g > 0.1 for g in gaps),
    }


def request_ms(timings):
    """W7's pull: percentiles of its lease and ack requests, in ms (nothing for the others)."""
    if not timings:
        return {}
    return {
        "request_ms": {
            kind: {p: ms(pct(times, q)) for p, q in (("p50", 50), ("p90", 90), ("p99", 99))}
            | {"max": ms(max(times)) if times else None, "count": len(times)}
            for kind, times in timings.items()
        }
    }


async def w7(system, run, total, limit, consumer="ws"):
    """The ordered drain: `total` messages waiting in an ordered queue, then ONE consumer that
    acks each the moment it has it (subscriber_processes' `ack_each`); messages a second from
    its start (before it connects) until its last ack, and whether it got them all in order."""
    spec = await system.prepare(run, 1, consumer=consumer, ordered=True)
    fill = await fill_backlog(system, run, total, "w7")
    stored = await system.stored(run, 1)
    group = subscriber_processes.Subscribers(spec, 1, total, "w7", limit, ack_each=True)
    await asyncio.get_running_loop().run_in_executor(None, group.start)
    res = await group.result()
    got = [r for r in res["records"][0] if r[0] == "w7"]
    order = in_order([r[1] for r in got], total)
    done = res["done_at"][0]
    # A run cut by the time limit still has a rate: what it got, up to its last arrival.
    end = done if done is not None else (got[-1][3] if got else None)
    seconds = None if end is None else end - group.started_at
    received_n = total - order["missing"]
    # A run cut by its limit leaves the rest unacked for good: no waiting for them.
    left = await wait_unacked_zero(system, run, 1, limit=30.0 if done is not None else 0)
    return {
        "messages": received_n,
        "target": total,
        "backlog_fill_seconds": round(fill, 2),
        "seconds": None if seconds is None else round(seconds, 3),
        "value": round(received_n / seconds, 1) if seconds else None,
        "unit": "msg/s, one consumer acking each",
        "first_message_s": round(got[0][3] - group.started_at, 3) if got else None,
        # The rate once the first message is there: without the connect and the resume.
        "value_after_first": (
            round((received_n - 1) / (end - got[0][3]), 1) if got and end and end > got[0][3] else None
        ),
        "cycle_ms": cycle_ms([r[3] for r in got]),
        **request_ms(res.get("timings", [None])[0]),
        **order,
        "time_limited": done is None,
        "errors": [res["error"]] if res["error"] else [],
        "checks": {
            "backlog_stored": stored == total,
            "all_received": order["missing"] == 0,
            "in_order": order["out_of_order"] == 0,
            "no_errors": not res["error"],
            "store_all_acked": left == 0,
        },
    }


async def w7_webhook(system, run, total, limit, receiver, secret, sample=50):
    """W7 by webhook (ours only): the Celery workers already running and the queue's one
    subscriber posting to `receiver` (webhook_rate.Receiver: answers 200 at once), `total`
    messages are published in batches of up to 1,000 (one, at W7's sizes); the drain runs from
    the first batch's 201 (or the first post, if earlier) until the last ack the database
    stamped. Checks every post's order, a sample of their signatures, that none is dead."""
    from standardwebhooks import Webhook

    receiver.reset()
    pub = await system.publisher(run)
    started = None
    try:
        for first in range(0, total, MAX_BATCH_FRAME):
            await pub.many([payload(i, "w7") for i in range(first, min(first + MAX_BATCH_FRAME, total))])
            started = started or time.time()
    finally:
        await pub.close()
    deadline, complete = time.monotonic() + limit, False
    while not complete and time.monotonic() < deadline:
        posts = receiver.snapshot()
        complete = len({json.loads(body)["payload"]["i"] for _, _, body in posts}) >= total
        await asyncio.sleep(0.05)
    # The last ack follows the last post by a moment; a run cut by its limit never gets there.
    left = await wait_unacked_zero(system, run, 1, limit=30.0 if complete else 0)
    posts = receiver.snapshot()
    # The receiver stamps posts with the monotonic clock; the database stamps acks by the wall's.
    to_wall = time.time() - time.monotonic()
    frames = [json.loads(body) for _, _, body in posts]
    order = in_order([f["payload"]["i"] for f in frames if f["payload"].get("phase") == "w7"], total)
    if posts:
        started = min(started, posts[0][0] + to_wall)
    last_ack = await system.last_ack(run)
    end = last_ack if not left and last_ack else (posts[-1][0] + to_wall if posts else None)
    seconds = None if end is None else end - started
    received_n = total - order["missing"]
    bad = 0
    for _, headers, body in random.Random(0).sample(posts, min(sample, len(posts))):
        try:
            Webhook(secret).verify(body, {k.lower(): v for k, v in headers.items()})
        except Exception:  # the library raises its own WebhookVerificationError
            bad += 1
    dead = await system.dead(run)
    return {
        "messages": received_n,
        "target": total,
        "seconds": None if seconds is None else round(seconds, 3),
        "value": round(received_n / seconds, 1) if seconds else None,
        "unit": "msg/s, one consumer acking each",
        "first_post_s": round(posts[0][0] + to_wall - started, 3) if posts else None,
        "cycle_ms": cycle_ms([t for t, _, _ in posts]),
        "posts": len(posts),
        **order,
        "signatures_checked": min(sample, len(posts)),
        "signatures_bad": bad,
        "dead": dead,
        "time_limited": received_n < total,
        "errors": [],
        "checks": {
            "all_received": order["missing"] == 0,
            "in_order": order["out_of_order"] == 0,
            "signatures_good": bad == 0,
            "none_dead": dead == 0,
            "store_all_acked": left == 0,
        },
    }


def failed(exc):
    return {"value": None, "error": f"{exc.__class__.__name__}: {exc}"[:500], "checks": {"ran": False}}


async def guarded(coro, label):
    print(f"  {label} ...", flush=True)
    t = time.monotonic()
    try:
        out = await coro
    except Exception as exc:
        out = failed(exc)
    out["ok"] = all(v for k, v in out["checks"].items() if k != "stored")
    out["wall_seconds"] = round(time.monotonic() - t, 1)
    shown = out.get("latency_ms") or out.get("value")
    print(f"  {label}: {shown} {out.get('unit', '')} ok={out['ok']} {out.get('error', '')}", flush=True)
    return out


async def run_workload(system, w, run, sizes, limit, transport):
    if w == "W1a":
        return await guarded(w1(system, run, sizes["W1a"], 1, limit), w)
    if w == "W1a-8":
        return await guarded(w1(system, run, sizes["W1a-8"], 1, limit, clients=W1A_CLIENTS), w)
    if w == "W1b":
        return await guarded(w1(system, run, sizes["W1b"], 100, limit), w)
    if w == "W2":
        return await guarded(w2(system, run, sizes["W2"], limit), w)
    if w == "W3":
        return await guarded(w3(system, run, sizes["W3"], limit, sizes["W3_rate"]), w)
    if w == "W4":
        return await guarded(w4(system, run, sizes["W4"], limit, consumer=transport), w)
    if w == "W7":
        # Over REST, W7's consumer pulls one at a time (systems.OursConsumerPull).
        consumer = "pull" if transport == "rest" else transport
        return await guarded(w7(system, run, sizes["W7"], limit, consumer=consumer), w)
    raise ValueError(w)


# --- W6: W3 beside idle subscribers (ours only; `ours_by_transport` is one system a transport) ---


def w6_ladder(target):
    """The idle counts W6 tries, largest first: the target, then tenfold fewer, down to 10."""
    steps = [target]
    while steps[-1] > 10:
        steps.append(max(steps[-1] // 10, 10))
    return steps


async def w6_once(ours_by_transport, idle_tokens, port, sizes, limit, run):
    """Connect the idle subscribers, then W3 with each publisher while they stay connected."""
    target = len(idle_tokens)
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe()
    connect_limit = max(30.0, 1.5 * limit)
    proc = ctx.Process(
        target=subscriber_processes.idle_process,
        args=(f"ws://127.0.0.1:{port}/ws/", idle_tokens, child, 100, connect_limit),
        daemon=True,
    )
    started = time.monotonic()
    proc.start()
    loop = asyncio.get_running_loop()
    connected, failures, progress, failed_count = 0, [], [], 0
    while True:
        if not await loop.run_in_executor(None, parent.poll, connect_limit + 60):
            break
        msg = parent.recv()
        if msg[0] == "progress":
            progress.append((round(time.monotonic() - started, 1), msg[1], msg[2]))
            if len(progress) % 10 == 0:
                print(f"    idle connected: {msg[1]} (failed {msg[2]})", flush=True)
            continue
        if msg[0] == "connected":
            connected, failures, failed_count = msg[1], msg[2], msg[3]
            break
    connect_seconds = time.monotonic() - started
    print(
        f"  W6: {connected} of {target} idle subscribers connected and answering ({connect_seconds:.0f} s)",
        flush=True,
    )
    out = {
        "target_idle": target,
        "idle_connected": connected,
        "connect_seconds": round(connect_seconds, 1),
        "connect_failures": failures,
        "connect_failure_count": failed_count,
        "progress": progress[::5],
    }
    await asyncio.sleep(5)  # let the connects' own work (catch-up leases) settle
    for transport, ours in ours_by_transport.items():
        if connected < 0.99 * target:
            out[transport] = {**failed(RuntimeError(f"only {connected} idle sockets answer")), "ok": False}
            continue
        out[transport] = await guarded(
            w3(ours, run, sizes["W3"], limit, sizes["W3_rate"]), f"W6 ({transport} publisher, {target} idle)"
        )
    parent.send("stop")
    if await loop.run_in_executor(None, parent.poll, 60):
        out["idle_still_open_at_end"] = parent.recv()[1]
    proc.join(30)
    if proc.is_alive():
        proc.kill()
    for transport in ours_by_transport:
        # The sockets that were still open when W3 was over are the idle ones it ran beside.
        out[transport]["idle_connected"] = min(connected, out.get("idle_still_open_at_end", connected))
    return out


async def w6(ours_by_transport, idle_tokens, port, sizes, limit):
    """W6 at the target; if W3 fails beside that many idle sockets, again with tenfold fewer
    (each step with queues of its own), until it passes. The last step is the result."""
    attempts = []
    for k, n in enumerate(w6_ladder(len(idle_tokens))):
        out = await w6_once(ours_by_transport, idle_tokens[:n], port, sizes, limit, f"w6s{k}")
        attempts.append(out)
        # This many is reachable if every idle socket still answered a ping after W3 and W3
        # itself could run (its subscriber connected); W3's own latency is then the figure.
        held = out.get("idle_still_open_at_end", 0) >= 0.99 * n
        if held and all(out[t].get("checks", {}).get("ran", True) for t in ours_by_transport):
            break
        await asyncio.sleep(10)  # let the server close what the last step left
    final = attempts[-1]
    final["attempts"] = [
        {
            "target_idle": a["target_idle"],
            "idle_connected": a["idle_connected"],
            "idle_still_open_at_end": a.get("idle_still_open_at_end"),
            "connect_seconds": a["connect_seconds"],
            "connect_failure_count": a["connect_failure_count"],
            **{
                t: {"ok": a[t]["ok"], "latency_ms": a[t].get("latency_ms"), "error": a[t].get("error")}
                for t in ours_by_transport
            },
        }
        for a in attempts
    ]
    return final
