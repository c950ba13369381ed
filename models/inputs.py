"""The models' inputs by name: standard library only, so a reader of online features (the ranking
server's feature reads, `flywheel features`) knows what to read without loading pandas."""

from __future__ import annotations

from streaming.features import BIGINT, DOUBLE, STREAM_VIEWS

# Numeric inputs of the models, from the stream views' scalar columns (counts: BIGINT, log-scaled;
# rates: DOUBLE, as they are) and the user's age; a missing value (a window without events, a user
# without a profile) is the default 0 after scaling.
COUNTS = tuple(name for view in STREAM_VIEWS for name, sql_type in view.columns if sql_type == BIGINT)
RATES = tuple(name for view in STREAM_VIEWS for name, sql_type in view.columns if sql_type == DOUBLE)
NUMERIC_FEATURES: tuple[str, ...] = (*COUNTS, *RATES, "user_age")
SEQUENCE = ("seq_item_ids", "seq_event_times")
