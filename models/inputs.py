"""The models' inputs by name: standard library only, so a reader of online features (the ranking
server's feature reads, `flywheel features`) knows what to read without loading pandas.

A version's spec lists the numeric features it consumes (a subset of NUMERIC_FEATURES, in its own
order): training sets and the server compute all of them, and each version takes its own.
"""

from __future__ import annotations

from streaming.features import BIGINT, DOUBLE, STREAM_VIEWS

# Numeric inputs of the models, from the stream views' scalar columns (counts: BIGINT, log-scaled;
# rates: DOUBLE, as they are), the catalog's and the long history's; a missing value (a window without
# events, a user without a profile) is the default 0 after scaling.
COUNTS = tuple(name for view in STREAM_VIEWS for name, sql_type in view.columns if sql_type == BIGINT)
RATES = tuple(name for view in STREAM_VIEWS for name, sql_type in view.columns if sql_type == DOUBLE)
# Per candidate, from the user's long history and interest histogram: the share of the user's kept
# behaviors in the candidate's category, and of the decayed interest weight.
CATEGORY_SHARES = ("history_category_share", "interest_category_share")
NUMERIC_FEATURES: tuple[str, ...] = (*COUNTS, *RATES, "user_age", "item_release_year", *CATEGORY_SHARES)
# What the long history adds (left out: the "long history off" ablation, and the previous architecture).
LONG_HISTORY_FEATURES = ("history_length", "history_category_share")
# The previous architecture's numeric inputs (ranker-v1): the stream counts and rates and the user's age.
V1_NUMERIC_FEATURES: tuple[str, ...] = tuple(
    name for name in (*COUNTS, *RATES, "user_age") if name not in LONG_HISTORY_FEATURES)

SEQUENCE = ("seq_item_ids", "seq_event_types", "seq_event_times")
LONG_HISTORY = ("history_length", "history_categories", "history_category_counts", "history_item_ids",
                "history_event_types")
INTEREST = ("interest_categories", "interest_weights")
# Each entity's attribute tokens ("genre:Drama", "age:20s"): (prefix, raw feature) pairs; a list feature
# gives one token per entry, a year or an age (DECADES) its decade.
TOKENS: dict[str, tuple[tuple[str, str], ...]] = {
    "item_tokens": (("genre", "item_genres"), ("year", "item_release_year")),
    "user_tokens": (("gender", "user_gender"), ("occupation", "user_occupation"), ("age", "user_age"))}
DECADES = ("item_release_year", "user_age")
SIDE = tuple(dict.fromkeys(feature for pairs in TOKENS.values() for _, feature in pairs))
# Everything a scoring row is built from, as stored online (the derived shares are not stored).
RAW_FEATURES: tuple[str, ...] = tuple(dict.fromkeys(
    (*(n for n in NUMERIC_FEATURES if n not in CATEGORY_SHARES), *SEQUENCE, *LONG_HISTORY, *INTEREST, *SIDE)))
