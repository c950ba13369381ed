"""Online features for one ranking request, from the `ranking_serving` feature service: one pipelined
Redis round trip for all entity kinds (the user's hash, the candidates' distinct items not cached, the
user x category hashes), of the features the model consumes, read straight from Feast's layout
(feature_repo/online.py, proven equal to `get_online_features`) and joined back to one row per
candidate. The rows become model inputs by the function that builds training sets
(`contract.transform.to_examples`), so serving and training see the same features.

Item features are cached in the process for `serving.item_features_ttl_ms` (1 s by default): hot
items are read once per TTL, not once per request, at the cost of item counts up to that much older.

Documented defaults: a feature with nothing stored (a new user or item, a window without events, a
candidate sent without its category) is 0 after scaling, and an empty behavior sequence; every such
feature is named in the response's `defaulted_features`.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np

from contract.inputs import NUMERIC_FEATURES, RAW_FEATURES, TOKENS
from feature_repo.online import OnlineReader, served_features
from infra.settings import Settings

if TYPE_CHECKING:
    from contract.examples import Examples

SERVICE = "ranking_serving"


class Candidate(Protocol):
    """A candidate as the API parsed it (no copy per candidate on the request path)."""

    @property
    def item_id(self) -> str: ...

    @property
    def category(self) -> str: ...


_WARM_UP = "flywheel:warm-up"  # a made-up user and item id: nothing is stored for it


@dataclass(frozen=True)
class _WarmUp:
    item_id: str = _WARM_UP
    category: str = ""


# The snapshot's entries of the request, not one value per candidate: its user's behaviors, its context.
PER_REQUEST = ("sequence", "context")


@dataclass
class Fetched:
    examples: Examples  # one row per candidate
    defaulted: list[str]  # features missing for at least one candidate
    snapshot: dict[str, Sequence]  # raw feature values as read, for the prediction log


class SharedEntityCache:
    """Feature values of entities shared by every user's requests (candidate items), kept for `ttl_s`:
    a hot item is read from the online store once per TTL instead of once per request. Its windowed
    counts are then up to `ttl_s` older than the store's; 0 turns the cache off."""

    def __init__(self, ttl_s: float, max_entries: int) -> None:
        self.ttl_s, self.max_entries = ttl_s, max_entries
        self._values: OrderedDict[tuple, tuple[float, tuple]] = OrderedDict()  # (keys, entity) -> (read at, values)
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def get(self, keys: tuple[str, ...], entities: list[tuple]) -> dict[tuple, tuple]:
        if self.ttl_s <= 0:
            return {}
        fresh_after, found = time.monotonic() - self.ttl_s, {}
        with self._lock:
            for e in dict.fromkeys(entities):
                hit = self._values.get((keys, e))
                if hit is not None and hit[0] >= fresh_after:
                    found[e] = hit[1]
            self.hits += len(found)
        return found

    def put(self, keys: tuple[str, ...], read: dict[tuple, tuple]) -> None:
        if self.ttl_s <= 0:
            return
        now = time.monotonic()
        with self._lock:
            self.misses += len(read)
            for e, values in read.items():
                self._values[(keys, e)] = (now, values)
                self._values.move_to_end((keys, e))
            while len(self._values) > self.max_entries:
                self._values.popitem(last=False)  # the least recently read


class OnlineFeatures:
    def __init__(self, s: Settings) -> None:
        wanted = set(RAW_FEATURES)
        self.reads: dict[tuple[str, ...], list[tuple[str, str]]] = {}  # join keys -> (view, feature) read
        for keys, view, features in served_features(s, SERVICE):  # as the registry holds it
            refs = [(view, name) for name in features if name in wanted]
            if refs:
                self.reads.setdefault(keys, []).extend(refs)
        served = {name for refs in self.reads.values() for _, name in refs}
        if wanted - served:
            raise ValueError(f"feature service {SERVICE} lacks {sorted(wanted - served)}")
        self.names = {keys: [name for _, name in refs] for keys, refs in self.reads.items()}
        # Token columns built once per entity read (and cached with a shared entity), not once per row.
        self.tokens = {keys: [column for column, pairs in TOKENS.items() if all(f in names for _, f in pairs)]
                       for keys, names in self.names.items()}
        # A stalled Redis fails a read after this long (the caller bounds it by the request's deadline too).
        self.reader = OnlineReader(s, s.serving.default_deadline_ms / 1000)
        self.cache = SharedEntityCache(s.serving.item_features_ttl_ms / 1000, s.serving.item_features_cache_size)
        # A candidate's further keys (a brand beside its category) are the catalog's, as the stream counts events.
        self.groups = s.spec.group_by
        self.context_of = s.spec.context_of  # a request's declared context, the defaults where it lacks a field
        self.context_keys = s.spec.context_keys
        if self.groups:
            from streaming.history import ItemKeyFile, item_keys_path  # pandas: only where a spec groups further

            self.item_keys = ItemKeyFile(item_keys_path(s))

    def groups_of(self, item_ids: Sequence[str]) -> dict[str, list[str]]:
        """Each further key's value (the catalog's; "" for none) of each item."""
        if not self.groups:
            return {}
        of = [self.item_keys.values(i) for i in item_ids]
        return {k: [v[n] or "" if n < len(v) else "" for v in of] for n, k in enumerate(self.groups, 1)}

    @staticmethod
    def _shared(keys: tuple[str, ...]) -> bool:
        """An item's features are the same for every user: cached."""
        return "user_id" not in keys

    def _with_tokens(self, keys: tuple[str, ...], values: tuple, entity_tokens: Callable) -> tuple:
        """An entity's values as read, then its token columns (`to_examples` takes them as given), built
        by `contract.transform.entity_tokens`."""
        if not self.tokens[keys]:
            return values
        named = dict(zip(self.names[keys], values))
        return (*values, *(entity_tokens(column, named) for column in self.tokens[keys]))

    def entity_features(self, user_id: str, item_id: str | None = None, category: str | None = None,
                        context: Mapping[str, object] | None = None) -> dict[str, object]:
        """The raw values this server reads for a user (and an item, and the user x the item's category and
        further keys, a key that is a context field's value in a request's `context`), read now, bypassing the item
        cache; None where nothing is stored (`flywheel features`)."""
        request = self.context_of(context)
        of_item = {k: v[0] for k, v in self.groups_of([item_id]).items()} if item_id else {}
        given = {"user_id": user_id, "item_id": item_id, "category": category, **of_item,
                 **{k: request[k] for k in self.context_keys}}
        out: dict[str, object] = {}
        for keys, refs in self.reads.items():
            if all(given.get(k) for k in keys):
                out |= dict(zip(self.names[keys], self.reader.read(keys, [tuple(given[k] for k in keys)], refs)[0]))
        return out

    def warm(self) -> None:
        """Connect to the store and read once for an unknown user and item, so the first request pays no
        connection or first-call cost within its deadline (on a busy machine that passed 200 ms)."""
        self.reader.connect()
        self.fetch(_WARM_UP, [_WarmUp()], int(time.time() * 1000), 1)

    def fetch(self, user_id: str, candidates: Sequence[Candidate], now_ms: int, sequence_length: int,
              keep_behaviors: int | None = None, context: Mapping[str, object] | None = None) -> Fetched:
        """Inputs for scoring `candidates` for `user_id` at `now_ms` in the request's `context` (as sent: each
        declared field's value read by `DatasetSpec.context_of`); sequences keep the newest `keep_behaviors`
        (compute allocation) of at most `sequence_length`."""
        # Imported here, once a call: pandas, which they load, is not needed to read features (`flywheel features`).
        from contract.examples import PAD
        from contract.transform import entity_tokens, to_examples

        request = self.context_of(context)
        rows = {"user_id": [user_id] * len(candidates), "item_id": [c.item_id for c in candidates],
                "category": [c.category for c in candidates]} | self.groups_of([c.item_id for c in candidates]) | {
            k: [request[k]] * len(candidates) for k in self.context_keys}  # a page's: the request's, not the item's
        columns: dict[str, Sequence] = dict(rows) | {name: [value] * len(candidates) for name, value in request.items()}
        plan = []  # per entity kind: its keys, refs, the entity of each candidate row, found, missing
        for keys, refs in self.reads.items():
            of_row = list(zip(*(rows[k] for k in keys)))
            found = self.cache.get(keys, of_row) if self._shared(keys) else {}
            plan.append((keys, refs, of_row, found, [e for e in dict.fromkeys(of_row) if e not in found]))
        read = iter(self.reader.read_all([(keys, missing, refs) for keys, refs, _, _, missing in plan if missing]))
        for keys, refs, of_row, found, missing in plan:
            names = [*self.names[keys], *self.tokens[keys]]
            if missing:
                values = {e: self._with_tokens(keys, v, entity_tokens) for e, v in zip(missing, next(read))}
                if self._shared(keys):
                    self.cache.put(keys, values)
                found |= values
            by_row = [found[e] for e in of_row] or [(None,) * len(names)]
            columns.update(zip(names, zip(*by_row)))  # one tuple of values per feature
        defaulted = sorted(name for name in RAW_FEATURES if None in columns[name])
        n = len(candidates)
        ex = to_examples(columns, np.full(n, now_ms), np.zeros(n), sequence_length)
        if keep_behaviors is not None:
            ex.sequences[:, keep_behaviors:] = PAD
            ex.sequence_types[:, keep_behaviors:] = PAD
        # the stored numeric features as read (None: missing)
        snapshot: dict[str, Sequence] = {name: columns[name] for name in NUMERIC_FEATURES if name in columns}
        snapshot["sequence"] = [i for i in ex.sequences[0] if i != PAD]
        if request:  # what the request's context gave it: one for every candidate (PER_REQUEST)
            snapshot["context"] = request
        return Fetched(ex, defaulted, snapshot)
