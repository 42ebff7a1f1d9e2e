"""Host-side bookkeeping of the paged KV cache (issue 65): pure Python + numpy, no device state.

The device keeps, per cache buffer, a pool of pages ``[layers, num_pages, page_size, W]``, and each running
sequence a page table (its page ids in order). ``PagePool`` says which pages are free and how many holders
each live page has; ``RadixCache`` remembers which whole pages hold which token prefixes, so a new request
reuses them by reference (the n samples of one prompt, multi-turn contexts, system prompts), copies a partial
last page (copy-on-write), and cached pages nobody else holds are evicted least-recently-used when the pool
runs short. Deterministic: LRU time is an operation counter, ties go to the lower page id.
"""
from __future__ import annotations

import heapq
from collections import Counter
from typing import NamedTuple

import numpy as np


class PagePool:
    """num_pages pages of page_size tokens, reference counted. Page ids 0..num_pages-1.

    shards > 1 (the device pool's pages split over the mesh's batch shards): shard s owns the pages
    s * per_shard .. (s + 1) * per_shard - 1 (per_shard = num_pages / shards) and `alloc(n, shard)` takes
    pages of that shard only; `local(page)` is a page's id within its shard (what a page table holds)."""

    def __init__(self, num_pages: int, page_size: int, shards: int = 1):
        for name, v in (("num_pages", num_pages), ("page_size", page_size), ("shards", shards)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
                raise ValueError(f"PagePool: {name} must be an integer >= 1, got {v!r}")
        if num_pages % shards:
            raise ValueError(f"PagePool: num_pages={num_pages} is not divisible by shards={shards}")
        self.num_pages = int(num_pages)
        self.page_size = int(page_size)
        self.shards, self.per_shard = int(shards), self.num_pages // int(shards)
        self._ref = np.zeros(self.num_pages, np.int64)
        # one heap per shard, so alloc hands out the shard's lowest free ids
        self._free = [list(range(s * self.per_shard, (s + 1) * self.per_shard)) for s in range(self.shards)]

    @property
    def free(self) -> int:
        """Pages with refcount 0."""
        return sum(map(len, self._free))

    def free_in(self, shard: int) -> int:
        """Free pages of one shard."""
        return len(self._free[shard])

    def shard_of(self, page: int) -> int:
        return int(page) // self.per_shard

    def local(self, pages):
        """Page ids within their shards (a page table's entries)."""
        return np.asarray(pages, np.int64) % self.per_shard

    def pages_for(self, tokens: int) -> int:
        """Pages needed to hold `tokens` tokens (ceil(tokens / page_size))."""
        return -(-int(tokens) // self.page_size)

    def alloc(self, n: int, shard: int = 0) -> list[int] | None:
        """n fresh pages of `shard` (refcount 1 each), lowest ids first; None (allocating nothing) if fewer than
        n are free there."""
        if n < 0:
            raise ValueError(f"PagePool.alloc: n must be >= 0, got {n}")
        free = self._free[shard]
        if n > len(free):
            return None
        pages = [heapq.heappop(free) for _ in range(n)]
        self._ref[pages] = 1
        return pages

    def _checked(self, pages, op: str) -> Counter:
        counts = Counter(int(p) for p in pages)
        for p, c in counts.items():
            if not 0 <= p < self.num_pages:
                raise ValueError(f"PagePool.{op}: page {p} is not in 0..{self.num_pages - 1}")
            need = c if op == "release" else 1
            if self._ref[p] < need:
                raise ValueError(f"PagePool.{op}: page {p} has refcount {self._ref[p]}, needs >= {need} "
                                 f"(listed {c} time(s); a free page cannot be {op}{'d' if op == 'release' else 'ed'})")
        return counts

    def retain(self, pages) -> None:
        """+1 on each page (a page listed twice gets +2); every page must be live. Atomic: all or none."""
        for p, c in self._checked(pages, "retain").items():
            self._ref[p] += c

    def release(self, pages) -> None:
        """-1 on each page; a page reaching 0 is free. Releasing a free page raises (and changes nothing)."""
        for p, c in self._checked(pages, "release").items():
            self._ref[p] -= c
            if self._ref[p] == 0:
                heapq.heappush(self._free[self.shard_of(p)], p)

    def refcount(self, page: int) -> int:
        """Holders of `page` (0: free)."""
        if not 0 <= page < self.num_pages:
            raise ValueError(f"PagePool.refcount: page {page} is not in 0..{self.num_pages - 1}")
        return int(self._ref[page])


class Match(NamedTuple):
    """RadixCache.match's answer: whole cached pages (retained for the caller), tokens == len(pages) *
    page_size, and partial = (page, m): a cached page whose first m tokens continue the match (not retained)."""
    pages: list[int]
    tokens: int
    partial: tuple[int, int] | None


class _Node:
    __slots__ = ("key", "page", "parent", "children", "last")

    def __init__(self, key: tuple, page: int, parent: _Node | None, last: int):
        self.key, self.page, self.parent, self.last = key, page, parent, last
        self.children: dict[tuple, _Node] = {}


def _ids(tokens) -> list[int]:
    return np.asarray(tokens, dtype=np.int64).reshape(-1).tolist()


class RadixCache:
    """Token prefixes of finished/running sequences, at page granularity, sharing pages by reference.
    The tree holds one reference on each page it caches; a page only the tree holds is evictable.

    A node is one page, keyed under its parent by the tuple of that page's page_size token ids. With a
    sharded pool (PagePool.shards > 1) each shard has its own tree (a page's prefix can only be shared by
    sequences on the page's shard): `match` / `alloc` take the shard, `insert` finds it from the pages.
    Counters for /metrics: ``queried_tokens`` (prompt tokens matched against the tree) and ``hit_tokens``
    (tokens the matches covered: whole pages plus the partial page's m)."""

    def __init__(self, pool: PagePool):
        self.pool = pool
        self.page_size = pool.page_size
        self._roots = [_Node((), -1, None, 0) for _ in range(pool.shards)]
        self._nodes: dict[int, _Node] = {}   # page -> its node: every page the tree holds
        self._clock = 0
        self.hit_tokens = 0
        self.queried_tokens = 0

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    def _walk(self, toks: list, limit: int | None, shard: int):
        """(the nodes of the longest whole-page match, the best partial node or None, its m); no side effects."""
        P = self.page_size
        if limit is not None and limit < 0:
            raise ValueError(f"RadixCache.match: limit must be >= 0, got {limit}")
        limit = len(toks) if limit is None else min(int(limit), len(toks))
        node, path = self._roots[shard], []
        while (len(path) + 1) * P <= limit:
            child = node.children.get(tuple(toks[len(path) * P:(len(path) + 1) * P]))
            if child is None:
                break
            node = child
            path.append(child)
        start = len(path) * P
        rest = toks[start:start + min(limit - start, P - 1)]
        best, best_node = 0, None
        for child in node.children.values():   # insertion order: the first among equal m wins
            m = 0
            while m < len(rest) and m < len(child.key) and child.key[m] == rest[m]:
                m += 1
            if m > best:
                best, best_node = m, child
        return path, best_node, best

    def peek(self, tokens, limit: int | None = None, shard: int = 0) -> int:
        """The tokens `match` would cover (whole pages + the partial page's m), changing nothing."""
        path, _, m = self._walk(_ids(tokens), limit, shard)
        return len(path) * self.page_size + m

    def match(self, tokens, limit: int | None = None, shard: int = 0) -> Match:
        """Longest cached whole-page prefix of tokens within `limit` tokens (default len(tokens)), pages retained
        for the caller (who releases them), plus the best partial continuation (page, m), 0 < m < page_size,
        tokens + m <= limit. The partial page is NOT retained: copy it before anything can evict it (retain it
        across an alloc that may evict, release it after the copy). Marks the matched path used (LRU). Only
        `shard`'s pages are matched (a sharded pool)."""
        toks = _ids(tokens)
        path, best_node, best = self._walk(toks, limit, shard)
        now, pages, partial = self._tick(), [n.page for n in path], None
        for n in path:
            n.last = now
        start = len(pages) * self.page_size
        if best_node is not None:
            best_node.last = now
            partial = (best_node.page, best)
        self.pool.retain(pages)
        self.queried_tokens += len(toks)
        self.hit_tokens += start + best
        return Match(pages, start, partial)

    def insert(self, tokens, pages) -> int:
        """Cache a sequence's pages: pages[i] holds tokens[i*P:(i+1)*P]; the last page may be partial (a leaf keyed
        by its fewer tokens, only ever copied: `match`'s partial), so len(tokens) > (len(pages) - 1) * P.
        Where the tree already has an equal chunk at that place it keeps its own page (the caller releases its
        duplicate as usual); pages it adopts are retained. Returns the number of pages newly adopted."""
        toks, P, pages = _ids(tokens), self.page_size, [int(p) for p in pages]
        if pages and len(toks) <= (len(pages) - 1) * P:
            raise ValueError(f"RadixCache.insert: {len(pages)} pages need more than {(len(pages) - 1) * P} tokens, "
                             f"got {len(toks)}")
        if not pages:
            return 0
        shard = self.pool.shard_of(pages[0])
        if any(self.pool.shard_of(p) != shard for p in pages):
            raise ValueError(f"RadixCache.insert: pages {pages} are not all on one shard")
        now, node, i = self._tick(), self._roots[shard], 0
        while i < len(pages) and (child := node.children.get(tuple(toks[i * P:(i + 1) * P]))) is not None:
            child.last = now
            node = child
            i += 1
        new = pages[i:]
        for p in new:
            if p in self._nodes:
                raise ValueError(f"RadixCache.insert: page {p} is already cached for other tokens")
        if len(set(new)) < len(new):
            raise ValueError(f"RadixCache.insert: a page is listed twice in {new}")
        self.pool.retain(new)   # raises (changing nothing) on a free page
        for p in new:
            key = tuple(toks[i * P:(i + 1) * P])
            child = _Node(key, p, node, now)
            node.children[key] = self._nodes[p] = child
            node = child
            i += 1
        return len(new)

    def _evictable(self, node: _Node) -> bool:
        return not node.children and self.pool.refcount(node.page) == 1

    def evict(self, n: int, shard: int | None = None) -> int:
        """Free up to n pages (of `shard`, or of any): repeatedly the least-recently-used leaf whose page only
        the tree holds (a parent whose children are gone becomes a leaf). Returns the number of pages freed."""
        heap = [(nd.last, p) for p, nd in self._nodes.items()
                if self._evictable(nd) and (shard is None or self.pool.shard_of(p) == shard)]
        heapq.heapify(heap)
        freed = 0
        while freed < n and heap:
            node = self._nodes.pop(heapq.heappop(heap)[1])
            parent = node.parent
            del parent.children[node.key]
            self.pool.release([node.page])
            freed += 1
            if parent.parent is not None and self._evictable(parent):
                heapq.heappush(heap, (parent.last, parent.page))
        return freed

    def alloc(self, n: int, shard: int = 0) -> list[int] | None:
        """pool.alloc(n, shard), evicting (that shard's pages) first as needed; None (evicting nothing) if even
        evicting cannot make n free."""
        short = n - self.pool.free_in(shard)
        if short > 0:
            if self.evictable(shard) < short:
                return None
            self.evict(short, shard)
        return self.pool.alloc(n, shard)

    def pages(self) -> list[int]:
        """Every page the tree holds, ascending."""
        return sorted(self._nodes)

    @property
    def cached_pages(self) -> int:
        """Pages the tree holds."""
        return len(self._nodes)

    @property
    def evictable_pages(self) -> int:
        """Pages evict(num_pages) would free now: those whose whole subtree only the tree holds."""
        return sum(self.evictable(s) for s in range(len(self._roots)))

    def evictable(self, shard: int) -> int:
        """evictable_pages of one shard's tree."""
        order, stack = [], list(self._roots[shard].children.values())
        while stack:   # iterative: a long sequence is a path thousands of pages deep
            node = stack.pop()
            order.append(node)
            stack.extend(node.children.values())
        ok: dict[int, bool] = {}
        for node in reversed(order):   # children before parents
            ok[node.page] = self.pool.refcount(node.page) == 1 and all(ok[c.page] for c in node.children.values())
        return sum(ok.values())

    def clear(self) -> None:
        """Release every page the tree holds and forget every prefix (e.g. after a weight swap). Counters stay."""
        pages = list(self._nodes)
        self._roots, self._nodes = [_Node((), -1, None, 0) for _ in self._roots], {}
        self.pool.release(pages)
