"""The latency sketch: a group's latencies at the ranks 1/m, 2/m, ..., 1 (m: the group's count
or analytics.job's SKETCH_POINTS K, the smaller), each point standing for 1/m of its count.

Mergeable: the points of several groups, each weighted by its group's count / m, are a sketch
of their union. A quantile read from the merged points is within 1/K of rank of the exact one
(each group's points misplace at most 1/K of its own rows, none when it kept them all); the
points themselves are exact.

Spark makes the points of the archive's hours (analytics.job), analytics.hours those of the
hot tables' hours by the same rule, so that both engines give the same points for the same
values. Sketches reads the quantiles of many groups of sketches at once (every hour, day, queue
and subscriber of a history) with numpy over all the points. The rule itself, written plainly
for one group at a time, is the tests' reference (tests/analytics/sketch_rule.py).
"""

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .groups import as_numpy, combined, ranked_values

# Sketches sorts points by one signed 64-bit key while their group, value rank and weight rank
# fit in it; past that (never met: a million groups of a million distinct values), by lexsort.
KEY_BITS = 63


class Sketches:
    """The sketches of many rows (a count and a list of points each, as the hour rows hold them),
    for the quantiles of groups of rows: each group's are those Merged gives for its rows'
    sketches, to the bit, for every group at once.

    Sorts rather than Python loops: a history of a few months has hundreds of thousands of
    sketches and millions of points, which Merged, a group at a time, took most of a rerun's
    minute to read (issue 32)."""

    def __init__(self, counts, points):
        """`counts` and `points`: Arrow columns of equal lengths (int64; lists of float64). The
        rows Merged.add skips (no points, or a count of 0 or null) count for nothing."""
        counts = as_numpy(pc.fill_null(counts, 0), np.int64)
        points = combined(points)
        lengths = as_numpy(pc.fill_null(pc.list_value_length(points), 0), np.int64)
        kept = (counts > 0) & (lengths > 0)
        self.rows = np.flatnonzero(kept)  # the rows with a sketch, in order
        self._counts = counts[kept]
        self._lengths = lengths[kept]
        # Each point's weight is its sketch's count over its number of points, as Merged.add
        # divides them (two integers made floats exactly, so the same quotient).
        self._weights = self._counts / self._lengths
        # The kept rows' points one after another, and where each row's start.
        kept_points = pa.array(np.repeat(kept, lengths))
        self._values = as_numpy(pc.list_flatten(points).filter(kept_points), np.float64)
        self._starts = np.cumsum(self._lengths) - self._lengths
        self._ordered = None

    def quantiles(self, group, size, ps):
        """(values, found): the values at ranks `ps` of each of `size` groups' merged sketch,
        an array of shape (size, len(ps)) (NaN where the group has none), and which groups
        have one. `group` holds each row's group (0 .. size - 1), for all the rows given."""
        row_group = np.asarray(group, dtype=np.int64)[self.rows]
        counts = np.zeros(size, np.int64)
        np.add.at(counts, row_group, self._counts)
        sketches = np.bincount(row_group, minlength=size)
        # Merged's targets: p of the count, less a little slack for the rounding of float sums.
        totals = counts.astype(np.float64)
        targets = np.multiply.outer(totals, np.asarray(ps, dtype=np.float64)) - (1e-9 * totals)[:, None]
        values = np.full((size, len(ps)), np.nan)
        alone = sketches[row_group] == 1
        self._one_sketch(np.flatnonzero(alone), row_group, targets, values)
        self._merged(np.flatnonzero(~alone), row_group, targets, values)
        return values, sketches > 0

    def _one_sketch(self, rows, row_group, targets, values):
        """The groups of one sketch (most hours): Merged._one_sketch's search, on every such
        group at once, its steps back and forth repeated while any group needs one."""
        if not len(rows):
            return
        groups = row_group[rows]
        weight = self._weights[rows][:, None]
        last = (self._lengths[rows] - 1)[:, None]
        target = targets[groups]
        at = np.clip(np.ceil(target / weight) - 1, 0, last).astype(np.int64)
        while (back := (at > 0) & (weight * at >= target)).any():
            at -= back
        while (on := (at < last) & (weight * (at + 1) < target)).any():
            at += on
        values[groups] = self._values[self._starts[rows][:, None] + at]

    def _merged(self, rows, row_group, targets, values):
        """The groups of several sketches: their points in order of group, value and weight
        (one sort of them all), each group's running sum of weights from its own start, and in
        each the first point whose running sum reaches the target, or its last.

        The running sums are np.cumsum's along the rows of a grid (a group a row, padded with
        infinities), the very additions of Merged's np.cumsum on the group alone, so the very
        floats it compares (a cumsum across groups would carry the sums before into each
        group's roundings); a grid per width (_width) of the groups' sizes, the groups sorted
        by it."""
        if not len(rows):
            return
        lengths = self._lengths[rows]
        size = np.zeros(len(values), np.int64)
        np.add.at(size, row_group[rows], lengths)
        present = np.flatnonzero(size)
        width = _width(size[present])
        in_order = present[np.lexsort((present, width))]
        renumbered = np.empty(len(values), np.int64)
        renumbered[in_order] = np.arange(len(in_order))
        if len(rows) == len(self.rows):
            points = slice(None)
        else:
            points = np.repeat(self._starts[rows] - (np.cumsum(lengths) - lengths), lengths)
            points += np.arange(len(points))
        weights, value_at = self._sorted(np.repeat(renumbered[row_group[rows]], lengths), points)
        # The groups in that order: their widths, sizes and first points.
        width = np.sort(width)
        size = size[in_order]
        first = np.cumsum(size) - size
        for w in np.unique(width):
            groups = np.flatnonzero(width == w)  # one after another, as their points
            start, n = first[groups], size[groups]
            grid = np.full((len(groups), w), np.inf)
            # A group's points fill its row from the left (a boolean mask fills in row order).
            grid[np.arange(w) < n[:, None]] = weights[start[0] : start[0] + n.sum()]
            np.cumsum(grid, axis=1, out=grid)
            for i in range(targets.shape[1]):
                below = (grid < targets[in_order[groups], i][:, None]).sum(axis=1)
                values[in_order[groups], i] = value_at(start + np.minimum(below, n - 1))

    def _sorted(self, group, points):
        """(weights, value_at) of these points (each a group, and an index into the values or
        a slice of them), ordered by group, value and weight as Merged's lexsort orders a
        group's points: their weights in that order, and value_at(positions) their values at
        positions in it. One np.sort of a 64-bit key per point packing the group, the value's
        rank among the distinct values and the weight's (several times quicker than an argsort
        of as many floats); np.lexsort when those do not fit KEY_BITS."""
        keys, value_bits, weight_bits, distinct_values, distinct_weights = self._ranked()
        group_bits = int(group.max()).bit_length()
        if group_bits + value_bits + weight_bits > KEY_BITS:
            order = np.lexsort((keys[points], group))
            values = self._values[points][order]
            return distinct_weights[keys[points][order] & ((1 << weight_bits) - 1)], lambda at: values[at]
        key = group
        key <<= value_bits + weight_bits
        key |= keys[points]
        key.sort()
        return distinct_weights[key & ((1 << weight_bits) - 1)], lambda at: distinct_values[
            (key[at] >> weight_bits) & ((1 << value_bits) - 1)
        ]

    def _ranked(self):
        """(keys, value bits, weight bits, distinct values, distinct weights): each point's rank
        among the distinct values and its weight's among the distinct weights, packed in one
        integer that sorts as (value, weight) pairs do, made once for all the groupings. The
        values hashed (Arrow's dictionary encoding), then only the distinct ones sorted."""
        if self._ordered is None:
            value_rank, distinct_values = ranked_values(pa.array(self._values))
            distinct_weights, weight_rank = np.unique(self._weights, return_inverse=True)
            value_bits = (len(distinct_values) - 1).bit_length()
            weight_bits = (len(distinct_weights) - 1).bit_length()
            keys = value_rank << weight_bits
            keys |= np.repeat(weight_rank.reshape(-1), self._lengths)
            self._ordered = keys, value_bits, weight_bits, as_numpy(distinct_values), distinct_weights
        return self._ordered


def _width(size):
    """The width of the grid rows of groups of these sizes: each size rounded up to a multiple
    of an eighth of the power of two below it, so that padding adds at most an eighth to the
    points, and there are at most eight widths per power of two."""
    step = 1 << np.maximum(np.floor(np.log2(size)).astype(np.int64) - 3, 0)
    return -(-size // step) * step
