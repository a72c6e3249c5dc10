"""Rows grouped by the values of some of their columns, in numpy: each row's group, numbered in
the order of those values, and sums, minima and maxima per group, with no Python loop per row
(analytics.figures reads millions of hour rows this way).

    hours = Groups.by(table, ["queue", "event", "hour"])     # hours.of: each row's group
    messages = hours.sum(table["messages"])                  # one per group, in key order
    days = Groups.by(day_keys, ["queue", "event", "day"])    # groups of the hours ...
    messages_per_day = days.sum(messages)                    # ... add up the hours' sums
"""

import math

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc


class Groups:
    """`of`: each row's group (0 .. size - 1), the groups in the order of their keys' values, as
    sorted() orders tuples of them (strings by code point, times by time); `keys`: a table of
    each group's values (or None)."""

    def __init__(self, of, size, keys=None):
        self.of = of
        self.size = size
        self.keys = keys

    @classmethod
    def by(cls, table, names):
        """The rows of `table` grouped by the values of its columns `names` (no nulls)."""
        ranked = [ranked_values(table[name]) for name in names]
        of, codes = number([codes for codes, _ in ranked])
        keys = pa.table(
            {
                name: values.take(pa.array(c))
                for name, (_, values), c in zip(names, ranked, codes, strict=True)
            }
        )
        return cls(of, keys.num_rows, keys)

    def of_rows(self, finer):
        """These groups of `finer`'s rows: each of its rows' group among these, when these
        group `finer`'s groups (days of hours: the day of each row of the hours)."""
        return Groups(self.of[finer.of], self.size, self.keys)

    def sum(self, values):
        """The sum of each group's values (an Arrow column or numpy integers; a null adds 0)."""
        out = np.zeros(self.size, np.int64)
        np.add.at(out, self.of, _integers(values))
        return out

    def largest(self, values):
        """The largest of each group's values (numpy integers, none below 0), 0 for none."""
        out = np.zeros(self.size, np.int64)
        np.maximum.at(out, self.of, values)
        return out

    def earliest(self, times):
        """The earliest of each group's times (an Arrow timestamp column; nulls left out), as
        an Arrow array of that type, null for a group of nulls only."""
        return self._extreme(times, np.minimum, np.iinfo(np.int64).max)

    def latest(self, times):
        return self._extreme(times, np.maximum, np.iinfo(np.int64).min)

    def _extreme(self, times, ufunc, start):
        valid = as_numpy(pc.is_valid(times))
        micros = _integers(pc.cast(times, pa.int64()))
        out = np.full(self.size, start, np.int64)
        ufunc.at(out, self.of[valid], micros[valid])
        found = np.zeros(self.size, bool)
        found[self.of[valid]] = True
        return pa.array(out, mask=~found).cast(times.type)


def number(codes):
    """(of, distinct): rows numbered by their codes (arrays of non-negative integers of equal
    lengths, one a column): each row's group, and each group's codes (one array a column), the
    groups in the order of the codes. One integer a row (mixed radix) when the codes fit 62
    bits, counted into a table of every possible key when that is not much bigger than the
    rows (no sort at all), else sorted."""
    rows = len(codes[0])
    radices = [int(c.max()) + 1 if len(c) else 1 for c in codes]
    possible = math.prod(radices)
    if possible >= 2**62:
        distinct, of = np.unique(np.stack(codes, axis=1), axis=0, return_inverse=True)
        return of.reshape(-1), list(distinct.T)
    key = np.zeros(rows, np.int64)
    for column, radix in zip(codes, radices, strict=True):
        key = key * radix + column
    if possible <= 4 * rows + 1024:
        present = np.zeros(possible, bool)
        present[key] = True
        distinct = np.flatnonzero(present)
        of = (np.cumsum(present) - 1)[key]
    else:
        distinct, of = np.unique(key, return_inverse=True)
        of = of.reshape(-1)
    out = []
    for radix in reversed(radices):
        distinct, column = np.divmod(distinct, radix)
        out.append(column)
    return of, out[::-1]


def ranked_values(column):
    """(codes, values): each row's rank among the column's distinct values, and those values in
    order. Hashed (Arrow's dictionary encoding), then only the distinct values sorted."""
    column = combined(column)
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    encoded = pc.dictionary_encode(column)
    order = pc.array_sort_indices(encoded.dictionary)
    rank = np.empty(len(order), np.int64)
    rank[as_numpy(order)] = np.arange(len(order))
    return rank[as_numpy(encoded.indices)], encoded.dictionary.take(order)


def _integers(values):
    if isinstance(values, np.ndarray):
        return values
    return as_numpy(pc.fill_null(values, 0), np.int64)


def combined(column):
    """An Arrow column as one array (a ChunkedArray's chunks joined)."""
    return column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column


def as_numpy(column, dtype=None):
    """An Arrow column as a numpy array (of `dtype`, when given)."""
    values = combined(column).to_numpy(zero_copy_only=False)
    return values if dtype is None else values.astype(dtype, copy=False)
