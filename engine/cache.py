"""An LRU cache of prompt embeddings, keyed by card, prompt and encoder version."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch


class PromptEmbeddingCache:
    """Per-prompt embeddings (embeds [L, D], pooled [D], mask [L] or None).

    Keys carry the prompt encoder's weight version, so an encoder update can
    never serve a stale embedding even if `invalidate()` were forgotten.
    """

    def __init__(self, capacity: int = 4096):
        self.capacity = capacity
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[tuple, tuple] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: tuple) -> tuple[torch.Tensor, ...] | None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def put(self, key: tuple, value: tuple) -> None:
        if self.capacity <= 0:
            return
        with self._lock:
            self._entries[key] = value
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)

    def invalidate(self) -> None:
        with self._lock:
            self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)

    def stats(self) -> dict[str, int]:
        return {"cache/hits": self.hits, "cache/misses": self.misses, "cache/size": len(self)}
