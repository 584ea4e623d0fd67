"""Why a configuration lost quality (`diagnose=true`): teacher-force the full cache's answer through the full and
the compressed cache and compare them step by step.

Per decode step: KL(full ‖ compressed) of the next-token distribution and top-1 agreement. Per layer and KV head
(the original model's heads), from the decode queries: attention-mass recall — the share of the full cache's
attention that falls on positions the compressed cache still holds —, attention entropy full vs compressed, and,
where the task knows its evidence (`Example.evidence`), the share of evidence tokens kept and the evidence's
attention mass before and after. The attention rows come from the same chunked statistics path the methods use
(kvbench.model.attention's recorder, all-query column sums of a single decode query = its attention row); no eager
attention. Kept positions come from the compression (`Compression.kept`) and follow decode-time evictions through
kvbench.model.cache.SELECT_OBSERVERS. The verdict rule lives in kvbench.guide.verdict, the side table in
kvbench.diagnose_io.
"""

from __future__ import annotations

import contextlib
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from kvbench.methods.compression import Compression
from kvbench.model.attention import StatsRequest, recording
from kvbench.model.cache import SELECT_OBSERVERS
from kvbench.native.fidelity import per_step


@dataclass
class Pass:
    """One teacher-forced decode. Steps: the answer's tokens; attention/positions: one entry per decode forward."""

    token_ids: list[int]
    logits: list[torch.Tensor]  # per step (V,) fp32: the distribution the step's token was read from
    attention: list[list[torch.Tensor]] = field(default_factory=list)  # [forward][layer] (H_q, T_layer) fp32
    positions: list[list[torch.Tensor | None]] = field(default_factory=list)  # [forward][layer] (H_kv, T_layer)
    seconds: float = 0.0


class PositionTracker:
    """Original sequence positions of every entry a cache layer holds; None for a layer whose method evicted
    without recording what it kept (such layers get NaN diagnostics, never a guess)."""

    def __init__(self, cache, kept: list | None, n_prompt: int, kv_heads: list[int]):
        self.layer_index = {id(layer): i for i, layer in enumerate(cache.layers)}
        self.appended = [n_prompt] * len(cache.layers)  # the original position of each layer's next new token
        self.positions: list[torch.Tensor | None] = []
        for i, layer in enumerate(cache.layers):
            index = kept[i] if kept else None
            if index is not None:
                self.positions.append(index[0].cpu())  # (H_kv, N): batch 1
            elif layer.get_seq_length() == n_prompt:
                self.positions.append(torch.arange(n_prompt).expand(kv_heads[i], -1))  # (H_kv, T)
            else:
                self.positions.append(None)

    def sync(self, layer_idx: int, layer) -> None:
        """Append the positions of tokens the layer gained since the last look (always at its end)."""
        positions = self.positions[layer_idx]  # (H_kv, N) or None: unknown
        new = layer.get_seq_length() - (positions.shape[1] if positions is not None else 0)
        if positions is not None and new > 0:
            start = self.appended[layer_idx]
            added = torch.arange(start, start + new).expand(positions.shape[0], -1)  # (H_kv, new)
            self.positions[layer_idx] = torch.cat([positions, added], dim=1)
        self.appended[layer_idx] += max(new, 0) if positions is not None else 0

    def current(self, cache) -> list[torch.Tensor | None]:
        for i, layer in enumerate(cache.layers):
            self.sync(i, layer)
        return list(self.positions)

    def on_select(self, layer, index: torch.Tensor) -> None:
        i = self.layer_index.get(id(layer))
        if i is None or self.positions[i] is None:
            return
        self.sync(i, layer)
        self.positions[i] = self.positions[i].gather(1, index[0].cpu())  # type: ignore[union-attr]  # (H_kv, N): checked

    @contextlib.contextmanager
    def observing(self):
        SELECT_OBSERVERS.append(self.on_select)
        try:
            yield self
        finally:
            SELECT_OBSERVERS.remove(self.on_select)


@torch.inference_mode()
def teacher_forced(
    engine,
    prefill,
    method,
    budget,
    suffix_ids: list[int],
    answer: list[int] | None,
    max_new_tokens: int,
    stop: tuple[str, ...] = (),
) -> Pass:
    """Compress `prefill` with `method` (a prefill already holding a compressed cache, `Prefill.compressed`,
    gives that one) and feed `answer` token by token (None: decode greedily, as the engine does, which is how the
    full cache's answer is produced), recording every decode query's attention row."""
    start = time.perf_counter()
    method.bind(engine.lm)
    cache, hooks = prefill.compressed, prefill.compression
    if cache is None:
        hooks = method.begin(prefill.n_tokens, len(prefill.kv), budget)
        cache = hooks.run(prefill.kv, prefill.stats)
    elif hooks is None:  # a cache compressed elsewhere that carries no compression: nothing happens while decoding
        hooks = Compression(method, prefill.n_tokens, len(cache.layers), None)
    kv_heads = [keys.shape[1] for keys, _ in prefill.kv]
    tracker = PositionTracker(cache, hooks.kept, prefill.n_tokens, kv_heads)
    out = Pass([], [])
    with tracker.observing():
        logits, position = prefill.last_logits, prefill.n_tokens
        if suffix_ids:
            logits = engine._extend(cache, hooks, list(suffix_ids), position)
            position += len(suffix_ids)
        request = hooks.decode_request() | StatsRequest(all_queries=True)
        while True:
            token = answer[len(out.token_ids)] if answer is not None else int(logits.argmax())
            out.token_ids.append(token)
            out.logits.append(logits.float())
            with recording(request) as stats:
                logits = engine.forward([token], [hooks.position(position, cache)], cache)[-1]
            out.attention.append([stats.all_queries[i][0] for i in range(len(cache.layers))])  # (H_q, T_layer)
            out.positions.append(tracker.current(cache))  # aligned with the keys this query attended to
            hooks.on_decode_step(cache, stats)
            position += 1
            if _finished(engine, out.token_ids, answer, max_new_tokens, stop):
                break
    out.seconds = time.perf_counter() - start
    return out


def _finished(engine, tokens: list[int], answer, max_new_tokens: int, stop) -> bool:
    if answer is not None:
        return len(tokens) >= len(answer)
    if len(tokens) >= max_new_tokens or tokens[-1] in engine.eos_ids:
        return True
    return bool(stop) and any(s in engine.lm.tokenizer.decode(tokens, skip_special_tokens=True) for s in stop)


def answer_text(engine, tokens: list[int], stop: tuple[str, ...]) -> str:
    """The prediction text as the engine forms it (eos dropped, cut at the first stop string)."""
    text = engine.lm.tokenizer.decode([t for t in tokens if t not in engine.eos_ids], skip_special_tokens=True)
    for s in stop:
        text = text.split(s)[0] if s in text else text
    return text


def evidence_positions(tokenizer, ids: list[int], strings) -> torch.Tensor:
    """Token positions (sorted, long) of every occurrence of `strings` in the decoded `ids`."""
    pieces = [tokenizer.decode([i]) for i in ids]
    ends = torch.tensor([len(p) for p in pieces]).cumsum(0)  # (T,) char offset after each token
    text = "".join(pieces)
    found: set[int] = set()
    for s in strings:
        at = text.find(s)
        while s and at >= 0:
            first = int(torch.searchsorted(ends, at, right=True))  # first token ending after `at`
            last = int(torch.searchsorted(ends, at + len(s) - 1, right=True))
            found.update(range(first, last + 1))
            at = text.find(s, at + 1)
    return torch.tensor(sorted(found), dtype=torch.long)


def _entropy(p: torch.Tensor) -> torch.Tensor:
    """Entropy (nats) of each row of p (H, T)."""
    return -(p * p.clamp_min(1e-30).log()).sum(-1)  # (H,)


def compare(full: Pass, other: Pass, evidence: torch.Tensor, n_kv_heads: int) -> tuple[dict, list[dict]]:
    """Row columns and per-(layer, KV head) records of `other` against `full` (same answer tokens).

    Heads are the original model's KV heads (`n_kv_heads`): per-query-head numbers are averaged over each group, so
    a head-merged cache is compared head for head with the model it came from."""
    kl_steps, top1_steps = per_step(torch.stack(full.logits), torch.stack(other.logits))  # (n,), (n,)
    kl, top1 = kl_steps.tolist(), [int(t) for t in top1_steps.tolist()]  # the fidelity columns' definition
    diverged = [i for i, same in enumerate(top1) if not same]
    n_layers = len(full.attention[0])
    n_q = full.attention[0][0].shape[0]
    group = n_q // n_kv_heads
    names = [
        "mass_recall",
        "entropy_full",
        "entropy_compressed",
        "evidence_retention",
        "evidence_mass_full",
        "evidence_mass_compressed",
        "kept_share",
    ]
    sums = {k: torch.zeros(n_layers, n_q, dtype=torch.float64) for k in names}  # (L, H_q) accumulated over steps
    first_kept: list[list[str]] = [[""] * n_kv_heads for _ in range(n_layers)]
    has_evidence = evidence.numel() > 0
    unknown = set()
    for step, (rows_f, rows_c, positions) in enumerate(zip(full.attention, other.attention, other.positions)):
        for layer in range(n_layers):
            attn_f, attn_c, pos = rows_f[layer], rows_c[layer], positions[layer]  # (H_q, T_f), (H_q, T_c), (H_c, T_c)
            if pos is None:
                unknown.add(layer)
                continue
            pos_q = pos.repeat_interleave(n_q // pos.shape[0], dim=0)  # (H_q, T_c): each query head's KV head
            sums["mass_recall"][layer] += attn_f.gather(1, pos_q).sum(1).double()
            sums["entropy_full"][layer] += _entropy(attn_f).double()
            sums["entropy_compressed"][layer] += _entropy(attn_c).double()
            sums["kept_share"][layer] += pos_q.shape[1] / attn_f.shape[1]
            if has_evidence:
                is_evidence = torch.zeros(attn_f.shape[1], dtype=torch.bool)
                is_evidence[evidence] = True  # (T_f,)
                kept_evidence = is_evidence[pos_q]  # (H_q, T_c)
                sums["evidence_retention"][layer] += kept_evidence.sum(1).double() / evidence.numel()
                sums["evidence_mass_full"][layer] += attn_f[:, evidence].sum(1).double()
                sums["evidence_mass_compressed"][layer] += (attn_c * kept_evidence).sum(1).double()
                if step == 0:
                    for head in range(n_kv_heads):
                        kept = torch.isin(evidence, pos_q[head * group])
                        first_kept[layer][head] = "".join("1" if k else "0" for k in kept.tolist())
    n_steps = len(full.attention)
    nan = float("nan")
    records: list[dict[str, Any]] = []
    for layer in range(n_layers):
        for head in range(n_kv_heads):
            record: dict[str, Any] = {"layer": layer, "kv_head": head}
            for k in names:
                value = float(sums[k][layer, head * group : (head + 1) * group].mean()) / n_steps
                record[k] = nan if layer in unknown or (k.startswith("evidence") and not has_evidence) else value
            record["evidence_kept"] = first_kept[layer][head] if has_evidence and layer not in unknown else ""
            records.append(record)

    def mean(key: str) -> float:
        values = [r[key] for r in records if not math.isnan(r[key])]
        return sum(values) / len(values) if values else nan

    columns: dict[str, Any] = {
        "kl_mean": sum(kl) / len(kl),
        "kl_max": max(kl),
        "top1_agreement": sum(top1) / len(top1),
        "first_divergence_step": float(diverged[0]) if diverged else nan,
        "diagnose_steps": len(kl),
        "kl_per_step": json.dumps([round(x, 6) for x in kl]),
        "top1_per_step": json.dumps(top1),
        **{k: mean(k) for k in names},
    }
    for key in ("mass_recall", "evidence_retention"):  # compact [layer][head] grids: the report's heatmaps
        grid = [
            [
                None if math.isnan(v := records[layer * n_kv_heads + head][key]) else round(v, 4)
                for head in range(n_kv_heads)
            ]
            for layer in range(n_layers)
        ]
        columns[f"{key}_by_layer_head"] = json.dumps(grid)  # null: unknown (no evidence, unrecorded positions)
    columns["evicted_share"] = 1.0 - columns.pop("kept_share")
    for r in records:
        r["evicted_share"] = 1.0 - r.pop("kept_share")
    return columns, records
