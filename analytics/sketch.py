"""The latency sketch: a group's latencies at the ranks 1/K, 2/K, ..., 1 (analytics.job's
SKETCH_RANKS), each point standing for 1/K of the group's count.

Mergeable: the points of several groups, each weighted by its group's count / K, are a sketch
of their union. A quantile read from the merged points is within 1/K of rank of the exact one
(each group's points misplace at most 1/K of its own rows), plus the error of the points
themselves (percentile_approx's 1/accuracy when Spark made them, none when points() did).

Spark makes the points of the archive's hours (percentile_approx in analytics.job); points()
makes those of the hot tables' hours, with percentile_approx's own rule for which value a rank
picks, so that both engines give the same points for the same values.
"""

import bisect
import itertools
import math

from .job import SKETCH_RANKS


def points(values):
    """The sketch of these values (exact), or None for none: for each rank r, the smallest
    value with at least r of the values at or below it (percentile_approx's rule)."""
    if not values:
        return None
    ordered = sorted(values)
    n = len(ordered)
    return [ordered[max(math.ceil(r * n) - 1, 0)] for r in SKETCH_RANKS]


class Merged:
    """Sketches added together; quantile() reads the union's."""

    def __init__(self):
        self._points = []  # (value, weight)
        self.count = 0

    def add(self, sketch_points, count):
        if not sketch_points or not count:
            return
        weight = count / len(sketch_points)
        self._points.extend((value, weight) for value in sketch_points)
        self.count += count

    def quantiles(self, ps):
        """The values at these ranks (each in [0, 1]), or Nones when nothing was added."""
        if not self.count:
            return [None for _ in ps]
        ordered = sorted(self._points)
        cumulative = list(itertools.accumulate(weight for _, weight in ordered))
        # The first point whose cumulative weight reaches p of the total, with a little slack
        # for the rounding of float sums.
        slack = 1e-9 * self.count
        return [
            ordered[min(bisect.bisect_left(cumulative, p * self.count - slack), len(ordered) - 1)][0]
            for p in ps
        ]
