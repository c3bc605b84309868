"""A small LRU cache bounded both in entries and in total weight (characters of its keys)."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

V = TypeVar("V")


class BoundedLRU(Generic[V]):
    """Least-recently-used map; evicts oldest entries once either bound is exceeded.

    The weight bound matters because keys are prompt texts: a count of entries alone would
    let a few huge documents pin hundreds of megabytes. It is shared with the gateway's
    heavy-work threads, which run policies on big bodies off the event loop: writes take a lock;
    a read does not (it runs on every request, several times, and each of its two dictionary
    steps is atomic; an entry evicted between them is simply returned once more).
    """

    def __init__(self, max_entries: int, max_weight: int) -> None:
        self.max_entries = max_entries
        self.max_weight = max_weight
        self._items: OrderedDict[Hashable, tuple[V, int]] = OrderedDict()
        self._weight = 0
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._items)

    def get(self, key: Hashable) -> V | None:
        item = self._items.get(key)
        if item is None:
            return None
        try:
            self._items.move_to_end(key)
        except KeyError:  # evicted by another thread just now
            pass
        return item[0]

    def put(self, key: Hashable, value: V, weight: int) -> None:
        if weight > self.max_weight:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._weight -= old[1]
            self._items[key] = (value, weight)
            self._weight += weight
            while len(self._items) > self.max_entries or self._weight > self.max_weight:
                _, (_, evicted_weight) = self._items.popitem(last=False)
                self._weight -= evicted_weight

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._weight = 0
