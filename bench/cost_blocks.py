"""Publishes of a few cases timed in alternating blocks in one process, the harness of the cost
benchmarks (filter_cost.py, schema_cost.py): the machine's other load then falls on every case
alike, and each block first runs unmeasured rounds. Two ways, as the server publishes: one
message at a time on the event loop (a socket's publish) and a batch in a thread's transaction
(a REST batch).

A case is a pair (publish one message, awaited; publish one batch, called in a thread).
"""

import os
import statistics
import time

from mqsite import adb

SINGLE = "single"


async def _singles(publish_one, n, times=None):
    for _ in range(n):
        t0 = time.perf_counter()
        await publish_one()
        if times is not None:
            times.append((time.perf_counter() - t0) * 1000)


def _batches(publish_batch, n, times=None):
    for _ in range(n):
        t0 = time.perf_counter()
        publish_batch()
        if times is not None:
            times.append((time.perf_counter() - t0) * 1000)


async def measure(cases, *, batch, blocks, rounds, warm, batch_share):
    """{(way, case): [milliseconds]}: per block and case, `warm` unmeasured single publishes then
    `rounds` measured; 2 unmeasured batches of `batch` then rounds // batch_share measured."""
    batched = f"batch of {batch}"
    times = {(way, name): [] for way in (SINGLE, batched) for name in cases}
    for block in range(blocks):
        for name in cases if block % 2 == 0 else reversed(cases):
            publish_one, publish_batch = cases[name]
            await _singles(publish_one, warm)
            await _singles(publish_one, rounds, times[(SINGLE, name)])
            await adb.thread(_batches)(publish_batch, 2)
            await adb.thread(_batches)(publish_batch, max(rounds // batch_share, 3), times[(batched, name)])
    await adb.close_pool()
    return times


def report(times, ratios):
    """Prints the mean and median of each way and case, then each ratio (case, base) of means."""
    print(f"load average {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    width = max(len(way) for way, _ in times)
    for way in dict.fromkeys(w for w, _ in times):
        means = {}
        for (w, name), ms in times.items():
            if w != way:
                continue
            means[name] = statistics.mean(ms)
            print(
                f"{way:{width}s} {name:8s} mean {means[name]:7.3f} ms  median {statistics.median(ms):7.3f} ms"
                f"  ({len(ms)} publishes)"
            )
        print(
            f"{way:{width}s} "
            + "  ".join(f"{case}/{base} {means[case] / means[base]:.3f}" for case, base in ratios)
        )
