"""The configurations of one example decoded together as one batch (`grid_batch`; `auto`, the default: where the
rows come out bit for bit as one by one — on the CPU with the C decode kernels, float32 and bfloat16 — and, without
them, in float32, where they come out token for token in every test; and only in a run of more than one requested
configuration besides the baseline, so a single method's run times each configuration's decode alone).

Why the kernels: torch's CPU products round a row differently depending on the batch's row count (MKL's float32
one-row and several-row products sum in different orders; oneDNN's bf16 kernels at some row counts — measured on
the bundled model: the MLP's down projection at 10 rows, the whole MLP at 3 — enough to flip a greedy token in
bf16). The CPU backend's kvbench/kernels/cpu/decode_linear.py (every linear layer, ≤ MAX_ROWS rows) and single_query.py
(one query per row) compute each row the same way whatever the batch, and a decode alone goes through the same
kernels, so a grid row is its one-by-one self.

A shared prefill serves every (method, budget) of a grid; each configuration is then compressed on its own, exactly
as alone (`Engine.compressed`), and the configurations whose caches are plain tensors decode as the rows of one
batch: one forward per step for all of them instead of one each. Their caches have different lengths (budgets,
PyramidKV's per-layer counts, decode-time eviction), so each layer stores the rows left-aligned in one
(B, H_kv, capacity, D) tensor with the pad slots after each row's tokens; the linear layers run on the whole
batch, the attention over each row's own slots (`PaddedKV`, kvbench.model.attention._rows_attention): one kernel call
for all rows, or without the kernel row by row by the call a batch-1 decode makes (one masked sdpa over the padded
batch rounds differently). Methods that evict while
decoding (H2O, StreamingLLM, TOVA, decoding) act on their own row: after each step `on_decode_step` runs on a
batch-1 view of that row with the row's slice of the step's statistics, and what it keeps is written back — so
every row keeps what it keeps alone.

Decoded alone instead (automatically, with `Engine.decode`, exactly today's path): caches with storage of their
own (KIVI, hf-quant), ragged heads (AdaKV), re-indexed positions (StreamingLLM positions=rolling), ring buffers
(StreamingLLM ring=true), model-changing methods (head merging, which has its own prefill), and every configuration
when only one would be in the batch. A model's window layers (Gemma 3's local layers: no method compresses them, and
decode-time eviction leaves them alone — `layer_select` skips a sliding layer) hold the same number of tokens in every
row, so they are stacked into one batch as they are (`GridWindowLayer`); a row's decode-time policy sees its window
as a batch-1 window layer (`GridWindowLayer.row`).
Finished rows leave by `fill_holes` (a kept row from the end moves into each hole: one row's slots copied); pad
slots are never written (attention reads a row's own slots; `PaddedKV.dense` zeroes them in a copy for the one
masked call over the batch). With a `reference` row (the full cache's, fidelity on), a row whose token first
differs from it is copied then (outside the decode's time) and forced along the answer from there: as a forked row
of the batch itself where it is fed the answer token by token and a reserved row is free (`DivergenceWatch`:
`BatchedGeneration.forced`), else by fidelity after the grid from the copy (`Divergence`,
kvbench.native.fidelity.resume).
Rows are grouped so padding at most triples the bytes a batch holds (`grid_padding`, default MAX_PADDING = 3), at
most MAX_ROWS per batch. Pads cost memory, never compute (each row attends over its own slots): a larger
`grid_padding` puts more configurations in one batch — fewer steps, more memory (README "Grid decoding").

Rows decoded together: `batch_size` = the configurations in the batch, `decode_s` = the batch's decode wall time
until this row finished (`decode_ms_per_token` = the batch's step time: the same for every configuration of the
batch, so per-method decode speed needs grid_batch=false), `decode_tokens_per_s` = the batch's. `kv_bytes` is the
row's own cache (its slots, not the pads); `peak_mem_bytes` = the shared prefill's peak or this configuration's own
compression peak (the caches compressed before it subtracted), the larger; the batch's decode peak is not
attributed (on the bundled model both came out equal to one by one's: the prefill's peak dominates).
"""

from __future__ import annotations

import copy
from typing import cast

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from kvbench.kernels.compact import compact_kv
from kvbench.methods import Budget, Method
from kvbench.model.attention import StatsRecorder, StatsRequest
from kvbench.model.cache import WindowLayer, kv_layer
from kvbench.model.padded import PaddedKV
from kvbench.native.batched import BatchedGeneration, Divergence, ForcedTail, Fork, decode_together
from kvbench.native.engine import KEEP_LOGITS_BYTES, Compressed, Engine, Generation, Prefill, one_forward
from kvbench.native.memory import reset_peak

MAX_PADDING = 3.0  # default `grid_padding`: a batch's padded bytes ≤ this × its rows' own bytes (+ one row: `groups`)
# rows per batch: the CPU backend's row-independent linear kernel takes a step of at most these (its MAX_ROWS, tested)
MAX_ROWS = 16
GROW = 32  # slots added at once when a row reaches the capacity (one copy per 32 steps, not per step)


class GridLayer(DynamicLayer):
    """One layer of rows with their own lengths: row r's tokens in slots [0, lengths[r]), pads after."""

    keys: torch.Tensor  # (B, H_kv, capacity, D), never None once built
    values: torch.Tensor

    def __init__(self, rows: list[tuple[torch.Tensor, torch.Tensor]], reserve: int = 0):
        super().__init__()
        keys = rows[0][0]  # (1, H_kv, T_0, D)
        self.lengths = [k.shape[2] for k, _ in rows]
        shape = (len(rows) + reserve, keys.shape[1], max(self.lengths) + GROW, keys.shape[3])
        # (B + reserve, H_kv, capacity, D) stored: rows `fork` may add, never written (nor faulted in) until then
        self.keys, self.values = keys.new_empty(shape)[: len(rows)], keys.new_empty(shape)[: len(rows)]  # (B, ...)
        for row, (k, v) in enumerate(rows):
            self.write(row, k, v)  # pads stay unwritten: attention reads a row's own slots (PaddedKV.dense else)
        self.device, self.dtype, self.is_initialized = keys.device, keys.dtype, True

    def write(self, row: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Row `row` now holds keys/values (1, H_kv, n, D)."""
        n = keys.shape[2]
        self.keys[row, :, :n], self.values[row, :, :n] = keys[0], values[0]
        self.lengths[row] = n

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append one token per row (B, H_kv, 1, D) after each row's own tokens."""
        if key_states.shape[2] != 1:
            raise ValueError("a grid-decoded cache takes one token per step")
        if max(self.lengths) == self.keys.shape[2]:
            self._grow(self._reserved(), GROW)
        rows = torch.arange(len(self.lengths), device=self.device)
        slots = torch.tensor(self.lengths, device=self.device)  # (B,)
        self.keys[rows, :, slots] = key_states[:, :, 0]  # (B, H_kv, D) into each row's next slot
        self.values[rows, :, slots] = value_states[:, :, 0]
        self.lengths = [n + 1 for n in self.lengths]
        used, lengths = max(self.lengths), list(self.lengths)
        return PaddedKV(self.keys[:, :, :used], None, lengths), PaddedKV(self.values[:, :, :used], None, lengths)

    def get_seq_length(self) -> int:
        return max(self.lengths)

    def _reserved(self) -> int:
        """Rows the tensors' storage holds past the batch (`reserve`, rows that left by `move_rows`): the batch is a
        view of the storage's first rows."""
        keys = self.keys
        if keys.storage_offset() != 0 or not keys.is_contiguous():
            return 0
        return keys.untyped_storage().nbytes() // (keys[0].numel() * keys.element_size()) - keys.shape[0]

    def _grow(self, rows: int, slots: int) -> None:
        """New tensors with `rows` more rows (unwritten) and `slots` more slots per row (zeros) than the batch's."""
        b, heads, capacity, dim = self.keys.shape
        for name in ("keys", "values"):
            old = getattr(self, name)
            new = old.new_empty(b + rows, heads, capacity + slots, dim)  # (B + rows, H_kv, capacity + slots, D)
            new[:b, :, :capacity], new[:b, :, capacity:] = old, 0
            setattr(self, name, new[:b])

    def fork(self, row: int) -> None:
        """A new last row holding a copy of row `row`'s tokens: a reserved row (else the tensors grow by one)."""
        b, n = self.keys.shape[0], self.lengths[row]
        if not self._reserved():
            self._grow(1, 0)
        shape, stride = (b + 1, *self.keys.shape[1:]), self.keys.stride()
        self.keys, self.values = (
            self.keys.as_strided(shape, stride),
            self.values.as_strided(shape, stride),
        )  # B + 1 rows
        self.keys[b, :, :n], self.values[b, :, :n] = self.keys[row, :, :n], self.values[row, :, :n]
        self.lengths.append(n)

    def keep_rows(self, keep: list[int]) -> None:
        """Only rows `keep` (batch indices) stay: finished rows leave the batch."""
        index = torch.tensor(keep, device=self.device)
        self.keys, self.values = self.keys[index], self.values[index]  # (B_kept, H_kv, capacity, D)
        self.lengths = [self.lengths[i] for i in keep]

    def move_rows(self, order: list[int]) -> None:
        """Row i becomes row order[i] (`fill_holes`: only rows past the kept count move): a moved row's own slots
        are copied, the others stay where they are, and the batch is the first len(order) rows (a view)."""
        for i, old in enumerate(order):
            if old != i:
                n = self.lengths[old]
                self.keys[i, :, :n], self.values[i, :, :n] = self.keys[old, :, :n], self.values[old, :, :n]
        self.keys, self.values = self.keys[: len(order)], self.values[: len(order)]  # (B_kept, H_kv, capacity, D)
        self.lengths = [self.lengths[old] for old in order]

    def snapshot(self, row: int) -> DynamicLayer:
        """A batch-1 layer holding a copy of row `row`'s tokens (1, H_kv, n, D)."""
        n = self.lengths[row]
        return kv_layer(self.keys[row : row + 1, :, :n].clone(), self.values[row : row + 1, :, :n].clone())

    def row(self, row: int) -> GridRow:
        """A batch-1 plain layer viewing row `row`'s tokens (no copy)."""
        return GridRow(self, row)


class GridRow(DynamicLayer):
    """A batch-1 view of one grid row's tokens (1, H_kv, n, D), for the row's method's decode-time policy. Its
    evictions (`select`, through cache.layer_select) compact the kept tokens inside the grid's own storage — the
    very tokens and order a gather gives a row alone — so nothing is copied out and back."""

    keys: torch.Tensor  # (1, H_kv, n, D), a view into the grid's storage
    values: torch.Tensor

    def __init__(self, grid: GridLayer, row: int):
        super().__init__()
        # what lazy_initialization sets, without its two empty tensors (a view is made per hooked row, layer, step)
        self.dtype, self.device, self.is_initialized = grid.dtype, grid.device, True
        self.grid, self.row, self.compacted = grid, row, False
        n = grid.lengths[row]
        self.keys, self.values = grid.keys[row : row + 1, :, :n], grid.values[row : row + 1, :, :n]

    def select(self, index: torch.Tensor) -> None:
        """Keep positions `index` (1, H_kv, N), sorted, in the row's slots [0, N)."""
        self.keys, self.values = compact_kv(self.keys, self.values, index)  # (1, H_kv, N, D)
        self.grid.lengths[self.row], self.compacted = index.shape[-1], True


class GridWindowLayer(WindowLayer):
    """A sliding-window layer of grid rows (Gemma 3's local layers, which no method compresses): the rows stand at
    the same position and none evicts while decoding, so their windows hold the same tokens' count and one
    (B, H_kv, ≤ W − 1, D) tensor steps as transformers' layer does — the attention of each row is the one it has
    alone (the CPU backend's single-query kernel is row-independent)."""

    keys: torch.Tensor  # (B, H_kv, ≤ W − 1, D), never None once built
    values: torch.Tensor

    def __init__(self, rows: list[WindowLayer]):
        super().__init__(sliding_window=rows[0].sliding_window)
        keys = [cast(torch.Tensor, r.keys) for r in rows]  # (1, H_kv, n, D) each
        values = [cast(torch.Tensor, r.values) for r in rows]
        seen = {r.cumulative_length for r in rows}
        if len({k.shape for k in keys}) > 1 or len(seen) > 1:
            raise ValueError("grid rows' window layers differ: such rows decode alone (decodes_in_grid)")
        self.lazy_initialization(keys[0], values[0])
        self.keys, self.values = torch.cat(keys), torch.cat(values)  # (B, H_kv, n, D)
        self.cumulative_length = seen.pop()

    @property
    def lengths(self) -> list[int]:
        return [self.keys.shape[2]] * self.keys.shape[0]

    def keep_rows(self, keep: list[int]) -> None:
        index = torch.tensor(keep, device=self.device)
        self.keys, self.values = self.keys[index], self.values[index]  # (B_kept, H_kv, n, D)

    def snapshot(self, row: int) -> WindowLayer:
        """A batch-1 window layer holding a copy of row `row`'s window."""
        layer = WindowLayer(sliding_window=self.sliding_window)
        keys, values = self.keys[row : row + 1].clone(), self.values[row : row + 1].clone()  # (1, H_kv, n, D)
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values, layer.cumulative_length = keys, values, self.cumulative_length
        return layer

    def row(self, row: int) -> WindowLayer:
        """A batch-1 window layer viewing row `row`'s window (no copy): a decode-time policy leaves it alone."""
        layer = WindowLayer(sliding_window=self.sliding_window)
        layer.lazy_initialization(self.keys[row : row + 1], self.values[row : row + 1])
        layer.keys, layer.values = self.keys[row : row + 1], self.values[row : row + 1]  # (1, H_kv, n, D)
        layer.cumulative_length = self.cumulative_length
        return layer

    def fork(self, row: int) -> None:
        """As GridLayer.fork: a new last row holding a copy of row `row`'s window (the rows stand at one position)."""
        self.keys = torch.cat([self.keys, self.keys[row : row + 1]])  # (B + 1, H_kv, n, D)
        self.values = torch.cat([self.values, self.values[row : row + 1]])

    def move_rows(self, order: list[int]) -> None:
        """As GridLayer.move_rows: every row holds as many tokens, so a moved row is copied whole."""
        for i, old in enumerate(order):
            if old != i:
                self.keys[i], self.values[i] = self.keys[old], self.values[old]
        self.keys, self.values = self.keys[: len(order)], self.values[: len(order)]  # (B_kept, H_kv, n, D)


def fill_holes(keep: list[int]) -> list[int]:
    """The batch order after rows leave, as few rows moved as can be: new batch index i holds old row order[i] —
    a kept row stays at its index, and each hole below the kept count takes a kept row from past it (one row's
    slots copied, not the whole batch's)."""
    n_kept = len(keep)
    movers = iter(i for i in keep if i >= n_kept)
    kept = set(keep)
    return [i if i in kept else next(movers) for i in range(n_kept)]


def grid_cache(caches: list[DynamicCache], reserve: int = 0) -> DynamicCache:
    """One cache of the rows' caches (each batch 1): plain layers' tensors copied into GridLayers (with `reserve`
    rows for `GridLayer.fork`), window layers stacked into GridWindowLayers."""
    cache = DynamicCache()
    for layer_idx in range(len(caches[0].layers)):
        rows = [c.layers[layer_idx] for c in caches]
        if type(rows[0]) is WindowLayer:
            cache.layers.append(GridWindowLayer(cast(list[WindowLayer], rows)))
            continue
        plain = cast(list[DynamicLayer], rows)
        kv = [(cast(torch.Tensor, r.keys), cast(torch.Tensor, r.values)) for r in plain]
        cache.layers.append(GridLayer(kv, reserve))
    return cache


def decodes_in_grid(method: Method, start: Compressed) -> bool:
    """Whether this configuration's cache can be a row of a grid batch (else it decodes alone)."""

    def whole_window(layer) -> bool:  # the model's window as it is (every row at this position holds the same)
        if type(layer) is not WindowLayer:
            return False
        return cast(torch.Tensor, layer.keys).shape[2] == min(layer.cumulative_length, layer.sliding_window - 1)

    return (
        method.caps.shares_prefill
        and not method.caps.decodes_alone
        and all(  # plain tensors, dense heads; the model's windows as they are (no policy evicts there)
            type(layer) is DynamicLayer or whole_window(layer) for layer in start.cache.layers
        )
        and start.cache.layers[0].keys.shape[0] == 1
        and start.hooks.position(start.position, start.cache) == start.position  # no re-indexed positions
    )


def groups(lengths: list[list[int]], max_rows: int = MAX_ROWS, max_padding: float = MAX_PADDING) -> list[list[int]]:
    """Rows (per-layer lengths each) in batches of at most `max_rows` whose padded bytes stay ≤ max_padding × their
    own (a last row that would be alone joins the batch before, if there is room); longest first. Padding costs
    memory only: every row attends over its own slots."""
    order = sorted(range(len(lengths)), key=lambda r: -sum(lengths[r]))
    out: list[list[int]] = []
    for r in order:
        if out and len(out[-1]) < max_rows:
            trial = out[-1] + [r]
            padded = len(trial) * sum(max(lengths[i][layer] for i in trial) for layer in range(len(lengths[r])))
            if padded <= max_padding * sum(sum(lengths[i]) for i in trial):
                out[-1] = trial
                continue
        out.append([r])
    if len(out) > 1 and len(out[-1]) == 1 and len(out[-2]) < max_rows:  # a last row alone would cost a decode of
        last = out.pop()  # its own: it joins the batch before (one more row's worth of padding at most)
        out[-1] += last
    return out


class RowsRecorder(StatsRecorder):
    """Records the statistics of some batch rows only (those whose method asked): the others' cost nothing."""

    def __init__(self, request, rows: list[int], device):
        super().__init__(request)
        self.rows = rows
        self._index = torch.tensor(rows, device=device)

    def record(self, layer_idx, query, key, scaling, mask=None, softcap=None) -> None:
        mask = mask if mask is None or mask.shape[0] == 1 else mask[self._index]  # (B_rows|1, 1|H_q, Q, T)
        super().record(layer_idx, query[self._index], key[self._index], scaling, mask, softcap)

    def record_query_moments(self, module, query, position_ids) -> None:
        super().record_query_moments(module, query[self._index], position_ids)


def row_stats(stats: StatsRecorder, row: int, lengths: list[int]) -> StatsRecorder:
    """The row's slice of a grid step's statistics: (1, H_q, T_row) per layer, its own slots only. `row`: its index
    among the recorded rows."""
    from kvbench.model.attention import QueryMoments

    out = StatsRecorder(stats.request)

    def own(by_layer: dict) -> dict:  # (B, H_q, T) per layer → (1, H_q, T_row)
        return {layer: t[row : row + 1, :, : lengths[layer]] for layer, t in by_layer.items()}

    def own_moments(m: QueryMoments) -> QueryMoments:  # (B, H_q, D), (B, H_q, D, D) → this row's
        return QueryMoments(m.count, m.total[row : row + 1], m.outer[row : row + 1], m.inv_freq, m.rope_scaling)

    out.window = {w: own(by_layer) for w, by_layer in stats.window.items()}
    out.all_queries = own(stats.all_queries)
    out.moments = {s: {layer: own_moments(m) for layer, m in d.items()} for s, d in stats.moments.items()}
    out.seconds = dict(stats.seconds)
    return out


def decode_step_on_row(grids: list[GridLayer], i: int, policy, stats) -> None:
    """Row i's decode-time policy (its hooks' on_decode_step) on a batch-1 view of its own slots, with its slice of
    the step's statistics, as alone; what it keeps is written back into its slots."""
    recorded = getattr(stats, "rows", [])
    layers = [grid.row(i) for grid in grids]
    view = DynamicCache()
    view.layers.extend(layers)
    before = [layer.keys for layer in layers]
    own = StatsRecorder(StatsRequest())
    if i in recorded:
        own = row_stats(stats, recorded.index(i), [g.lengths[i] for g in grids])
    policy.on_decode_step(view, own)
    for grid, layer, old in zip(grids, cast(list[GridRow], view.layers), before):
        if layer.keys is not old and not getattr(layer, "compacted", False):  # replaced: its tokens become the row's
            grid.write(i, cast(torch.Tensor, layer.keys), cast(torch.Tensor, layer.values))


class DivergenceWatch:
    """decode_together's `watch` for a grid with a reference row (the full cache's): each other row, at the step its
    token first differs from the reference's, is forked — a copy of its slots and decode-time state joins the batch
    as a new row fed the reference's tokens from then on (`Fork`: teacher forcing inside the grid, one step for all
    rows) — where it is in `forkable` and the batch has room (`room` rows, the grid's reserve); else it leaves a copy
    of its cache and state (`diverged`) that fidelity forces along the answer after the grid
    (kvbench.native.fidelity.resume). `forks`: row → (its forked row, the step it left at)."""

    def __init__(self, cache: DynamicCache, hooks: list, reference: int, positions: list[int], ids: list[int],
                 forkable: set[int], room: int):  # fmt: skip
        self.cache, self.hooks, self.reference, self.positions, self.ids = cache, hooks, reference, positions, ids
        self.forkable, self.room = forkable, room
        self.following = set(range(len(hooks))) - {reference}  # rows whose tokens are the reference's so far
        self.diverged: dict[int, Divergence] = {}
        self.forks: dict[int, tuple[int, int]] = {}

    def __call__(self, generated: list[list[int]], live: list[int]) -> list[Fork]:
        answer = generated[self.reference]
        forks: list[Fork] = []
        for row in sorted(self.following):
            step = len(generated[row]) - 1  # its newest token's
            if row not in live or step >= len(answer):  # finished along the answer, or past its end
                self.following.discard(row)
            elif generated[row][step] != answer[step]:
                self.following.discard(row)
                i = live.index(row)  # its batch index now
                if row in self.forkable and len(self.forks) < self.room:
                    for layer in self.cache.layers:
                        cast(GridLayer, layer).fork(i)  # the batch's next row
                    new = len(generated) + len(forks)  # the row decode_together gives it
                    self.hooks.append(copy.deepcopy(self.hooks[row]))
                    self.positions.append(self.positions[row])
                    self.ids.append(new)
                    self.forks[row] = new, step
                    forks.append(Fork(row, self.reference))
                    continue
                snapshot = DynamicCache()
                snapshot.layers.extend(cast(GridLayer, layer).snapshot(i) for layer in self.cache.layers)
                at = self.positions[row] + step  # the next token's position: `step` tokens decoded since its start
                self.diverged[row] = Divergence(step, snapshot, copy.deepcopy(self.hooks[row]), at)
        return forks


def decode_grid(
    engine: Engine,
    starts: list[Compressed],
    max_new_tokens: int,
    stop: tuple[str, ...],
    keep_logits: bool = False,
    follow: list[list[int]] | None = None,
    reference: int | None = None,
) -> list[BatchedGeneration]:
    """Decode configurations of one example (compressed, batch 1 each) as one batch, each row at its own position;
    keep_logits: every row keeps the distribution each of its tokens was read from; follow: row r is fed follow[r]
    (teacher forcing, kvbench.native.fidelity) instead of its own tokens. reference (with keep_logits): the row
    whose answer fidelity forces the others along (the full cache's) — a row whose token first differs from it is
    forked into the batch and forced there (`BatchedGeneration.forced`) or, without room, keeps a copy of its
    state then (`BatchedGeneration.divergence`); both copies are made outside the decode's time."""
    device, n_rows = engine.lm.device, len(starts)
    position = starts[0].position
    begin = [s.position for s in starts]  # each row's own position at the start (a fork's: its parent's)
    watched = keep_logits and reference is not None and not follow
    forkable = forkable_rows(engine, starts, reference) if watched else set()
    room = min(len(forkable), MAX_ROWS - n_rows)  # forks step with the rest: the linear kernel's rows at most
    cache = grid_cache([s.cache for s in starts], room)
    grids = cast(list[GridLayer], cache.layers)
    for s in starts:
        s.cache = None  # the grid holds copies: the rows' own tensors are freed
    token_bytes = [2 * layer.keys[0, :, 0].numel() * layer.keys.element_size() for layer in grids]

    ids = list(range(n_rows))  # the original row of each batch index (finished rows leave the batch)

    hooks = [s.hooks for s in starts]  # each row's own compression: its decode-time state

    def request(live: list[int]):
        merged = StatsRequest()
        for row in live:
            merged = merged | hooks[row].decode_request()
        return merged

    def recorder(step_request, live: list[int]) -> RowsRecorder:
        asking = [i for i, row in enumerate(live) if hooks[row].decode_request()]  # batch indices
        return RowsRecorder(step_request, asking, device)

    def after_step(stats, live: list[int]) -> None:
        for i, row in enumerate(live):
            if hooks[row].acts_while_decoding:
                decode_step_on_row(grids, i, hooks[row], stats)  # its decode-time policy on its own tokens

    watch = None
    if watched:
        watch = DivergenceWatch(cache, hooks, cast(int, reference), begin, ids, forkable, room)

    def drop_rows(keep: list[int]) -> list[int]:
        order = fill_holes(keep)
        for layer in cache.layers:
            cast(GridLayer, layer).move_rows(order)
        ids[:] = [ids[i] for i in order]
        return order

    done = decode_together(
        engine,
        cache,
        torch.stack([s.logits for s in starts]),  # (B, V)
        position,
        positions=lambda p, n: torch.tensor([[p + begin[row] - position] for row in ids], device=device),  # (B_live, 1)
        request=request,
        after_step=after_step,
        row_bytes=lambda row: sum(g.lengths[ids.index(row)] * b for g, b in zip(grids, token_bytes)),
        max_new_tokens=max_new_tokens,
        stop=stop,
        drop_rows=drop_rows,
        recorder=recorder,
        keep_logits=keep_logits,
        follow=follow,
        watch=watch,
        measure_peak=False,  # a grid row's peak is its compression's (`generate_grid`)
    )
    return [
        BatchedGeneration(
            token_ids=done.generated[row],
            text=engine.answer_text(done.generated[row], stop),
            context_tokens=s.position,
            prefill_s=s.prefill_s,
            decode_s=done.seconds[row],
            decode_steps=done.steps[row],
            kv_bytes=done.nbytes[row],
            **engine.baselines(s.position + done.steps[row]),
            peak_mem_bytes=s.prefill_peak,
            logits=done.logits[row],
            peak_mem_delta_bytes=s.prefill_peak - s.baseline_bytes,
            batch_size=n_rows,
            decode_tokens_per_s=done.tokens_per_s,
            batch_kv_bytes=sum(done.nbytes),  # forked rows too: the steps read them
            latency_s=s.prefill_s + done.seconds[row],
            divergence=watch.diverged.get(row) if watch is not None else None,
            forced=forced_tail(done, watch, row),
        )
        for row, s in enumerate(starts)
    ]


def forkable_rows(engine: Engine, starts: list[Compressed], reference: int | None) -> set[int]:
    """The rows a grid may fork (`DivergenceWatch`): fed the answer token by token (a cache fed it in one forward is
    forced from its compressed cache after the grid, in one forward), on the row-independent kernels (a forked row
    is then, bit for bit, its forcing alone). A model's window layers allow it: a grid's rows, and so a fork, stand
    at one position (`GridWindowLayer`)."""
    from kvbench.native.slots import decode_kernels

    if not decode_kernels(engine.lm.model):
        return set()
    return {r for r, s in enumerate(starts) if r != reference and not one_forward(s.hooks.method, s)}


def forced_tail(done, watch: DivergenceWatch | None, row: int) -> ForcedTail | None:
    """Row `row`'s forcing along the reference's answer, computed by its forked row (None: not forked)."""
    if watch is None or row not in watch.forks:
        return None
    fork, step = watch.forks[row]
    return ForcedTail(step, done.logits[fork], done.shares[fork])


def generate_grid(
    engine: Engine,
    prefill: Prefill,
    confs: list[tuple[Method, Budget | None]],
    suffix_ids: list[int],
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
    max_padding: float = MAX_PADDING,
    keep_logits: bool = False,
) -> list[Generation]:
    """`Engine.generate` for every configuration sharing `prefill`, those that can decoded together (in batches whose
    padded bytes stay ≤ max_padding × their own: `groups`); in order. keep_logits: every row keeps its decoding's
    distributions (at most KEEP_LOGITS_BYTES a row): the full cache's are the fidelity reference, and a row that
    followed the full cache's answer reads its columns from its own (kvbench.native.fidelity: no second pass).
    They change no measurement: a batched row's peak memory is its prefill's, and a row decoded alone keeps them in a
    buffer filled before its measurement starts."""
    device = engine.lm.device
    base = reset_peak(device)

    def held() -> int:
        """Memory the caches compressed so far hold (a process-wide peak counts them; a row alone would not)."""
        return max(0, reset_peak(device) - base)

    def alone(i: int) -> Generation:
        buffer = engine.logits_buffer(starts[i], max_new_tokens) if keep[i] else None  # (N, V): in use before
        before = held()
        gen = engine.decode(starts[i], confs[i][0], max_new_tokens, stop, logits_buffer=buffer)
        gen.peak_mem_bytes = max(starts[i].prefill_peak, gen.peak_mem_bytes - before)
        gen.peak_mem_delta_bytes = gen.peak_mem_bytes - starts[i].baseline_bytes
        return gen

    starts: list[Compressed] = []
    keep: list[bool] = []  # per configuration: whether its row keeps its distributions
    out: list[Generation | None] = [None] * len(confs)
    together = []
    for i, (method, budget) in enumerate(confs):
        start = engine.compressed(prefill, method, budget, suffix_ids, max_new_tokens)
        before = max(0, start.start_bytes - base)  # `held()` as its compression began: its own trim, not a second
        start.prefill_peak = max(prefill.peak_mem_bytes, start.prefill_peak - before)
        starts.append(start)
        keep.append(keep_logits and max_new_tokens * start.logits.numel() * 4 <= KEEP_LOGITS_BYTES)
        if decodes_in_grid(method, start):
            together.append(i)
        else:
            out[i] = alone(i)
            start.cache = None
    if len(together) > 1:
        lengths = [[layer.keys.shape[2] for layer in starts[i].cache.layers] for i in together]
        for group in groups(lengths, max_padding=max_padding):
            rows = [together[g] for g in group]
            if len(rows) == 1:
                continue  # alone below
            full = next((g for g, i in enumerate(rows) if confs[i][0].name == "full"), None)  # fidelity's reference
            kept = any(keep[i] for i in rows)
            gens = decode_grid(engine, [starts[i] for i in rows], max_new_tokens, stop, kept, reference=full)
            for i, gen in zip(rows, gens):
                out[i] = gen
                gen.logits = gen.logits if keep[i] else []  # a batch keeps every row's: only these are read
    for i in range(len(confs)):
        if out[i] is None:
            out[i] = alone(i)
    return out  # type: ignore[return-value]  # every slot filled
