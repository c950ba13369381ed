"""What the live traffic replays: the history after the split, as sessions a user is served a list in, and
what the user does with the list. Two sources, by the spec's history:

- MovieLens (`source = "movielens"`): a user's ratings close together in time are one ranking request
  (the rated items are the candidates); an item rated >= movielens.click_min_rating is clicked. A
  /recommend list is judged by everything the user rates after the split.
- A history file (any spec, e.g. Instacart's orders): each request of the history is one session, its
  exposures (shown, or sampled by `[events.history] negatives`) the candidates, its actions what the user
  does with the items of it that they are shown, each with its own type (a purchase, a reorder). A
  /recommend list is judged by the session's actions: the products of the user's next order that
  appear in it are the positives, the rest of the list exposures.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from datetime import datetime

from infra.dataset import DatasetSpec
from infra.settings import Settings
from streaming.events import Event


@dataclass(frozen=True)
class Session:
    """One request's worth of the history: the candidates to rank and what the user acts on."""

    user_id: str
    key: str  # the history's request (or the session's start): part of every served request id
    candidates: tuple[str, ...]  # in the history's order
    actions: dict[str, str]  # item -> the strongest action type the user takes on it when shown
    at_ms: int = 0  # when it began in the history

    def request_id(self, served_at_ms: int) -> str:
        """Unique per serving: a session replayed again (another demo run) is another request."""
        return f"live:{self.user_id}:{self.key}@{served_at_ms}"


class Live:
    """The live part of the history: `sessions` in time order, `judged[user]` the session a /recommend
    list for the user is judged by, and `keys[item]` each item's key (its category)."""

    def __init__(self, s: Settings, split: datetime) -> None:
        self.s, self.spec = s, s.spec
        self.keys: dict[str, str] = {}
        if self.spec.history is not None and self.spec.history.source == "movielens":
            self.sessions, self.judged = self._movielens(split)
        else:
            self.sessions, self.judged = self._file(split)

    def _movielens(self, split: datetime) -> tuple[list[Session], dict[str, Session]]:
        from streaming.movielens import dataset_dir, load_item_categories, load_ratings, sessions

        data, cut = dataset_dir(self.s), int(split.timestamp())
        self.keys = load_item_categories(data / "ml-100k.item")
        live = [r for r in load_ratings(data / "ml-100k.inter") if r.timestamp >= cut]
        click, label = self.s.movielens.click_min_rating, self.spec.labels[0]

        def session(user: str, key: str, ratings) -> Session:
            return Session(user, key, tuple(dict.fromkeys(r.item_id for r in ratings)),
                           {r.item_id: label for r in ratings if r.rating >= click}, ratings[0].timestamp * 1000)

        by_user = defaultdict(list)
        for r in live:
            by_user[r.user_id].append(r)
        return ([session(x.user_id, str(x.start), x.ratings) for x in sessions(live)],
                {u: session(u, str(cut), ratings) for u, ratings in by_user.items()})

    def _file(self, split: datetime) -> tuple[list[Session], dict[str, Session]]:
        from streaming.history import history_events

        spec, cut = self.spec, split.timestamp() * 1000
        rank = {t: n for n, t in enumerate(spec.type_names)}
        requests: dict[str, list[Event]] = {}
        for e in history_events(self.s):
            if spec.key in e.context:
                self.keys[e.item_id] = str(e.context[spec.key])
            if e.event_time >= cut:
                requests.setdefault(e.request_id, []).append(e)
        sessions = []
        for request, events in requests.items():  # in the order of their first event
            actions: dict[str, str] = {}
            for e in events:
                if e.event_type in spec.positives and rank[e.event_type] > rank.get(actions.get(e.item_id), -1):
                    actions[e.item_id] = e.event_type
            shown = tuple(dict.fromkeys(e.item_id for e in events if e.event_type in spec.exposures))
            if shown and actions:
                sessions.append(Session(events[0].user_id, request, shown, actions, events[0].event_time))
        judged: dict[str, Session] = {}
        for sess in sessions:  # a user's first session after the split: their next order
            judged.setdefault(sess.user_id, sess)
        return sessions, judged

    def served_events(self, sess: Session, request_id: str, shown: list[str], t_ms: int, served_by: str
                      ) -> list[Event]:
        return served_events(self.spec, self.keys, sess, request_id, shown, t_ms, served_by)


def served_events(spec: DatasetSpec, keys: dict[str, str], sess: Session, request_id: str, shown: list[str],
                  t_ms: int, served_by: str) -> list[Event]:
    """What the user does with a list served for `request_id`: an exposure of each `shown` item (in rank
    order) at `t_ms`, and 1 ms later their action on each they act on. All carry the request id, so
    actions join to the prediction log and to the exposures, and the item's key (`keys`) as the spec's."""
    out = []
    for position, item in enumerate(shown):
        context = {"position": position, "served_by": served_by} | ({spec.key: keys[item]} if item in keys else {})
        kinds = [spec.exposures[0], *([sess.actions[item]] if item in sess.actions else [])]
        out += [Event(event_id=f"{request_id}:{item}:{kind}", user_id=sess.user_id, item_id=item, event_type=kind,
                      request_id=request_id, event_time=t_ms + delay, context=context)
                for delay, kind in enumerate(kinds)]
    return out
