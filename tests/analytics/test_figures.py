"""The figures of hour rows (analytics.figures), computed over whole columns, held to the plain
rules they stand for: a group's latency percentiles are sketch_rule.Merged's of its rows' sketches
(every hour, day, queue and event, subscriber), and a subscriber's backlog at the end of a
period is the running sum, hour after hour, of what it was owed."""

import random
from collections import defaultdict
from datetime import UTC, datetime, timedelta

import numpy as np
import pyarrow as pa
import pytest

from analytics import analysis, figures, hours, layout, sketch
from tests.analytics import history, sketch_rule

PS = figures.PERCENTILES


def merged_quantiles(sketches, ps=PS):
    merged = sketch_rule.Merged()
    for points, count in sketches:
        merged.add(points, count)
    return merged.quantiles(ps)


def random_sketches(rng, n_rows, n_groups):
    """Rows of (group, count, points): values from a few hundred (ties within and across
    sketches), busy rows past K points (weights count / K, not whole), rows whose count is
    not their number of points, and rows Merged skips (a count of 0, no points)."""
    rows = []
    for _ in range(n_rows):
        group = rng.randrange(n_groups)
        kind = rng.random()
        values = [round(rng.lognormvariate(3, 1), 1) for _ in range(rng.choice((1, 3, 50, 200, 201, 900)))]
        count = len(values)
        points = sketch_rule.points(values)
        if kind < 0.1:
            count = rng.randrange(1, 10 * count + 1)
        elif kind < 0.15:
            count = 0
        elif kind < 0.2:
            points = rng.choice((None, []))
        rows.append((group, count, points))
    return rows


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("key_bits", [sketch.KEY_BITS, 0], ids=["one key", "lexsort"])
def test_grouped_quantiles_are_merged_s_to_the_bit(seed, key_bits, monkeypatch):
    """Either way of sorting the points (one packed key, or lexsort when the ranks would not
    fit it) gives Merged's values."""
    monkeypatch.setattr(sketch, "KEY_BITS", key_bits)
    rng = random.Random(seed)
    # Few groups of many sketches, many of one or two; some groups with none at all.
    n_groups = rng.choice((3, 40, 400))
    rows = random_sketches(rng, rng.choice((30, 300, 1500)), n_groups + 2)
    group = np.array([g for g, _, _ in rows])
    counts = pa.array([c for _, c, _ in rows], pa.int64())
    points = pa.array([p for _, _, p in rows], pa.list_(pa.float64()))
    ps = (0.0, 0.01, 0.25, *PS, 1.0)

    values, found = sketch.Sketches(counts, points).quantiles(group, n_groups + 2, ps)

    for g in range(n_groups + 2):
        want = merged_quantiles([(p, c) for gg, c, p in rows if gg == g], ps)
        got = [float(v) for v in values[g]] if found[g] else [None] * len(ps)
        assert got == want, g


def test_a_group_of_one_sketch_and_equal_values_is_merged_s():
    """Merged reads a lone sketch without sorting it (the step back and forth of its search);
    ties of value and weight across sketches, and p = 0 or 1, at the ends."""
    counts = pa.array([4, 1000, 3, 3, 5], pa.int64())
    points = pa.array(
        [[1.0, 2.0, 3.0, 4.0], sketch_rule.points(list(range(1000))), [2.0, 2.0, 5.0], [2.0, 2.0, 5.0], None]
    )
    group = np.array([0, 1, 2, 2, 3])
    values, found = sketch.Sketches(counts, points).quantiles(group, 4, (0.0, 0.5, 0.75, 1.0))
    assert list(found) == [True, True, True, False]
    assert (
        values[0].tolist()
        == [1.0, 2.0, 3.0, 4.0]
        == merged_quantiles([(points[0].as_py(), 4)], (0, 0.5, 0.75, 1))
    )
    assert values[1].tolist() == merged_quantiles([(points[1].as_py(), 1000)], (0, 0.5, 0.75, 1))
    assert values[2].tolist() == merged_quantiles([([2.0, 2.0, 5.0], 3)] * 2, (0, 0.5, 0.75, 1))


# --- the figures of hour rows made from a generated history ---------------------------------------


@pytest.fixture(scope="module")
def rows():
    """Event and subscriber hour rows of a generated history (its busy minutes give hours past
    K acked deliveries), in two halves each reduced on its own, as the archive's and the hot
    tables' rows are: the same hour then has several sketches to merge."""
    h = history.generate(seed=11, n_messages=4000)
    messages = pa.Table.from_pylist(
        [{f: m[f] for f in layout.HOT_MESSAGE_SCHEMA.names} for m in h.messages], layout.HOT_MESSAGE_SCHEMA
    )
    deliveries = pa.Table.from_pylist(
        [{f: d[f] for f in layout.HOT_DELIVERY_SCHEMA.names} for d in h.deliveries],
        layout.HOT_DELIVERY_SCHEMA,
    )
    messages, deliveries = layout.partition_days(messages, deliveries)
    halves = []
    for half in (0, 1):
        keep = [(i % 2) == half for i in deliveries["id"].to_pylist()]
        halves.append(
            analysis._derived(
                hours.parts(messages if half else messages.slice(0, 0), deliveries.filter(keep))
            )
        )
    return {name: pa.concat_tables([half[name] for half in halves]) for name in ("events", "subscribers")}


def sketches_by(table, key):
    out = defaultdict(list)
    for r in table.to_pylist():
        out[key(r)].append((r["latency_points"], r["latency_count"]))
    return out


def day_of(moment):
    return moment.replace(hour=0, minute=0, second=0, microsecond=0)


def latency(row):
    return [row["latency_p50_ms"], row["latency_p95_ms"], row["latency_p99_ms"]]


def test_each_hours_days_and_events_latency_is_the_merge_of_its_rows(rows):
    events = rows["events"]
    stats, trends = figures.event_figures(events)
    trends = trends.to_pylist()
    by_hour = sketches_by(events, lambda r: (r["queue"], r["event"], "hour", r["hour"]))
    by_day = sketches_by(events, lambda r: (r["queue"], r["event"], "day", day_of(r["hour"])))
    several = [k for k, s in by_hour.items() if sum(1 for p, c in s if p and c) > 1]
    busy = [k for k, s in by_hour.items() if any(c > len(p or ()) for p, c in s)]
    assert several and busy  # the cases the test is for
    assert {
        (t["queue"], t["event"], t["period"], t["period_start"]) for t in trends
    } == by_hour.keys() | by_day.keys()
    for t in trends:
        key = (t["queue"], t["event"], t["period"], t["period_start"])
        assert latency(t) == merged_quantiles((by_hour if t["period"] == "hour" else by_day)[key]), key
    by_event = sketches_by(events, lambda r: (r["queue"], r["event"]))
    for s in stats:
        assert latency(s) == merged_quantiles(by_event[(s["queue"], s["event"])])


def test_each_subscribers_latency_is_the_merge_of_its_rows(rows):
    stats, _ = figures.subscriber_figures(rows["subscribers"], now=history.NOW)
    by_subscriber = sketches_by(rows["subscribers"], lambda r: r["subscriber"])
    assert [s["subscriber"] for s in stats] == sorted(by_subscriber)
    for s in stats:
        assert latency(s) == merged_quantiles(by_subscriber[s["subscriber"]]), s["subscriber"]


# --- the backlog trend ------------------------------------------------------------------------------


def subscriber_rows(seed):
    """Subscriber hour rows over a few days: several rows an hour (queues, the archive's and the
    hot tables'), hours with acks only, a subscriber with a single hour."""
    rng = random.Random(seed)
    start = datetime(2026, 11, 1, tzinfo=UTC)
    out = []
    for subscriber in ("alpha", "beta", "gamma", "zed"):
        n_hours = 1 if subscriber == "zed" else rng.randrange(20, 90)
        for hour in rng.sample(range(24 * 4), n_hours):
            for queue in rng.sample(("db", "network", "mail"), rng.randint(1, 3)):
                published = rng.choice((0, rng.randrange(1, 40)))
                out.append(
                    {
                        "queue": queue,
                        "day": "2026-11-01",
                        "subscriber": subscriber,
                        "hour": start + timedelta(hours=hour),
                        "published": published,
                        **{s: 0 for s in ("pending", "inflight", "acked")},
                        "dead": rng.randrange(0, published + 1) if rng.random() < 0.3 else 0,
                        "acks": rng.randrange(0, 30),
                        "oldest_pending_at": None,
                        "latency_count": 0,
                        "latency_points": None,
                    }
                )
    rng.shuffle(out)
    return pa.Table.from_pylist(out, hours.SUBSCRIBER_HOUR_SCHEMA)


def running_backlog(rows):
    """The trend rows as a plain running sum gives them: hour rows, then day rows, each by
    subscriber and start."""
    per_hour = defaultdict(lambda: [0, 0, 0])
    for r in rows:
        h = per_hour[(r["subscriber"], r["hour"])]
        h[0] += r["published"]
        h[1] += r["acks"]
        h[2] += r["dead"]
    trends = {"hour": {}, "day": {}}
    owed = defaultdict(int)
    for (subscriber, hour), (published, acks, dead) in sorted(per_hour.items()):
        owed[subscriber] += published - acks - dead
        for period, start in (("hour", hour), ("day", day_of(hour))):
            t = trends[period].setdefault((subscriber, start), {"published": 0, "acked": 0})
            t["published"] += published
            t["acked"] += acks
            t["backlog"] = owed[subscriber]
    return [
        {"subscriber": s, "period": period, "period_start": start, **t}
        for period in ("hour", "day")
        for (s, start), t in sorted(trends[period].items())
    ]


@pytest.mark.parametrize("seed", range(3))
def test_the_backlog_trend_is_the_running_sum_of_what_was_owed(seed):
    table = subscriber_rows(seed)
    _, trends = figures.subscriber_figures(table, now=datetime(2026, 11, 6, tzinfo=UTC))
    assert trends.to_pylist() == running_backlog(table.to_pylist())
