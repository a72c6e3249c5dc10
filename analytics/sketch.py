"""The latency sketch: a group's latencies at the ranks 1/K, 2/K, ..., 1 (K: analytics.job's
SKETCH_POINTS), each point standing for 1/K of the group's count.

Mergeable: the points of several groups, each weighted by its group's count / K, are a sketch
of their union. A quantile read from the merged points is within 1/K of rank of the exact one
(each group's points misplace at most 1/K of its own rows); the points themselves are exact.

Spark makes the points of the archive's hours (analytics.job); points() makes those of the hot
tables' hours, by the same rule, so that both engines give the same points for the same values.
"""

import bisect
import itertools

from .job import SKETCH_POINTS


def points(values):
    """The sketch of these values (exact), or None for none: for each rank i/K, the
    ceil(i * n / K)-th smallest value (integer arithmetic, as analytics.job's Spark does)."""
    if not values:
        return None
    ordered = sorted(values)
    n = len(ordered)
    return [ordered[max(-(-i * n // SKETCH_POINTS), 1) - 1] for i in range(1, SKETCH_POINTS + 1)]


class Merged:
    """Sketches added together; quantiles() reads the union's."""

    def __init__(self):
        self._sketches = []  # (points, weight of each point)
        self.count = 0

    def add(self, sketch_points, count):
        if not sketch_points or not count:
            return
        self._sketches.append((sketch_points, count / len(sketch_points)))
        self.count += count

    def quantiles(self, ps):
        """The values at these ranks (each in [0, 1]), or Nones when nothing was added."""
        if not self.count:
            return [None for _ in ps]
        if len(self._sketches) == 1:
            # One sketch: its points are sorted already, of equal weights.
            points, weight = self._sketches[0]
            ordered = points
            cumulative = [weight * (i + 1) for i in range(len(points))]
        else:
            pairs = sorted(
                itertools.chain.from_iterable(zip(p, itertools.repeat(w)) for p, w in self._sketches)
            )
            ordered = [value for value, _ in pairs]
            cumulative = list(itertools.accumulate(weight for _, weight in pairs))
        # The first point whose cumulative weight reaches p of the total, with a little slack
        # for the rounding of float sums.
        slack = 1e-9 * self.count
        last = len(ordered) - 1
        return [ordered[min(bisect.bisect_left(cumulative, p * self.count - slack), last)] for p in ps]
