"""The latency sketch's rule written plainly, one group at a time: the reference the tests hold
analytics.hours' and Spark's points and analytics.sketch.Sketches' quantiles to.

points(): a group's sketch, m = min(n, K) points, the point of rank i/m the ceil(i * n / m)-th
smallest value. Merged: sketches added together, each point weighing its sketch's count / m;
a quantile is the first point, in order of value then weight, whose cumulative weight reaches
p of the total (less 1e-9 of it, for the rounding of float sums).
"""

import math

import numpy as np

from analytics.job import SKETCH_POINTS


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
