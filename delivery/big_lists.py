"""Admin lists of tables that grow to millions of rows (deliveries, dead letters, messages).

Three things make such a list slow, and BigListAdmin takes them away:
- counting the rows: COUNT(*) reads every row that matches (seconds at millions), and the
  stock admin counts twice (the filtered rows and the whole table). An unfiltered list shows
  the planner's estimate, labelled as one; a filtered one is counted only up to COUNT_AT_MOST.
- sorting by a column no index serves: the database sorts every row for one page. Only the
  columns in `sortable_by` may be sorted by, in the header and in a hand-written ?o= alike.
- deep pages: OFFSET n reads and throws away n rows. The page links stop at COUNT_AT_MOST
  rows; further back is reached by sorting the other way, filtering or searching.
"""

import math

from django.contrib import admin
from django.contrib.admin.views.main import ChangeList
from django.core.paginator import Paginator
from django.db import connections
from django.utils.functional import cached_property

# A filtered list is counted up to this many rows (which also bounds the pages it links to);
# below it the count is exact. 100 pages of 100.
COUNT_AT_MOST = 10_000
# Above this many rows (by the planner's estimate) an unfiltered list shows the estimate.
ESTIMATE_ABOVE = 100_000


def estimated_rows(queryset):
    """The planner's estimate of the rows of the queryset's table (PostgreSQL's pg_class
    .reltuples, kept by ANALYZE and autovacuum), or None where there is none."""
    connection = connections[queryset.db]
    if connection.vendor != "postgresql":
        return None
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT reltuples::bigint FROM pg_class WHERE oid = to_regclass(%s)",
            [queryset.model._meta.db_table],
        )
        row = cursor.fetchone()
    # -1: never analyzed yet.
    return row[0] if row and row[0] is not None and row[0] >= 0 else None


class BoundedCountPaginator(Paginator):
    """Counts no more than COUNT_AT_MOST rows, and pages no further than that.

    `count_words` says what the count is when it is not exact ("about 2,000,000", "more than
    10,000"); the admin's pagination template shows it in place of the number."""

    count_words = ""

    @cached_property
    def count(self):
        qs = self.object_list
        if not qs.query.where:
            estimate = estimated_rows(qs)
            if estimate is not None and estimate >= ESTIMATE_ABOVE:
                # Three significant digits: more would claim a precision it does not have.
                self.count_words = f"about {round(estimate, 3 - len(str(estimate))):,}"
                return estimate
        # COUNT(*) over a subquery with a LIMIT: it stops one row after the pages it links to.
        counted = qs.order_by()[: self.rows_linked + 1].count()
        if counted > self.rows_linked:
            self.count_words = f"more than {self.rows_linked:,}"
            return self.rows_linked
        return counted

    @cached_property
    def rows_linked(self):
        """The rows of the pages linked to: COUNT_AT_MOST, in whole pages."""
        return math.ceil(COUNT_AT_MOST / self.per_page) * self.per_page

    @cached_property
    def num_pages(self):
        return min(super().num_pages, self.rows_linked // self.per_page)


class SortableOnlyChangeList(ChangeList):
    """Sorts only by the columns in the admin's `sortable_by`: the stock ChangeList hides the
    other headers' links but still sorts by any column a URL's ?o= names."""

    def get_ordering_field(self, field_name):
        if self.sortable_by is not None and field_name not in self.sortable_by:
            return None
        return super().get_ordering_field(field_name)


class BigListAdmin(admin.ModelAdmin):
    """The list settings of a table of millions of rows. Subclasses set `sortable_by` to
    columns an index serves, and raw-id widgets for their foreign keys."""

    paginator = BoundedCountPaginator
    # The stock admin counts the whole table too, for "N results (M total)".
    show_full_result_count = False
    # Facets count the rows of each filter choice.
    show_facets = admin.ShowFacets.NEVER
    list_per_page = 100
    sortable_by = ["id"]

    def get_changelist(self, request, **kwargs):
        return SortableOnlyChangeList
