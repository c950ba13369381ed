"""Model inputs from feature rows (`models.dataset.to_examples`, shared by training and serving): each
candidate gets the long history of its own category, its category's shares, the recent behaviors
with their types, and the catalog's attributes as tokens."""

from __future__ import annotations

import numpy as np

from models.dataset import to_examples
from models.examples import PAD
from models.inputs import NUMERIC_FEATURES, RAW_FEATURES


def test_each_candidate_gets_its_categorys_long_history_shares_and_attributes() -> None:
    n = 3
    user = {  # one object per value, as a request's rows share the user's (serving)
        "history_length": 3, "history_categories": ["Drama", "Comedy"], "history_category_counts": [2, 1],
        "history_item_ids": ["d2", "d1", PAD, "c1", PAD, PAD],
        "history_event_types": ["click", "impression", PAD, "purchase", PAD, PAD],
        "interest_categories": ["Comedy", "Drama"], "interest_weights": [3.0, 1.0],
        "seq_item_ids": ["c1", "d1", "d2"], "seq_event_types": ["click", "purchase", "click"],
        "seq_event_times": [100, 200, 900], "user_age": 25, "user_gender": "F", "user_occupation": "writer"}
    columns = {name: [None] * n for name in RAW_FEATURES} | {name: [v] * n for name, v in user.items()} | {
        "user_id": ["u1"] * n, "item_id": ["i1", "i2", "i3"], "category": ["Drama", "Comedy", "Horror"],
        "item_genres": [["Drama", "Romance"], ["Comedy"], None], "item_release_year": [1995, None, 1931]}
    ex = to_examples(columns, np.full(n, 500), np.zeros(n), sequence_length=4)

    assert ex.long_sequences.tolist() == [["d2", "d1"], ["c1", PAD], [PAD, PAD]]
    assert ex.long_types.tolist() == [["click", "impression"], ["purchase", PAD], [PAD, PAD]]
    share = NUMERIC_FEATURES.index("history_category_share")
    interest = NUMERIC_FEATURES.index("interest_category_share")
    np.testing.assert_allclose(ex.numeric[:, share], [2 / 3, 1 / 3, 0.0], rtol=1e-6)
    np.testing.assert_allclose(ex.numeric[:, interest], [0.25, 0.75, 0.0], rtol=1e-6)
    np.testing.assert_allclose(ex.numeric[:, NUMERIC_FEATURES.index("history_length")], np.log1p(3), rtol=1e-6)
    # behaviors before the request (t = 500), newest first, with their types
    assert ex.sequences[0].tolist() == ["d1", "c1", PAD, PAD]
    assert ex.sequence_types[0].tolist() == ["purchase", "click", PAD, PAD]
    assert [[t for t in row if t] for row in ex.item_tokens] == [
        ["genre:Drama", "genre:Romance", "year:1990s"], ["genre:Comedy"], ["year:1930s"]]
    assert [t for t in ex.user_tokens[0] if t] == ["gender:F", "occupation:writer", "age:20s"]
    assert ex.numeric_names == NUMERIC_FEATURES
