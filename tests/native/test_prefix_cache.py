"""The prefix cache: radix tree (insert, match, split, refcounts, LRU eviction under a budget) and pages."""

from __future__ import annotations

import pytest
import torch

from kvbench.model.cache import cache_from_kv, cache_nbytes
from kvbench.native.prefix_cache import PagedLayer, PrefixCache, gather_pages, page_of, share_pages


def make(tree: PrefixCache, ids, made: list | None = None):
    """Insert `ids` with pages whose data records the tokens they cover (10 bytes each)."""

    def page(i):
        if made is not None:
            made.append(i)
        return tuple(ids[i * tree.page_size : (i + 1) * tree.page_size]), 10

    return tree.insert(ids, page)


def test_insert_and_match_whole_pages():
    tree = PrefixCache(page_size=4)
    pages = make(tree, list(range(10)))  # 2 whole pages; tokens 8, 9 are a partial page: not cached
    assert [p.data for p in pages] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert tree.nbytes == 20 and tree.n_pages() == 2
    assert tree.match(list(range(10))) == pages
    assert tree.match([0, 1, 2, 3, 4, 5, 9, 9]) == pages[:1]  # diverges inside the second page
    assert tree.match([1, 2, 3, 4]) == []
    assert tree.match(list(range(10)), max_tokens=7) == pages[:1]  # a limit rounds down to whole pages
    assert tree.stats.lookups == 4 and tree.stats.hits == 3
    assert tree.stats.hit_tokens == 8 + 4 + 0 + 4 and tree.stats.lookup_tokens == 10 + 8 + 4 + 10


def test_insert_reuses_cached_pages_and_splits_nodes():
    tree = PrefixCache(page_size=2)
    first = make(tree, [1, 2, 3, 4, 5, 6])  # one node of 3 pages
    made = []
    second = make(tree, [1, 2, 3, 4, 9, 9], made)  # shares 2 pages, then diverges: the node splits after page 2
    assert made == [2]  # only the new page was built
    assert second[:2] == first[:2] and second[2] is not first[2]
    upper = tree.root.children[(1, 2)]
    assert upper.tokens == (1, 2, 3, 4) and set(upper.children) == {(5, 6), (9, 9)}
    assert tree.match([1, 2, 3, 4, 5, 6]) == first and tree.match([1, 2, 3, 4, 9, 9, 0]) == second
    assert tree.nbytes == 40 and tree.n_pages() == 4


def test_token_level_granularity():
    tree = PrefixCache(page_size=1)
    make(tree, [5, 6, 7])
    make(tree, [5, 6, 8])
    assert len(tree.match([5, 6, 7, 1])) == 3 and len(tree.match([5, 6, 9])) == 2 and tree.n_pages() == 4


def test_lru_eviction_under_a_budget():
    tree = PrefixCache(page_size=2, budget_bytes=40)
    a = make(tree, [1, 1, 2, 2])
    b = make(tree, [3, 3, 4, 4])
    tree.match([1, 1, 2, 2])  # a is now more recent than b
    c = make(tree, [5, 5, 6, 6])
    assert tree.nbytes == 60
    tree.evict()
    assert tree.nbytes == 40  # the least recently used leaf (b) went
    assert tree.match([3, 3, 4, 4]) == [] and tree.match([1, 1, 2, 2]) == a and tree.match([5, 5, 6, 6]) == c
    assert tree.stats.evicted_bytes == 20 and b[0].refs == 0


def test_eviction_goes_leaf_first():
    tree = PrefixCache(page_size=2, budget_bytes=10)
    make(tree, [1, 1, 2, 2])
    make(tree, [1, 1, 3, 3])  # split: parent (1,1) with leaves (2,2) and (3,3)
    tree.match([1, 1])  # the parent is the most recent, its leaves older: leaves go first, then the parent
    tree.evict()
    assert tree.nbytes == 10 and len(tree.match([1, 1, 2, 2])) == 1 and len(tree.match([1, 1, 3, 3])) == 1


def test_no_page_freed_while_referenced():
    tree = PrefixCache(page_size=2, budget_bytes=0)
    pages = make(tree, [1, 2, 3, 4])
    tree.lock(pages)
    tree.lock(pages[:1])  # two requests share the first page
    tree.evict()
    assert tree.match([1, 2, 3, 4]) == pages and tree.nbytes == 20  # over budget, but in use
    tree.release(pages)  # the first page is still held by the second request: nothing can go (leaf-first)
    assert tree.match([1, 2, 3, 4]) == pages
    tree.release(pages[:1])
    assert tree.match([1, 2, 3, 4]) == [] and tree.nbytes == 0
    with pytest.raises(RuntimeError):
        tree.release(pages[:1])


def test_entries_share_the_budget_and_refcounts():
    tree = PrefixCache(page_size=2, budget_bytes=30)
    make(tree, [1, 1, 2, 2])
    entry = tree.put("ctx", object(), 25)
    entry.refs += 1
    tree.evict()  # 45 > 30: the tree's pages go; the entry is in use
    assert tree.get("ctx") is entry and tree.n_pages() == 0 and tree.nbytes == 25
    entry.refs -= 1
    tree.budget_bytes = 10
    tree.evict()
    assert tree.get("ctx") is None and tree.nbytes == 0


def test_pages_are_shared_storage_and_paged_layer_matches_plain_kv():
    torch.manual_seed(0)
    kv = [(torch.randn(1, 2, 11, 4), torch.randn(1, 2, 11, 4)) for _ in range(3)]  # (B, H_kv, T, D) × 3 layers
    tree = PrefixCache(page_size=4)
    pages = tree.insert(list(range(11)), lambda i: page_of(kv, 4 * i, 4 * i + 4))
    assert len(pages) == 2 and tree.nbytes == 2 * 3 * 2 * 2 * 4 * 4 * 4  # pages × (L, 2, B, H, P, D) fp32
    assert len(pages[0].data.groups) == 1  # no sliding-window layer: one tensor
    keys, values = gather_pages(pages, 1)
    assert torch.equal(keys, kv[1][0][:, :, :8]) and torch.equal(values, kv[1][1][:, :, :8])

    cache = share_pages(cache_from_kv(kv), kv, pages)
    assert all(type(layer) is PagedLayer for layer in cache.layers)
    assert cache.layers[0].get_seq_length() == 11
    # the pages are counted once although every layer refers to them; the private tail is 3 tokens per layer
    assert cache_nbytes(cache) == tree.nbytes + 3 * (2 * 2 * 3 * 4 * 4)
    new_k, new_v = torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4)
    k, v = cache.layers[2].update(new_k, new_v)
    assert torch.equal(k, torch.cat([kv[2][0], new_k], 2)) and torch.equal(v, torch.cat([kv[2][1], new_v], 2))
    index = torch.tensor([0, 5, 11]).expand(1, 2, -1)  # (B, H_kv, 3)
    cache.layers[2].select(index)
    assert cache.layers[2].get_seq_length() == 3 and torch.equal(cache.layers[2].keys[:, :, 1], kv[2][0][:, :, 5])
    assert cache.layers[2].shared_keys == [] and tree.nbytes < cache_nbytes(cache)  # layers 0-1 still share


def test_window_layers_pages_are_apart_and_a_request_holds_only_the_others():
    """Sliding-window layers' K/V sit in a page tensor of their own: a request resumes them from the pages but keeps
    its own window, so its cache refers only to the other layers' page tensor; the store holds both."""
    from kvbench.model.cache import window_layer

    torch.manual_seed(0)
    kv = [(torch.randn(1, 2, 11, 4), torch.randn(1, 2, 11, 4)) for _ in range(3)]  # (B, H_kv, T, D) × 3 layers
    tree = PrefixCache(page_size=4)
    pages = tree.insert(list(range(11)), lambda i: page_of(kv, 4 * i, 4 * i + 4, frozenset({0, 2})))
    assert [g.shape[0] for g in pages[0].data.groups] == [1, 2]  # layer 1; layers 0 and 2
    assert tree.nbytes == 2 * 3 * 2 * 2 * 4 * 4 * 4  # every layer's tokens, as one tensor would hold
    for layer in range(3):
        keys, values = gather_pages(pages, layer)
        assert torch.equal(keys, kv[layer][0][:, :, :8]) and torch.equal(values, kv[layer][1][:, :, :8])
    cache = cache_from_kv(kv)
    for i in (0, 2):
        cache.layers[i] = window_layer(*kv[i], 4)  # the last 3 tokens, private
    cache = share_pages(cache, kv, pages)
    assert [type(layer).__name__ for layer in cache.layers] == ["WindowLayer", "PagedLayer", "WindowLayer"]
    shared, three_tokens = 2 * (1 * 2 * 2 * 4 * 4 * 4), 2 * 2 * 3 * 4 * 4  # 2 pages of layer 1; (K/V, H, 3, D) fp32
    assert cache_nbytes(cache) == shared + three_tokens + 2 * three_tokens  # + layer 1's tail + the 2 windows
    assert len(tree.storages()) == 4  # 2 pages × 2 groups


def test_paged_layer_crop_equals_cropping_the_plain_kv():
    shared = [(torch.randn(1, 2, 8, 4), torch.randn(1, 2, 8, 4)), (torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4))]
    tail = (torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4))
    for remove in (0, -2, -3, -5, -15, -20):
        layer = PagedLayer(shared, *tail)
        keys, values = layer.kv()  # (1, 2, 15, 4)
        layer.crop(remove)
        keep = max(15 + remove, 0)
        assert layer.get_seq_length() == keep
        got_keys, got_values = layer.kv()
        assert torch.equal(got_keys, keys[..., :keep, :]) and torch.equal(got_values, values[..., :keep, :])
        assert layer.n_shared == (12 if keep >= 12 else 0)  # blocks stay shared unless the crop reaches them
        if keep >= 12:
            assert layer.shared_keys[0] is shared[0][0]
    with pytest.raises(ValueError, match="negative count"):
        PagedLayer(shared, *tail).crop(3)
