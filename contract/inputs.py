"""The models' inputs by name: standard library only, so a reader of online features (the ranking
server's feature reads, `flywheel features`) knows what to read without loading pandas.

A version's spec lists the numeric features it consumes (a subset of NUMERIC_FEATURES, in its own
order): training sets and the server compute all of them, and each version takes its own.
"""

from __future__ import annotations

from streaming.events import dataset_spec
from streaming.features import BIGINT, DOUBLE, STREAM_VIEWS, interest_columns

# The catalog's attributes (the dataset spec's item and user tables) and their features ("item_genres").
_TABLES = {entity: dataset_spec().table(entity) for entity in ("user", "item")}
ATTRIBUTES = {t.feature(a): a for t in _TABLES.values() for a in t.attributes}

# Numeric inputs of the models, from the stream views' scalar columns (counts: BIGINT, log-scaled;
# rates: DOUBLE, as they are), the catalog's and the long history's; a missing value (a window without
# events, a user without a profile) is the default 0 after scaling.
COUNTS = tuple(name for view in STREAM_VIEWS for name, sql_type in view.columns if sql_type == BIGINT)
RATES = tuple(name for view in STREAM_VIEWS for name, sql_type in view.columns if sql_type == DOUBLE)
# Per candidate, from the user's long history and interest histogram: the share of the user's kept
# behaviors in the candidate's category, and of the decayed interest weight.
CATEGORY_SHARES = ("history_category_share", "interest_category_share")
# Per candidate and further grouping key of the spec (a brand): the share of the user's exposures (all
# history) in the candidate's value, and of the decayed interest weight of the key's histogram.
GROUPS = dataset_spec().group_by
GROUP_SHARES = {key: (f"{key}_share", f"interest_{key}_share") for key in GROUPS}
# Per candidate, from the user's recent positives: how many of them are the candidate (log-scaled). A
# shop's customer buys again what they bought (Instacart: 70% of the trees baseline's gain, +0.03 test AUC
# for the ranker); a movie is rated once (0 everywhere, no effect).
REPEATS = ("user_item_repeats",)
DERIVED = (*CATEGORY_SHARES, *(n for shares in GROUP_SHARES.values() for n in shares), *REPEATS)  # per candidate,
# computed when its inputs are built, never stored
# The catalog's integer and number attributes, users' first: max(x - origin, 0) * scale.
CATALOG_NUMERIC = tuple(name for name, a in ATTRIBUTES.items() if a.numeric)
# The request's declared number context fields ("hour"): each the numeric input `context_<name>`, taken from the
# request at serving and from the exposure's event at training, never stored (feature -> field).
CONTEXT_NUMBERS = {c.feature: c.name for c in dataset_spec().context if not c.tokens}
NUMERIC_FEATURES: tuple[str, ...] = (*COUNTS, *RATES, *CATALOG_NUMERIC, *DERIVED, *CONTEXT_NUMBERS)
# What the long history adds (left out: the "long history off" ablation, and the previous architecture).
LONG_HISTORY_FEATURES = ("history_length", "history_category_share")
# The previous architecture's numeric inputs (ranker-v1): the stream counts and rates and the user's numbers.
V1_NUMERIC_FEATURES: tuple[str, ...] = tuple(
    name for name in (*COUNTS, *RATES, *(n for n in CATALOG_NUMERIC if n.startswith("user_")))
    if name not in LONG_HISTORY_FEATURES)

SEQUENCE = ("seq_item_ids", "seq_event_types", "seq_event_times")
LONG_HISTORY = ("history_length", "history_categories", "history_category_counts", "history_item_ids",
                "history_event_types")
INTEREST = tuple(name for key in ("category", *GROUPS) for name in interest_columns(key))
# Each entity's attribute tokens ("genre:Drama", "age:20s"): (prefix, raw feature) pairs, in the spec's
# order; a list feature gives one token per entry, a number whose tokens are "decade" (DECADES) its decade.
TOKENS: dict[str, tuple[tuple[str, str], ...]] = {
    f"{entity}_tokens": tuple((a.token, t.feature(a)) for a in t.attributes if a.tokens != "none")
    for entity, t in (("item", _TABLES["item"]), ("user", _TABLES["user"]))}
DECADES = tuple(name for name, a in ATTRIBUTES.items() if a.tokens == "decade")
# The request's declared context fields, and those read as tokens ("page", a bucketed "hour"): per row, the token
# "<name>:<value>" (`context_tokens`), taken from the request at serving and from the exposure's event at
# training, never stored.
CONTEXT = tuple(c.name for c in dataset_spec().context)
CONTEXT_TOKEN_FIELDS = tuple(c.name for c in dataset_spec().context if c.tokens)
SIDE = tuple(dict.fromkeys(feature for pairs in TOKENS.values() for _, feature in pairs))
# Everything a scoring row is built from, as stored online (the derived features are not stored).
RAW_FEATURES: tuple[str, ...] = tuple(dict.fromkeys(
    (*(n for n in NUMERIC_FEATURES if n not in DERIVED and n not in CONTEXT_NUMBERS), *SEQUENCE, *LONG_HISTORY,
     *INTEREST, *SIDE)))
