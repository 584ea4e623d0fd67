"""The llama.cpp worker: runs in .venv-llamacpp (`make engine-llamacpp`), speaks protocol.py over stdin/stdout.

llama.cpp through its C API (llama-cpp-py-sync's CFFI bindings of llama.h, a prebuilt CPU build): the GGUF's own
quantized weights, K/V cache types (`type_k`/`type_v`), flash attention, greedy decoding on one sequence. kvbench's
token eviction runs inside the engine through `llama_memory_seq_rm`, which removes a position range from every layer
and every KV head at once: that is the granularity llama.cpp allows (no per-head or per-layer selection).

Requests: {"op": "start", "model_path", "n_ctx", "n_threads"} -> the model's shape; {"op": "generate", ...} with the
fields of base.EngineRequest -> the fields of base.EngineGeneration. With `reuse_prefix` (the uncompressed options)
the prompt's tokens that the previous request's sequence starts with are reused, as llama-server's prompt cache
does (`extra.cached_tokens`).

Cache bytes come from llama.cpp's own state-size API: `llama_state_seq_get_size` (the whole sequence) and
`llama_state_seq_get_size_ext(..., PARTIAL_ONLY)` (the sliding-window part of an iSWA cache, Gemma 3). Each part is
affine in the cells it holds: header + cells x (12 bytes of position/sequence id + that part's K/V rows of all its
layers). Two calibration tokens per context measure header and per-cell size; kv_bytes is cells x K/V row bytes of
each part (the tensors' bytes, without the 12-byte cell records), kv_bytes_full the same cells at f16.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import time
from pathlib import Path

import numpy as np

from kvbench import KvbenchError
from kvbench.engines import protocol

PARTIAL_ONLY = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY (SWA_ONLY in older headers): only the sliding-window cache
TYPES = {"f32": 0, "f16": 1, "q4_0": 2, "q4_1": 3, "q5_0": 6, "q5_1": 7, "q8_0": 8, "bf16": 30}
FLASH = {"auto": -1, "off": 0, "on": 1}
CELL_RECORD = 12  # bytes per cell in the state: position (i32), number of sequences (u32), one sequence id (i32)


def load_bindings():
    """llama.h's CFFI bindings; on a glibc < 2.38 the shim llamacpp_glibc.py built is loaded first,
    globally, so the wheel's four C23 symbols resolve to it."""
    spec = importlib.util.find_spec("llama_cpp_py_sync")
    if spec is None or spec.origin is None:
        raise KvbenchError("llama-cpp-py-sync is not installed in this venv: run `make engine-llamacpp`")
    shim = Path(spec.origin).parent / "libkvbench-isoc23.so"
    if shim.exists():
        ctypes.CDLL(str(shim), mode=ctypes.RTLD_GLOBAL)
    import cffi
    from llama_cpp_py_sync import __llama_cpp_tag__, __version__
    from llama_cpp_py_sync._cffi_bindings import get_ffi, get_lib

    ffi, lib = get_ffi(), get_lib()
    # the few ggml functions the eval callback needs (libggml-base), and the head of struct ggml_tensor
    # (type, buffer, ne[4], nb[4]: the layout ggml.h has kept since 2023)
    gffi = cffi.FFI()
    gffi.cdef(
        "struct kv_tensor_head { int32_t type; void * buffer; int64_t ne[4]; size_t nb[4]; };"
        "const char * ggml_get_name(const void * tensor);"
        "void ggml_backend_tensor_get(const void * tensor, void * data, size_t offset, size_t size);"
        "size_t ggml_row_size(int type, int64_t ne);"
    )
    base = next(iter(sorted(Path(spec.origin).parent.glob("libggml-base.so*"))))
    return ffi, lib, gffi, gffi.dlopen(str(base)), f"llama.cpp {__llama_cpp_tag__} (llama-cpp-py-sync {__version__})"


class Attention:
    """Collects, during one prefill, the softmaxed attention rows of the observation window's queries from every
    layer's `kq_soft_max-<il>` tensor (flash attention off), summed over layers, heads and window rows per KV cell."""

    def __init__(self, ffi, gffi, ggml, n_layer: int):
        self.ffi, self.gffi, self.ggml, self.n_layer = ffi, gffi, ggml, n_layer
        self.active = False
        self.callback = ffi.callback("bool(struct ggml_tensor *, bool, void *)", self._on_tensor)

    def begin(self, n_tokens: int, n_ubatch: int, window: int) -> None:
        self.active, self.n_ubatch, self.first = True, n_ubatch, n_tokens - window
        self.votes = np.zeros(n_tokens, dtype=np.float64)  # (T,) summed attention each KV cell received
        self.ubatch = -1  # ubatch k holds prompt tokens [k·n_ubatch, (k+1)·n_ubatch)
        self.layers_seen = 0

    def _on_tensor(self, tensor, ask, _user) -> bool:
        if not self.active:
            return not ask  # ask: "do you want this tensor?" no; after compute: True = go on
        name = self.gffi.string(self.ggml.ggml_get_name(self.ffi.cast("void *", tensor))).decode()
        if not name.startswith("kq_soft_max-"):
            return not ask
        if ask:
            return True
        if name == "kq_soft_max-0":
            self.ubatch += 1
        head = self.gffi.cast("struct kv_tensor_head *", int(self.ffi.cast("uintptr_t", tensor)))
        n_kv, rows, n_head = head.ne[0], head.ne[1], head.ne[2]  # kq: [n_kv, n_tokens of the ubatch, n_head, 1]
        start = self.ubatch * self.n_ubatch  # the ubatch's first prompt token
        lo = max(self.first - start, 0)
        if lo >= rows or head.type != 0:  # no window query in this ubatch (or not f32)
            return True
        block = np.empty((n_head, rows - lo, n_kv), dtype=np.float32)  # (H_q, window rows here, n_kv)
        for h in range(n_head):
            view = block[h]
            self.ggml.ggml_backend_tensor_get(
                self.ffi.cast("void *", tensor),
                self.gffi.cast("void *", view.ctypes.data),
                h * head.nb[2] + lo * head.nb[1],
                view.nbytes,
            )
        cells = min(n_kv, len(self.votes))
        self.votes[:cells] += block.sum(axis=(0, 1))[:cells]  # (n_kv,) pooled over heads and window rows
        self.layers_seen += 1
        return True


class Engine:
    def __init__(self) -> None:
        self.ffi, self.lib, self.gffi, self.ggml, self.version = load_bindings()
        self._quiet = self.ffi.callback("ggml_log_callback", lambda *_: None)
        if not os.environ.get("KVBENCH_LLAMACPP_LOG"):
            self.lib.llama_log_set(self._quiet, self.ffi.NULL)
        self.lib.llama_backend_init()
        self.model = None
        self.contexts: dict[tuple, tuple] = {}
        self.fed: tuple = (None, [])  # (context, the token ids its sequence 0 holds at positions 0..): a prompt cache

    # -- start -------------------------------------------------------------------------------------------------
    def start(self, model_path: str, n_ctx: int, n_threads: int) -> dict:
        if not Path(model_path).is_file():
            raise KvbenchError(f"the GGUF {model_path} does not exist")
        params = self.lib.llama_model_default_params()
        self.model = self.lib.llama_model_load_from_file(model_path.encode(), params)
        if self.model == self.ffi.NULL:
            raise KvbenchError(f"llama.cpp could not load {model_path} (set KVBENCH_LLAMACPP_LOG=1 to see why)")
        self.vocab = self.lib.llama_model_get_vocab(self.model)
        self.n_vocab = self.lib.llama_vocab_n_tokens(self.vocab)
        self.n_layer = self.lib.llama_model_n_layer(self.model)
        self.n_ctx_train = self.lib.llama_model_n_ctx_train(self.model)
        self.n_swa = self.lib.llama_model_n_swa(self.model)
        self.n_ctx, self.n_threads = min(n_ctx, self.n_ctx_train), n_threads
        self.attention = Attention(self.ffi, self.gffi, self.ggml, self.n_layer)
        return {
            "engine_version": self.version,
            "n_layer": self.n_layer,
            "n_head": self.lib.llama_model_n_head(self.model),
            "n_head_kv": self.lib.llama_model_n_head_kv(self.model),
            "n_swa": self.n_swa,
            "n_vocab": self.n_vocab,
            "n_ctx": self.n_ctx,
            "system": self.ffi.string(self.lib.llama_print_system_info()).decode(),
        }

    def context(self, type_k: str, type_v: str, flash: str, attention: bool, n_ctx: int):
        """A context per (cache types, flash attention, attention capture, size), made once: (ctx, calibration)."""
        key = (type_k, type_v, flash, attention, n_ctx)
        if key not in self.contexts:
            for ctx, _ in self.contexts.values():  # one context at a time: the peak RSS is this option's
                self.lib.llama_free(ctx)
            self.contexts.clear()
            params = self.lib.llama_context_default_params()
            params.n_ctx = params.n_batch = n_ctx  # one llama_decode call per prompt; ubatches of n_ubatch inside
            params.n_ubatch = 512
            params.n_threads = params.n_threads_batch = self.n_threads
            params.type_k, params.type_v = TYPES[type_k], TYPES[type_v]
            params.flash_attn_type = FLASH[flash]
            params.no_perf = True
            if attention:
                params.cb_eval = self.attention.callback
            ctx = self.lib.llama_init_from_model(self.model, params)
            if ctx == self.ffi.NULL:
                raise KvbenchError(
                    f"llama.cpp refused type_k={type_k} type_v={type_v} flash_attn={flash} (a quantized V cache needs "
                    "flash_attn=on)"
                )
            self.contexts[key] = (ctx, self.calibrate(ctx))
        return self.contexts[key]

    def state(self, ctx) -> tuple[int, int]:
        """(full-attention part, sliding-window part) of the sequence's state size, in bytes."""
        total = self.lib.llama_state_seq_get_size(ctx, 0)
        swa = self.lib.llama_state_seq_get_size_ext(ctx, 0, PARTIAL_ONLY)
        return total - swa, swa

    def calibrate(self, ctx) -> list[tuple[int, int]]:
        """Per part, (header bytes, bytes per cell): the state after 1 and after 2 tokens."""
        mem = self.lib.llama_get_memory(ctx)
        self.lib.llama_memory_clear(mem, True)
        self.decode(ctx, [0], 0, logits=False)
        one = self.state(ctx)
        self.decode(ctx, [0], 1, logits=False)
        two = self.state(ctx)
        self.lib.llama_memory_clear(mem, True)
        return [(a - (b - a), b - a) for a, b in zip(one, two)]

    def kv_bytes(self, ctx, calibration, type_k: str, type_v: str, fed: int) -> dict:
        """The sequence's K/V tensor bytes as llama.cpp holds them now; and the f16 cache of a run that evicted
        nothing after `fed` tokens: every token in the full-attention layers, the last n_swa in sliding ones."""
        width = 32 * 96  # any multiple of every type's block: the f16 ratio below is exact
        row = self.ggml.ggml_row_size(TYPES[type_k], width) + self.ggml.ggml_row_size(TYPES[type_v], width)
        row_f16 = 2 * self.ggml.ggml_row_size(TYPES["f16"], width)
        out: dict = {"kv_bytes": 0, "kv_bytes_full": 0, "cells": [], "state_bytes": 0}
        for part, (size, (header, per_cell)) in enumerate(zip(self.state(ctx), calibration)):
            out["state_bytes"] += size
            if per_cell <= 0:  # no such part (a model without sliding-window layers)
                out["cells"].append(0)
                continue
            cells, rest = divmod(size - header, per_cell)
            if rest or cells < 0:
                raise KvbenchError(f"llama.cpp's state size {size} is not header {header} + cells x {per_cell}")
            out["cells"].append(cells)
            out["kv_bytes"] += cells * (per_cell - CELL_RECORD)  # every layer's K and V rows of this part's cells
            full_cells = fed if part == 0 else min(fed, self.n_swa)
            out["kv_bytes_full"] += full_cells * (per_cell - CELL_RECORD) * row_f16 // row
        return out

    # -- decoding ----------------------------------------------------------------------------------------------
    def decode(self, ctx, ids: list[int], pos0: int, logits: bool = True) -> None:
        """One llama_decode of `ids` at positions pos0.. on sequence 0; logits of the last token only."""
        batch = self.lib.llama_batch_init(len(ids), 0, 1)
        try:
            batch.n_tokens = len(ids)
            for i, token in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos0 + i, 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = logits and i == len(ids) - 1
            code = self.lib.llama_decode(ctx, batch)
        finally:
            self.lib.llama_batch_free(batch)
        if code != 0:
            raise KvbenchError(f"llama_decode returned {code} ({len(ids)} tokens at position {pos0})")

    def logits(self, ctx) -> np.ndarray:
        """The last decoded token's logits: (V,) float32 (a copy: the next decode overwrites llama.cpp's buffer)."""
        buffer = self.ffi.buffer(self.lib.llama_get_logits_ith(ctx, -1), self.n_vocab * 4)
        return np.frombuffer(buffer, dtype=np.float32).copy()

    def generate(self, request: dict) -> dict:
        if self.model is None:
            raise KvbenchError("the llamacpp worker got generate before start")
        knobs = request.get("knobs") or {}
        ids, max_new = [int(t) for t in request["prompt_ids"]], int(request["max_new_tokens"])
        stops = {int(t) for t in request.get("stop_ids") or []}
        type_k, type_v = knobs.get("type_k", "f16"), knobs.get("type_v", "f16")
        method = knobs.get("evict")  # None | "streamingllm" | "snapkv"
        flash = knobs.get("flash_attn", "auto")  # snapkv: off (kvbench's side checks it), to read attention
        need = len(ids) + max_new + 1
        if need > self.n_ctx_train:
            raise KvbenchError(f"{len(ids)}+{max_new} tokens exceed the model's context {self.n_ctx_train}")
        n_ctx = max(self.n_ctx, 1 << (need - 1).bit_length()) if need > self.n_ctx else self.n_ctx
        ctx, calibration = self.context(type_k, type_v, flash, method == "snapkv", n_ctx)
        mem = self.lib.llama_get_memory(ctx)
        n_keep = keep_count(request.get("budget"), len(ids)) if method else len(ids)
        evicting = bool(method) and n_keep < len(ids)  # kvbench's rule: a budget >= the prompt evicts nothing
        window = int(knobs.get("window_size", 32))
        shifted = knobs.get("positions", "kept") == "shifted"
        capture = method == "snapkv"  # also at no compression: the callback path must not change the tokens
        cached = self.reuse(ctx, mem, ids) if request.get("reuse_prefix") and not method else 0
        if not cached:
            self.lib.llama_memory_clear(mem, True)
        self.fed = (None, [])
        protocol.reset_peak_rss()

        t0 = time.perf_counter()
        if capture:
            self.attention.begin(len(ids), 512, window)
        try:
            self.decode(ctx, ids[cached:], cached)
        finally:
            self.attention.active = False
        logits = self.logits(ctx)
        held = list(range(len(ids)))  # positions the sequence holds (as decoded; shifting renumbers llama.cpp's)
        evicted: list[int] = []
        if evicting:
            if method == "streamingllm":
                start = int(knobs.get("start_size", 4))
                evicted = list(range(start, len(ids) - (n_keep - start)))
            else:
                evicted = snapkv_evict(self.attention.votes, n_keep, window, int(knobs.get("kernel_size", 5)))
                if self.attention.layers_seen != self.n_layer:
                    raise KvbenchError(
                        f"read attention from {self.attention.layers_seen} of {self.n_layer} layers "
                        "(kq_soft_max tensors): this llama.cpp build names them differently"
                    )
            self.remove(mem, evicted, shifted)
            gone = set(evicted)
            held = [p for p in held if p not in gone]
        first = int(logits.argmax())
        prefill_s = time.perf_counter() - t0
        tokens, margins = [first], [top2_margin(logits)]
        position = len(ids) - (len(evicted) if shifted else 0)  # the next token's position
        t1 = time.perf_counter()
        while len(tokens) < max_new and tokens[-1] not in stops:
            self.decode(ctx, [tokens[-1]], position)
            held.append(len(ids) + len(tokens) - 1)
            position += 1
            if evicting and method == "streamingllm" and knobs.get("evict_during_decode", True) and len(held) > n_keep:
                start = int(knobs.get("start_size", 4))
                oldest = held[start]  # the oldest non-sink token: the cache keeps its post-prefill size
                self.remove(mem, [oldest], shifted, relative=held)
                held.remove(oldest)
                evicted.append(oldest)
                position -= 1 if shifted else 0
            step = self.logits(ctx)
            tokens.append(int(step.argmax()))
            margins.append(top2_margin(step))
        decode_s = time.perf_counter() - t1
        if not method:  # what sequence 0 holds now, for the next request's prompt cache (the last token is not fed)
            self.fed = (ctx, ids + tokens[:-1])
        cache = self.kv_bytes(ctx, calibration, type_k, type_v, fed=len(ids) + len(tokens) - 1)
        return {
            "token_ids": tokens,
            "prefill_s": prefill_s,
            "decode_s": decode_s,
            "decode_steps": len(tokens) - 1,
            "kv_bytes": cache["kv_bytes"],
            "kv_bytes_full": cache["kv_bytes_full"],
            "peak_mem_bytes": protocol.peak_rss_bytes(),
            "engine_version": self.version,
            "extra": {
                "cells": cache["cells"],
                "state_bytes": cache["state_bytes"],
                "evicted_tokens": len(evicted),
                "evicted_positions": sorted(evicted)[:4096],
                "held_tokens": len(held),
                "top2_margins": margins,
                "flash_attn": flash,
                "n_ctx": n_ctx,
                "cached_tokens": cached,
            },
        }

    def reuse(self, ctx, mem, ids: list[int]) -> int:
        """llama.cpp's prompt cache (llama-server's `cache_prompt`): the previous request's tokens that this prompt
        starts with stay in sequence 0 and the rest are removed (llama_memory_seq_rm), so only the new tokens are
        decoded; at least the last prompt token is decoded again (its logits start the answer). Not on a model
        with sliding-window layers: their cells left the window as the sequence grew (llama-server then
        re-processes the prompt too). Returns the tokens reused (0: nothing, the caller clears the sequence)."""
        held_ctx, held = self.fed
        if held_ctx is not ctx or self.n_swa > 0:
            return 0
        common = 0
        for a, b in zip(held, ids[:-1]):
            if a != b:
                break
            common += 1
        if common == 0 or not self.lib.llama_memory_seq_rm(mem, 0, common, -1):
            return 0
        return common

    def remove(self, mem, positions: list[int], shifted: bool, relative: list[int] | None = None) -> None:
        """llama_memory_seq_rm over each contiguous run of `positions` (original positions), from the last run
        backwards; with `shifted` the later tokens' positions move down over the gap (llama_memory_seq_add)."""
        if relative is not None and shifted:  # held tokens were renumbered 0.. by earlier shifts: index = position
            positions = [relative.index(p) for p in positions]
        for lo, hi in reversed(runs(sorted(positions))):
            if not self.lib.llama_memory_seq_rm(mem, 0, lo, hi):
                raise KvbenchError(f"llama_memory_seq_rm refused positions [{lo}, {hi})")
            if shifted:
                self.lib.llama_memory_seq_add(mem, 0, hi, -1, lo - hi)


def runs(sorted_positions: list[int]) -> list[tuple[int, int]]:
    """[3,4,5,9] -> [(3, 6), (9, 10)]: half-open ranges for llama_memory_seq_rm."""
    out: list[tuple[int, int]] = []
    for p in sorted_positions:
        if out and out[-1][1] == p:
            out[-1] = (out[-1][0], p + 1)
        else:
            out.append((p, p + 1))
    return out


def keep_count(budget, n_prompt: int) -> int:
    """kvbench's Budget.tokens: a fraction in (0, 1] of the prompt, or a token count (> 1)."""
    if budget is None:
        return n_prompt
    value = float(budget)
    if value > 1:
        return min(int(value), n_prompt)
    return min(n_prompt, max(1, round(value * n_prompt)))


def snapkv_evict(votes: np.ndarray, n_keep: int, window: int, kernel: int) -> list[int]:
    """SnapKV pooled over all layers and heads: the window's votes for each earlier position, smoothed by a centred
    average of `kernel` (zero padding, as F.avg_pool1d), keep the top n_keep - window and the window itself."""
    n = len(votes)
    prefix = votes[: n - window]  # (T - W,) votes for the positions before the window
    if kernel > 1:
        padded = np.concatenate([np.zeros(kernel // 2), prefix, np.zeros(kernel // 2)])  # (T - W + k - 1,)
        prefix = np.convolve(padded, np.ones(kernel) / kernel, mode="valid")  # (T - W,)
    n_select = max(n_keep - window, 0)
    kept = set(np.argsort(-prefix, kind="stable")[:n_select].tolist())
    return [p for p in range(n - window) if p not in kept]


def top2_margin(logits: np.ndarray) -> float:
    """Top-1 minus top-2 logit: how close greedy decoding was to another token at this step."""
    top = np.partition(logits, -2)[-2:]  # (2,) the two largest, unordered
    return float(abs(top[1] - top[0]))


def main() -> None:
    engine: Engine | None = None

    def handle(request: dict) -> dict:
        nonlocal engine
        if engine is None:
            engine = Engine()
        op = request.get("op")
        if op == "start":
            return engine.start(
                request["model_path"], int(request.get("n_ctx", 4096)), int(request.get("n_threads", 1))
            )
        if op == "generate":
            return engine.generate(request)
        if op == "ping":
            return {"pid": os.getpid()}
        raise KvbenchError(f"unknown op {op!r}")

    protocol.serve(handle)


if __name__ == "__main__":
    main()
