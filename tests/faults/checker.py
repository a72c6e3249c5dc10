"""Check a history against the guarantees, per subscription.

- lost: published and confirmed to the publisher, for this subscription's queue and event, and
  never delivered to it;
- unexpected: delivered, but never published (no publish tried that tag), or not what was
  published (another queue, event, seq or message id), or not for this subscription's event;
- duplicated: deliveries beyond the first of one message (at least once allows them);
  inconsistent: those of them that carry another delivery id than the first (a delivery keeps
  its id across attempts, so this must be 0);
- out of order (ordered queues): the first deliveries of distinct messages must arrive in seq
  order. A message handed out again after a crash is a duplicate, not out of order.

A delivery of a message whose publish was tried but never confirmed (the publisher gave up)
is `unconfirmed`: allowed (the publish may have committed), reported apart.
"""

from dataclasses import asdict, dataclass, field


@dataclass
class SubscriptionReport:
    name: str
    ordered: bool
    expected: int = 0
    received: int = 0  # every delivery received, duplicates included
    distinct: int = 0
    lost: int = 0
    unexpected: int = 0
    duplicated: int = 0
    inconsistent: int = 0
    out_of_order: int = 0
    unconfirmed: int = 0
    examples: list = field(default_factory=list)  # a few of what went wrong, for the log

    def problem(self, text):
        if len(self.examples) < 5:
            self.examples.append(text)


@dataclass
class Report:
    subscriptions: list

    def total(self, name):
        return sum(getattr(s, name) for s in self.subscriptions)

    @property
    def ok(self):
        return not any(self.total(n) for n in ("lost", "unexpected", "inconsistent", "out_of_order"))

    def as_dict(self):
        totals = {
            n: self.total(n)
            for n in (
                "expected",
                "received",
                "distinct",
                "lost",
                "unexpected",
                "duplicated",
                "inconsistent",
                "out_of_order",
                "unconfirmed",
            )
        }
        return {"ok": self.ok, "totals": totals, "subscriptions": [asdict(s) for s in self.subscriptions]}

    def table(self):
        cols = ("expected", "received", "lost", "unexpected", "duplicated", "inconsistent", "out_of_order")
        lines = [f"{'subscription':<16}" + "".join(f"{c:>13}" for c in cols)]
        for s in self.subscriptions:
            name = s.name + (" (ordered)" if s.ordered else "")
            lines.append(f"{name:<16}" + "".join(f"{getattr(s, c):>13}" for c in cols))
        lines.append(f"{'total':<16}" + "".join(f"{self.total(c):>13}" for c in cols))
        for s in self.subscriptions:
            lines += [f"  {s.name}: {e}" for e in s.examples]
        return "\n".join(lines)


def check(subscriptions, attempted, published, delivered):
    """subscriptions: {name: history.Subscription}; attempted: {tag: queue}; published: [Published];
    delivered: [Delivered] in the order received."""
    by_tag = {}
    for p in published:
        by_tag.setdefault(p.tag, p)  # a key repeated answers with the same message
    reports = {name: SubscriptionReport(name, sub.ordered) for name, sub in sorted(subscriptions.items())}
    first_delivery = {name: {} for name in reports}  # tag -> delivery id of its first delivery
    last_first_seq = dict.fromkeys(reports, 0)

    for d in delivered:
        report = reports.get(d.subscription)
        sub = subscriptions.get(d.subscription)
        if report is None:
            continue  # a subscription the run did not declare: nothing to hold it to
        report.received += 1
        pub = by_tag.get(d.tag)
        if pub is None:
            if d.tag in attempted and attempted[d.tag] == sub.queue:
                report.unconfirmed += 1
            else:
                report.unexpected += 1
                report.problem(f"delivery {d.delivery_id} of message {d.message_id}: never published")
            continue
        if (
            pub.queue != sub.queue
            or (sub.event is not None and pub.event != sub.event)
            or (pub.queue, pub.event, pub.seq, pub.message_id) != (d.queue, d.event, d.seq, d.message_id)
        ):
            report.unexpected += 1
            got = f"{d.queue}/{d.event} #{d.seq}, message {d.message_id}"
            sent = f"{pub.queue}/{pub.event} #{pub.seq}, message {pub.message_id}"
            report.problem(f"delivery {d.delivery_id} ({got}) is not what was sent as {pub.tag} ({sent})")
            continue
        seen = first_delivery[d.subscription]
        if d.tag in seen:
            report.duplicated += 1
            if seen[d.tag] != d.delivery_id:
                report.inconsistent += 1
                report.problem(f"{d.tag} came as delivery {seen[d.tag]}, then as delivery {d.delivery_id}")
            continue
        seen[d.tag] = d.delivery_id
        if sub.ordered:
            if d.seq < last_first_seq[d.subscription]:
                report.out_of_order += 1
                report.problem(f"seq {d.seq} arrived first after seq {last_first_seq[d.subscription]}")
            last_first_seq[d.subscription] = max(last_first_seq[d.subscription], d.seq)

    for name, sub in subscriptions.items():
        report = reports[name]
        expected = {
            p.tag
            for p in by_tag.values()
            if p.queue == sub.queue and (sub.event is None or p.event == sub.event)
        }
        report.expected = len(expected)
        report.distinct = len(first_delivery[name])
        missing = sorted(expected - first_delivery[name].keys())
        report.lost = len(missing)
        for tag in missing[:3]:
            p = by_tag[tag]
            report.problem(f"lost: {tag} (message {p.message_id}, {p.queue}/{p.event} #{p.seq})")
    return Report(list(reports.values()))


def check_history(history):
    return check(*history.snapshot())
