"""The latency sketch: a group's latencies at the ranks 1/m, 2/m, ..., 1 (m: the group's count
or analytics.job's SKETCH_POINTS K, the smaller), each point standing for 1/m of its count.

Mergeable: the points of several groups, each weighted by its group's count / m, are a sketch
of their union. A quantile read from the merged points is within 1/K of rank of the exact one
(each group's points misplace at most 1/K of its own rows, none when it kept them all); the
points themselves are exact.

Spark makes the points of the archive's hours (analytics.job); points() makes those of the hot
tables' hours, by the same rule, so that both engines give the same points for the same values.
"""

import math

import numpy as np

from .job import SKETCH_POINTS


def points(values):
    """The sketch of these values (exact), or None for none: m = min(n, K) points, for each
    rank i/m the ceil(i * n / m)-th smallest value (integer arithmetic, as analytics.job's
    Spark does): all the values when they are at most K."""
    if not values:
        return None
    ordered = sorted(values)
    n = len(ordered)
    m = min(n, SKETCH_POINTS)
    return [ordered[max(-(-i * n // m), 1) - 1] for i in range(1, m + 1)]


class Merged:
    """Sketches added together; quantiles() reads the union's."""

    def __init__(self):
        self._points = []  # each sketch's points
        self._weights = []  # and the weight of each of its points: its count / its points
        self.count = 0

    def add(self, sketch_points, count):
        if sketch_points is None or not len(sketch_points) or not count:
            return
        self._points.append(sketch_points)
        self._weights.append(count / len(sketch_points))
        self.count += count

    def quantiles(self, ps):
        """The values at these ranks (each in [0, 1]), or Nones when nothing was added.

        With numpy: a year of hours is millions of points, which Python's sort of pairs took
        about a second per 500,000 (measured on issue 19's 5 M archive, 0.94 s of a 4.4 s rerun).
        """
        if not self.count:
            return [None for _ in ps]
        slack = 1e-9 * self.count
        if len(self._points) == 1:
            return self._one_sketch(ps, slack)
        values = np.concatenate([np.asarray(p, dtype=np.float64) for p in self._points])
        # In order of value, then of weight, as (value, weight) pairs sort.
        weights = np.repeat(self._weights, [len(p) for p in self._points])
        order = np.lexsort((weights, values))
        values, cumulative = values[order], np.cumsum(weights[order])
        # The first point whose cumulative weight reaches p of the total, with a little slack
        # for the rounding of float sums.
        targets = np.asarray(ps, dtype=np.float64) * self.count - slack
        at = np.minimum(np.searchsorted(cumulative, targets, side="left"), len(values) - 1)
        return [float(values[i]) for i in at]

    def _one_sketch(self, ps, slack):
        """quantiles() of one sketch (most hours of a trend; its points sorted, of equal
        weights), in plain Python: the first point whose cumulative weight, weight * (i + 1),
        reaches the target, as the numpy path finds it, without numpy's per-call cost, paid
        tens of thousands of times a run."""
        points, weight = self._points[0], self._weights[0]
        last = len(points) - 1
        out = []
        for p in ps:
            target = p * self.count - slack
            i = max(0, min(last, math.ceil(target / weight) - 1))
            while i > 0 and weight * i >= target:
                i -= 1
            while i < last and weight * (i + 1) < target:
                i += 1
            out.append(float(points[i]))
        return out
