"""Prefix cache: a radix tree over token ids whose pages hold K/V shared, not copied, between requests.

Granularity is `page_size` tokens (1 = token level): a request reuses the longest cached prefix made of whole pages.
A page holds the K/V of `page_size` consecutive tokens for every layer in tensors of its own storage,
(L, 2, B, H_kv, P, D), the sliding-window layers' apart (`PageKV`); a request's cache refers to its pages through
views, so the bytes are held once however many requests use them. A sliding-window layer resumes from the pages it
needs (its last W − 1 tokens before the reuse point are in them) and then keeps a private window, as without the
prefix cache. Pages are reference-counted while a request uses them; when the store holds more than
`budget_bytes`, the least recently used leaves whose pages nobody references are evicted (a page in use is never
freed, so the store can exceed the budget by the working set of the requests in flight).

The store also keeps whole compressed caches ("compress once, answer many"): `Entry` objects keyed by the context
and the configuration, under the same byte budget, reference counts and LRU order.

No paged attention kernel exists for CPU sdpa: a `PagedLayer` gathers its pages and private tail into one transient
tensor per attention call (as KIVI dequantizes), never kept; a plain layer concatenates on every update too.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers.cache_utils import DynamicLayer

from kvbench.model.cache import KV, gather_kv


@dataclass(eq=False)
class Page:
    data: Any  # PageKV: the K/V of P tokens for every layer (any object in unit tests)
    nbytes: int
    refs: int = 0


@dataclass(eq=False)
class Node:
    """A radix-tree edge: token ids (a multiple of page_size long) and one page per page_size of them."""

    tokens: tuple[int, ...] = ()
    pages: list[Page] = field(default_factory=list)
    parent: Node | None = None
    children: dict[tuple[int, ...], Node] = field(default_factory=dict)  # keyed by the child's first page
    last_use: int = 0

    def evictable(self) -> bool:
        return not self.children and self.parent is not None and all(p.refs == 0 for p in self.pages)


@dataclass(eq=False)
class Entry:
    """A compressed cache kept for reuse (compress once): `value` is whatever the caller stores."""

    value: Any
    nbytes: int
    refs: int = 0
    last_use: int = 0


@dataclass
class Stats:
    lookups: int = 0
    hits: int = 0  # lookups that reused at least one page (or found their entry)
    lookup_tokens: int = 0
    hit_tokens: int = 0
    evicted_bytes: int = 0

    @property
    def hit_rate(self) -> float:
        """Reused / looked-up tokens."""
        return self.hit_tokens / self.lookup_tokens if self.lookup_tokens else 0.0


class PrefixCache:
    def __init__(self, page_size: int = 16, budget_bytes: int | None = None):
        if page_size < 1:
            raise ValueError("page_size must be >= 1")
        self.page_size, self.budget_bytes = page_size, budget_bytes
        self.root = Node()
        self.entries: dict[Any, Entry] = {}
        self.nbytes = 0
        self.stats = Stats()
        self._clock = itertools.count(1)

    # ---- the radix tree ---------------------------------------------------------------------------------
    def _chunks(self, ids) -> list[tuple[int, ...]]:
        """The whole pages of `ids` as tuples (a trailing partial page is never cached)."""
        p = self.page_size
        return [tuple(ids[i : i + p]) for i in range(0, len(ids) - len(ids) % p, p)]

    def _walk(self, chunks: list[tuple[int, ...]], split: bool):
        """Follow `chunks` from the root: (pages matched, the deepest node, its depth in pages). With `split`, a
        node matched part-way is split so that the match ends on a node boundary (insert needs that)."""
        node, pages, now = self.root, [], next(self._clock)
        i = 0
        while i < len(chunks):
            child = node.children.get(chunks[i])
            if child is None:
                break
            n_child = len(child.pages)
            same = 0
            while (
                same < n_child
                and i + same < len(chunks)
                and child.tokens[same * self.page_size : (same + 1) * self.page_size] == chunks[i + same]
            ):
                same += 1
            child.last_use = now
            if same < n_child:
                if split:
                    child = self._split(child, same)
                pages += child.pages[:same]
                return pages, child, i + same
            pages += child.pages
            node, i = child, i + n_child
        return pages, node, i

    def _split(self, node: Node, n_pages: int) -> Node:
        """Split `node` after its first `n_pages` pages; returns the new upper node."""
        p = self.page_size
        upper = Node(node.tokens[: n_pages * p], node.pages[:n_pages], node.parent, {}, node.last_use)
        node.parent.children[upper.tokens[:p]] = upper  # type: ignore[union-attr]  # the root is never split
        node.tokens, node.pages, node.parent = node.tokens[n_pages * p :], node.pages[n_pages:], upper
        upper.children[node.tokens[:p]] = node
        return upper

    def match(self, ids, max_tokens: int | None = None) -> list[Page]:
        """The pages of the longest cached prefix of `ids` (at most `max_tokens` tokens); counts a lookup."""
        pages = self._walk(self._chunks(ids), split=False)[0]
        if max_tokens is not None:
            pages = pages[: max(0, max_tokens) // self.page_size]
        self.stats.lookups += 1
        self.stats.hits += bool(pages)
        self.stats.lookup_tokens += len(ids)
        self.stats.hit_tokens += len(pages) * self.page_size
        return pages

    def insert(self, ids, make_page) -> list[Page]:
        """Cache every whole page of `ids`; `make_page(i)` builds page i (tokens i·P … (i+1)·P) when it is new.
        Returns the pages of all whole pages of `ids`, cached before or now."""
        chunks = self._chunks(ids)
        pages, node, depth = self._walk(chunks, split=True)
        if depth < len(chunks):
            new = []
            for i in range(depth, len(chunks)):
                data, nbytes = make_page(i)
                new.append(Page(data, nbytes))
            tokens = tuple(t for c in chunks[depth:] for t in c)
            node.children[chunks[depth]] = Node(tokens, new, node, {}, next(self._clock))
            self.nbytes += sum(p.nbytes for p in new)
            pages = pages + new
        return pages

    def lock(self, pages: list[Page]) -> None:
        for page in pages:
            page.refs += 1

    def release(self, pages: list[Page]) -> None:
        for page in pages:
            if page.refs <= 0:
                raise RuntimeError("prefix cache: released a page that is not referenced")
            page.refs -= 1
        self.evict()

    def n_pages(self) -> int:
        def count(node: Node) -> int:
            return len(node.pages) + sum(count(c) for c in node.children.values())

        return count(self.root)

    # ---- compressed entries (compress once) -----------------------------------------------------------------
    def get(self, key, n_tokens: int = 0) -> Entry | None:
        """The entry stored under `key` (a context of `n_tokens` tokens), or None; counts a lookup."""
        entry = self.entries.get(key)
        self.stats.lookups += 1
        self.stats.lookup_tokens += n_tokens
        if entry is not None:
            entry.last_use = next(self._clock)
            self.stats.hits += 1
            self.stats.hit_tokens += n_tokens
        return entry

    def put(self, key, value, nbytes: int) -> Entry:
        entry = Entry(value, nbytes, last_use=next(self._clock))
        self.entries[key] = entry
        self.nbytes += nbytes
        return entry

    # ---- eviction --------------------------------------------------------------------------------------------
    def evict(self) -> None:
        """Evict least-recently-used unreferenced leaves and entries until the store fits its budget."""
        if self.budget_bytes is None:
            return
        while self.nbytes > self.budget_bytes:
            leaves = [n for n in self._nodes() if n.evictable()]
            free = [(e.last_use, k) for k, e in self.entries.items() if e.refs == 0]
            oldest_leaf = min(leaves, key=lambda n: n.last_use, default=None)
            oldest_entry = min(free, key=lambda x: x[0], default=None)
            if oldest_leaf is None and oldest_entry is None:
                return  # everything left is in use
            if oldest_entry is None or (oldest_leaf is not None and oldest_leaf.last_use < oldest_entry[0]):
                # (oldest_leaf is not None here: both None returned above)
                freed = sum(p.nbytes for p in oldest_leaf.pages)  # type: ignore[union-attr]
                del oldest_leaf.parent.children[oldest_leaf.tokens[: self.page_size]]  # type: ignore[union-attr]  # a leaf
            else:
                freed = self.entries.pop(oldest_entry[1]).nbytes
            self.nbytes -= freed
            self.stats.evicted_bytes += freed

    def _nodes(self):
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def storages(self) -> set[int]:
        """data_ptr of every storage the store holds (to tell a request's shared bytes from its own)."""
        ptrs = {
            t.untyped_storage().data_ptr()
            for n in self._nodes()
            for p in n.pages
            if isinstance(p.data, PageKV)
            for t in p.data.groups
        }
        for entry in self.entries.values():
            ptrs |= set(getattr(entry.value, "storages", ()))
        return ptrs


# ---- pages of K/V ------------------------------------------------------------------------------------------------
@dataclass(eq=False)
class PageKV:
    """One page's K/V for every layer: one tensor per group of layers, (L_g, 2, B, H_kv, P, D), the groups split by
    whether a request's cache refers to the page (a full-attention layer: a view of it) or keeps a private copy
    (a sliding-window layer holds its own last W − 1 tokens: kvbench.model.cache.keep_windows). A request then holds
    only its group's storage; the store holds both, for the sliding layers of a later request that resumes here."""

    groups: tuple[torch.Tensor, ...]
    where: tuple[tuple[int, int], ...]  # layer i → (its group, its row in the group)

    @property
    def n_tokens(self) -> int:
        return self.groups[0].shape[4]

    def layer(self, i: int) -> KV:
        """Layer i's keys and values (B, H_kv, P, D): views of the page."""
        group, row = self.where[i]
        return self.groups[group][row, 0], self.groups[group][row, 1]


def page_of(kv: list[KV], start: int, stop: int, private: frozenset[int] = frozenset()) -> tuple[PageKV, int]:
    """Tokens [start, stop) of every layer's K/V, copied into a page: the layers in `private` (sliding-window layers)
    in a tensor of their own, apart from the others'."""
    layers = [[i for i in range(len(kv)) if i not in private], sorted(i for i in private if i < len(kv))]
    layers = [group for group in layers if group]
    groups = tuple(
        torch.stack([torch.stack([kv[i][0][:, :, start:stop], kv[i][1][:, :, start:stop]]) for i in group])
        for group in layers
    )  # (L_g, 2, B, H_kv, P, D) each
    where = tuple(sorted(((i, (g, r)) for g, group in enumerate(layers) for r, i in enumerate(group))))
    page = PageKV(groups, tuple(w for _, w in where))
    return page, sum(t.numel() * t.element_size() for t in groups)


def gather_pages(pages: list[Page], layer_idx: int) -> KV:
    """One layer's K/V over `pages`, as new contiguous tensors (B, H_kv, n·P, D)."""
    kv = [p.data.layer(layer_idx) for p in pages]
    return torch.cat([k for k, _ in kv], dim=2), torch.cat([v for _, v in kv], dim=2)  # (B, H_kv, n·P, D) each


class PagedLayer(DynamicLayer):
    """A cache layer over shared blocks plus a private tail: `shared_keys`/`shared_values` are tensors the prefix
    cache owns (views of pages, or a stored compressed cache), (B, H_kv, T_i, D) each; `keys`/`values` hold only
    this request's tokens after them."""

    keys: torch.Tensor  # set at construction (DynamicLayer declares them Optional until lazy initialization)
    values: torch.Tensor

    def __init__(self, shared: list[KV], tail_keys: torch.Tensor, tail_values: torch.Tensor):
        super().__init__()
        self.lazy_initialization(tail_keys, tail_values)
        self.shared_keys = [k for k, _ in shared]
        self.shared_values = [v for _, v in shared]
        self.n_shared = sum(k.shape[2] for k in self.shared_keys)
        self.keys, self.values = tail_keys, tail_values

    def update(self, key_states, value_states, *args, **kwargs):
        self.keys = torch.cat([self.keys, key_states], dim=-2)  # (B, H_kv, T_tail + n, D)
        self.values = torch.cat([self.values, value_states], dim=-2)
        return self.kv()

    def kv(self) -> KV:
        """Shared blocks ++ tail as transient tensors (B, H_kv, T, D) for attention."""
        return torch.cat(self.shared_keys + [self.keys], dim=2), torch.cat(self.shared_values + [self.values], dim=2)

    def get_seq_length(self) -> int:
        return self.n_shared + self.keys.shape[-2]

    def select(self, index: torch.Tensor) -> None:
        """Decode-time eviction: the kept positions become private tensors; the shared blocks are let go."""
        self.keys, self.values = gather_kv(*self.kv(), index)
        self.shared_keys, self.shared_values, self.n_shared = [], [], 0

    def crop(self, tokens_to_remove: int) -> None:
        """transformers' crop: drop the last `-tokens_to_remove` tokens (a negative count, as DynamicLayer takes it).
        Within the private tail the shared blocks stay shared; cropping into them makes the rest private."""
        if tokens_to_remove > 0:
            raise ValueError(f"crop takes a negative count of tokens to remove, got {tokens_to_remove}")
        keep = max(self.get_seq_length() + tokens_to_remove, 0)
        if keep >= self.n_shared:
            n_tail = keep - self.n_shared
            self.keys, self.values = self.keys[..., :n_tail, :], self.values[..., :n_tail, :]  # (B, H_kv, n_tail, D)
            return
        keys, values = self.kv()  # (B, H_kv, T, D)
        self.keys, self.values = keys[..., :keep, :].clone(), values[..., :keep, :].clone()  # (B, H_kv, keep, D)
        self.shared_keys, self.shared_values, self.n_shared = [], [], 0


def shared_layer(keys: torch.Tensor, values: torch.Tensor) -> PagedLayer:
    """A request's layer over a stored (compressed) layer's K/V, with an empty private tail."""
    empty = keys.new_empty(*keys.shape[:2], 0, keys.shape[3])  # (B, H_kv, 0, D), a storage of its own
    return PagedLayer([(keys, values)], empty, empty.clone())


def share_pages(cache, prefill_kv: list[KV], pages: list[Page]):
    """Replace each layer of `cache` that still holds the prefill's own tensors (nothing evicted) by a PagedLayer
    over `pages` plus a private copy of the tokens after them; compressed layers are private already."""
    n_paged = sum(p.data.n_tokens for p in pages)
    for i, layer in enumerate(cache.layers):
        keys, values = prefill_kv[i]
        if type(layer) is DynamicLayer and layer.keys is keys and n_paged:
            tail_k, tail_v = keys[:, :, n_paged:].clone(), values[:, :, n_paged:].clone()  # (B, H_kv, T − paged, D)
            cache.layers[i] = PagedLayer([p.data.layer(i) for p in pages], tail_k, tail_v)
    return cache
