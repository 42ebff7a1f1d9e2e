"""Host-side page bookkeeping of the paged KV cache (glm5_jax.infer.pages): pool refcounts, radix prefix
matching against a brute-force reference, copy-on-write partial pages, LRU eviction, a random scheduler run."""
import random
from collections import Counter, deque

import numpy as np
import pytest

from glm5_jax.infer.pages import Match, PagePool, RadixCache


def test_pool_refcounts_and_errors():
    for bad in [dict(num_pages=0, page_size=4), dict(num_pages=4, page_size=0), dict(num_pages=2.5, page_size=4),
                dict(num_pages=4, page_size=True)]:
        with pytest.raises(ValueError, match="num_pages|page_size"):
            PagePool(**bad)
    pool = PagePool(np.int64(6), 4)
    assert (pool.num_pages, pool.page_size, pool.free) == (6, 4, 6)
    assert [pool.pages_for(t) for t in (0, 1, 4, 5, 8)] == [0, 1, 1, 2, 2]
    assert pool.alloc(0) == [] and pool.alloc(2) == [0, 1] and pool.alloc(3) == [2, 3, 4]
    assert pool.alloc(2) is None and pool.free == 1          # too few: allocates nothing
    pool.release([1, 3])
    assert pool.alloc(3) == [1, 3, 5]                         # lowest ids first
    pool.retain([1, 1])
    assert pool.refcount(1) == 3
    pool.release([1, 1])
    assert pool.refcount(1) == 1
    with pytest.raises(ValueError, match="page 2 has refcount 1"):
        pool.release([2, 0, 2])                               # atomic: nothing released
    assert pool.refcount(0) == pool.refcount(2) == 1
    pool.release([2])
    with pytest.raises(ValueError, match="free page"):
        pool.release([2])
    with pytest.raises(ValueError, match="free page"):
        pool.retain([2])
    with pytest.raises(ValueError, match="not in 0..5"):
        pool.retain([6])
    with pytest.raises(ValueError):
        pool.alloc(-1)
    assert pool.refcount(2) == 0 and pool.free == 1


class _Reference:
    """Brute force: every cached prefix (a tuple of page chunks) -> [page, last use]; LRU over leaf prefixes."""

    def __init__(self, pool):
        self.pool, self.P, self.cached, self.clock = pool, pool.page_size, {}, 0

    def chunks(self, toks, n):
        return tuple(tuple(toks[i * self.P:(i + 1) * self.P]) for i in range(n))

    def match(self, toks, limit):
        self.clock += 1
        k = 0
        while (k + 1) * self.P <= limit and self.chunks(toks, k + 1) in self.cached:
            k += 1
        pre = self.chunks(toks, k)
        for j in range(1, k + 1):
            self.cached[pre[:j]][1] = self.clock
        rest, best, partial = toks[k * self.P:k * self.P + min(limit - k * self.P, self.P - 1)], 0, None
        for key, entry in self.cached.items():                # dict order == insertion order, as the tree's
            if len(key) == k + 1 and key[:k] == pre:
                m = next((i for i, (a, b) in enumerate(zip(key[-1], rest)) if a != b), min(len(rest), self.P))
                if m > best:
                    best, partial = m, entry
        if partial is not None:
            partial[1] = self.clock
        return [self.cached[pre[:j]][0] for j in range(1, k + 1)], (partial[0], best) if partial else None

    def insert(self, toks, pages):
        self.clock += 1
        for j in range(1, len(pages) + 1):
            self.cached.setdefault(self.chunks(toks, j), [pages[j - 1], 0])[1] = self.clock

    def evict(self, n):
        freed = 0
        while freed < n:
            leaves = [(e[1], e[0], key) for key, e in self.cached.items() if self.pool.refcount(e[0]) == 1
                      and not any(len(o) == len(key) + 1 and o[:-1] == key for o in self.cached)]
            if not leaves:
                break
            del self.cached[min(leaves)[2]]
            freed += 1
        return freed


def test_match_insert_evict_against_brute_force():
    rng = random.Random(1)
    P = 3
    pool = PagePool(30, P)
    cache, ref = RadixCache(pool), _Reference(pool)
    bases = [[rng.randrange(3) for _ in range(15)] for _ in range(3)]
    checked_partial = checked_hit = evicted = 0
    for step in range(600):
        base = rng.choice(bases)
        toks = base[:rng.randrange(len(base) + 1)] + [rng.randrange(3) for _ in range(rng.randrange(8))]
        limit = rng.choice([None, max(0, len(toks) - 1), rng.randrange(len(toks) + 1)])
        m = cache.match(toks, limit)
        pages, partial = ref.match(toks, len(toks) if limit is None else limit)
        assert m == Match(pages, len(pages) * P, partial), step
        checked_hit += bool(pages)
        checked_partial += partial is not None
        pool.release(m.pages)
        if rng.random() < 0.6:                                # finish it: cache its whole pages
            n, duplicate = len(toks) // P, rng.random() < 0.3  # duplicate: recomputed into fresh pages
            m = cache.match(toks)
            ref.match(toks, len(toks))
            reuse = [] if duplicate else m.pages
            short = n - len(reuse) - pool.free
            if short > 0:
                freed = ref.evict(short)                       # the reference first: it reads refcounts
                assert cache.evict(short) == freed
                evicted += freed
            fresh = pool.alloc(n - len(reuse)) or []
            if len(reuse) + len(fresh) == n:
                before = len(ref.cached)
                ref.insert(toks, reuse + fresh)
                assert cache.insert(toks, reuse + fresh) == len(ref.cached) - before
            pool.release(m.pages + fresh)
        if rng.random() < 0.1:
            k = rng.randrange(4)
            freed = ref.evict(k)
            assert cache.evict(k) == freed
            evicted += freed
        assert cache.pages() == sorted(e[0] for e in ref.cached.values())
        assert all(pool.refcount(p) == 1 for p in cache.pages()) and pool.free + cache.cached_pages == 30
    assert checked_hit > 50 and checked_partial > 50 and evicted > 50, (checked_hit, checked_partial, evicted)


def test_copy_on_write_partial_page_and_limit():
    P = 4
    pool = PagePool(8, P)
    cache = RadixCache(pool)
    s = list(range(1, 11))                                    # 2.5 pages
    s_pages = pool.alloc(3)
    with pytest.raises(ValueError, match="4 pages need more than 12 tokens, got 10"):
        cache.insert(s, s_pages + [7])
    assert cache.insert(s, s_pages[:2]) == 2                  # the caller may leave the partial third page out
    pool.release(s_pages)
    assert cache.match(s).pages == s_pages[:2] and cache.match(s).partial is None
    pool.release(s_pages[:2] * 2)
    t = s[:8] + [20, 21, 22, 23]                              # 3 whole pages sharing 2 with s
    m = cache.match(t)
    t_pages = m.pages + pool.alloc(1)
    assert cache.insert(t, t_pages) == 1
    pool.release(t_pages)
    prompt = s[:8] + [20, 21, 22, 99, 98]                     # 2 pages + 3 tokens of t's third page
    m = cache.match(prompt)
    assert m == Match(s_pages[:2], 8, (t_pages[2], 3))
    assert pool.refcount(t_pages[2]) == 1                     # the partial page is not retained
    pool.release(m.pages)
    assert cache.match(t, limit=len(t) - 1) == Match(s_pages[:2], 8, (t_pages[2], 3))
    pool.release(s_pages[:2])
    assert cache.match(t) == Match(t_pages, 12, None)
    pool.release(t_pages)
    assert cache.match(t[:8], limit=7) == Match(s_pages[:1], 4, (s_pages[1], 3))
    pool.release(s_pages[:1])
    assert cache.match(t, limit=5) == Match(s_pages[:1], 4, (s_pages[1], 1))
    pool.release(s_pages[:1])
    assert cache.match(t, limit=0) == Match([], 0, None)
    with pytest.raises(ValueError, match="limit"):
        cache.match(t, limit=-1)
    # copy-on-write under memory pressure: retaining the partial page keeps an evicting alloc off it
    u_pages = pool.alloc(2)
    assert cache.insert([7] * 8, u_pages) == 2
    pool.release(u_pages)
    m = cache.match(prompt)
    part = m.partial[0]
    pool.retain([part])
    assert (pool.free, cache.cached_pages, cache.evictable_pages) == (3, 5, 2)
    assert cache.alloc(6) is None and cache.cached_pages == 5  # cannot: evicts nothing
    own = cache.alloc(5)                                       # evicts u's pages, not the partial one
    assert part not in own and pool.refcount(part) == 2 and cache.pages() == sorted(s_pages[:2] + [part])
    pool.release(own + [part])
    assert part in cache.alloc(6) and cache.pages() == sorted(s_pages[:2])  # unretained, it is evictable
    assert cache.hit_tokens <= cache.queried_tokens


def _tree(P=2, num_pages=10):
    """root -> a0 -> {a1 -> a2, b1}: sequence a (6 tokens) inserted, then b (4 tokens) sharing a0."""
    pool = PagePool(num_pages, P)
    cache = RadixCache(pool)
    a, b = [1, 2, 3, 4, 5, 6], [1, 2, 7, 8]
    a_pages = pool.alloc(3)
    cache.insert(a, a_pages)
    pool.release(a_pages)
    m = cache.match(b)
    b_pages = m.pages + pool.alloc(1)
    cache.insert(b, b_pages)
    pool.release(b_pages)
    return pool, cache, a, b, a_pages, b_pages


def test_evict_lru_leaves_first_and_never_a_running_page():
    pool, cache, a, b, a_pages, b_pages = _tree()
    assert cache.cached_pages == cache.evictable_pages == 4 and pool.free == 6
    pool.release(cache.match(a + [9]).pages)                  # a used last: b's leaf is least recently used
    assert cache.evict(1) == 1 and cache.pages() == sorted(a_pages)
    assert cache.evict(1) == 1 and cache.pages() == sorted(a_pages[:2])  # a's leaf; a0, a1 wait for it
    assert cache.evict(1) == 1 and cache.pages() == [a_pages[0]]         # then its parent
    pool, cache, a, b, a_pages, b_pages = _tree()
    pool.release(cache.match(b).pages)                        # b used last: a's branch goes first
    assert cache.evict(2) == 2 and cache.pages() == sorted([a_pages[0], b_pages[1]])
    # a running sequence holds a0, a1: only a2 and b1 are evictable, and a0 stays while a1 is held
    pool, cache, a, b, a_pages, b_pages = _tree()
    running = cache.match(a[:4]).pages
    assert running == a_pages[:2] and cache.evictable_pages == 2
    assert cache.evict(10) == 2 and cache.pages() == sorted(a_pages[:2])
    assert [pool.refcount(p) for p in running] == [2, 2] and cache.evict(10) == 0
    assert cache.alloc(9) is None and cache.alloc(8) == sorted(set(range(10)) - set(running))
    pool.release(running)
    assert cache.evictable_pages == 2 and cache.evict(1) == 1 and cache.pages() == [a_pages[0]]
    # a held leaf (a partial page retained for its copy) pins its ancestors
    pool, cache, a, b, a_pages, b_pages = _tree()
    pool.retain([a_pages[2]])
    assert cache.evictable_pages == 1 and cache.evict(10) == 1 and cache.pages() == sorted(a_pages)
    # alloc evicts only what it needs, least recently used first
    pool, cache, a, b, a_pages, b_pages = _tree(num_pages=5)
    pool.release(cache.match(a).pages)
    assert pool.free == 1 and cache.alloc(2) == sorted([pool.num_pages - 1, b_pages[1]])
    assert cache.pages() == sorted(a_pages)


def test_insert_keeps_the_tree_page_and_rejects_misuse():
    pool, cache, a, b, a_pages, b_pages = _tree()
    dup = pool.alloc(3)                                       # a recomputed into fresh pages
    assert cache.insert(a + [0], dup) == 0 and cache.pages() == sorted(set(a_pages + b_pages))
    pool.release(dup)
    assert all(pool.refcount(p) == 0 for p in dup)           # the caller's duplicates are freed
    longer = pool.alloc(4)
    assert cache.insert(a + [5, 5], longer) == 1              # only the new fourth page is adopted
    pool.release(longer)
    assert [pool.refcount(p) for p in longer] == [0, 0, 0, 1]
    with pytest.raises(ValueError, match="already cached"):
        cache.insert([9, 9, 9, 9], [a_pages[1], pool.alloc(1)[0]])
    with pytest.raises(ValueError, match="free page"):
        cache.insert([9, 9], [pool.num_pages - 1])
    assert cache.cached_pages == 5


def test_clear_releases_everything_the_tree_holds():
    pool, cache, a, b, a_pages, b_pages = _tree()
    running = cache.match(b).pages
    cache.clear()
    assert cache.cached_pages == cache.evictable_pages == 0 and cache.pages() == []
    assert [pool.refcount(p) for p in running] == [1, 1] and pool.free == pool.num_pages - 2
    assert cache.match(a) == Match([], 0, None) and cache.evict(10) == 0
    pool.release(running)
    assert pool.free == pool.num_pages
    # a path thousands of pages deep (page_size 1): nothing recurses
    pool = PagePool(5000, 1)
    cache = RadixCache(pool)
    pages = pool.alloc(5000)
    assert cache.insert(np.arange(5000), pages) == 5000
    pool.release(pages)
    assert cache.evictable_pages == 5000 and cache.match(np.arange(6000)).tokens == 5000
    pool.release(pages)
    cache.clear()
    assert pool.free == 5000


def test_page_accounting_random_scheduler_run():
    rng = random.Random(0)
    P, N = 4, 40
    pool = PagePool(N, P)
    cache = RadixCache(pool)
    bases = [[rng.randrange(50) for _ in range(n)] for n in (9, 14, 22)]
    waiting, running = deque(), []          # a sequence: [tokens, pages, target length]
    seen = Counter()

    def check():
        holders = Counter(cache.pages())
        assert len(holders) == cache.cached_pages
        for toks, pages, _ in running:
            assert len(set(pages)) == len(pages) and len(pages) >= pool.pages_for(len(toks))
            holders.update(pages)
        assert [pool.refcount(p) for p in range(N)] == [holders[p] for p in range(N)]
        assert pool.free == N - len(holders)

    def alloc(n):
        cached = cache.cached_pages
        got = cache.alloc(n)
        live = set(cache.pages()).union(*(s[1] for s in running))   # the tree may have evicted some for this
        assert got is None or (len(got) == n and not live & set(got))   # never a live page
        seen["evicted"] += cached - cache.cached_pages
        return got

    def preempt(seq):
        running.remove(seq)
        pool.release(seq[1])
        waiting.appendleft([seq[0], [], seq[2]])            # recompute from its tokens so far
        seen["preempt"] += 1

    for _ in range(1000):
        op = rng.choices(["arrive", "admit", "step", "abort", "preempt"], [4, 3, 8, 1, 1])[0]
        if op == "arrive" or not (waiting or running):
            base = rng.choice(bases)
            prompt = base[:rng.randrange(len(base) + 1)] + [rng.randrange(50) for _ in range(rng.randrange(1, 9))]
            for _ in range(rng.choice([1, 1, 2, 4])):     # sometimes a group: n samples of one prompt
                waiting.append([prompt, [], len(prompt) + rng.randrange(1, 12)])
        elif op == "admit" and waiting:
            toks, _, target = waiting.popleft()
            m = cache.match(toks, limit=len(toks) - 1)
            if m.partial:
                pool.retain([m.partial[0]])                 # held until it is copied into the first own page
            own = alloc(pool.pages_for(len(toks)) - len(m.pages))
            if m.partial:
                assert m.partial[0] in cache.pages()       # still cached when the copy happens
                pool.release([m.partial[0]])
                seen["partial"] += 1
            if own is None:
                pool.release(m.pages)
                waiting.appendleft([toks, [], target])
            else:
                seen["hit"] += bool(m.pages)
                running.append([toks, m.pages + own, target])
        elif op == "step" and running:
            seq = rng.choice(running)
            seq[0] = seq[0] + [rng.randrange(50)]
            while pool.pages_for(len(seq[0])) > len(seq[1]):
                page = alloc(1)
                if page is None:                            # out of pages: preempt the largest other sequence
                    preempt(max(running, key=lambda s: (len(s[1]), s is not seq)))
                    if seq not in running:
                        break
                    continue
                seq[1] += page
            if seq in running and len(seq[0]) >= seq[2]:
                running.remove(seq)
                seen["adopted"] += cache.insert(seq[0], seq[1][:len(seq[0]) // P])
                pool.release(seq[1])
                seen["duplicate_freed"] += sum(pool.refcount(p) == 0 for p in seq[1][:len(seq[0]) // P])
                seen["finished"] += 1
        elif op == "abort" and running:
            seq = rng.choice(running)
            running.remove(seq)
            pool.release(seq[1])
        elif op == "preempt" and running:
            preempt(rng.choice(running))
        check()
    assert len(seen) == 7 and min(seen.values()) > 0 and min(seen[k] for k in ("preempt", "partial", "hit")) > 10, seen
    assert 0 < cache.hit_tokens < cache.queried_tokens
    for seq in list(running):
        running.remove(seq)
        pool.release(seq[1])
    check()
    assert all(pool.refcount(p) == (p in cache.pages()) for p in range(N))
    assert pool.free + cache.cached_pages == N and cache.evictable_pages == cache.cached_pages
    cached = cache.cached_pages
    assert cache.evict(N) == cached
    assert cache.cached_pages == 0 and pool.free == N


def test_a_partial_last_page_is_a_leaf_that_later_prompts_copy():
    """A finished sequence of 2.5 pages caches its partial third page as a leaf keyed by its 2 tokens: a later
    turn that extends it matches 2 pages plus (that page, 2) to copy; a whole-page lookup never lands on it."""
    P = 4
    pool = PagePool(6, P)
    cache = RadixCache(pool)
    s = list(range(1, 11))
    pages = pool.alloc(3)
    assert cache.insert(s, pages) == 3
    pool.release(pages)
    m = cache.match(s + [50, 51, 52])
    assert m == Match(pages[:2], 8, (pages[2], 2))
    pool.release(m.pages)
    m = cache.match(s[:8] + [9, 99, 98, 97])                # one token of the partial page, then differs
    assert m == Match(pages[:2], 8, (pages[2], 1))
    pool.release(m.pages)
    whole = s[:8] + [9, 10, 11, 12]
    extra = pool.alloc(1)
    assert cache.insert(whole, pages[:2] + extra) == 1       # a whole third page beside the partial leaf
    pool.release(extra)
    assert cache.match(whole + [1]).pages == pages[:2] + extra
