"""The runner's work loop with `batch_size` > 1: examples of equal prompt (and question) length are buffered into
batches of `batch_size` and decoded together (kvbench.native.batched); rows are what batch 1 gives, plus the batch's
throughput. Configurations that share the prefill share one batched prefill, as in a batch-1 grid."""

from __future__ import annotations

from kvbench.model.attention import StatsRequest
from kvbench.native.batched import generate_batch, prefill_batch
from kvbench.rows.build import generation_row
from kvbench.rows.configuration import Configuration
from kvbench.run.example_work import ExampleWork
from kvbench.tasks import Example


class BatchedWork(ExampleWork):
    def __init__(self, *args):
        super().__init__(*args)
        self.batch_size = self.spec.batch_size
        self.waiting: dict[tuple, list[tuple[Example, list[Configuration]]]] = {}  # by (prompt, suffix) lengths

    def do(self, ex: Example) -> None:
        todo = self.todo(ex)
        if not todo:
            return
        prompt, suffix = ex.split(self.confs[0].query_aware)
        key = (len(prompt), len(suffix), ex.max_new_tokens, tuple(ex.stop))
        group = self.waiting.setdefault(key, [])
        group.append((ex, todo))
        if len(group) == self.batch_size:
            self.run_batch(self.waiting.pop(key))

    def finish_claimed_elsewhere(self, poll_s: float = 2.0) -> None:
        for key in list(self.waiting):  # the last, partial batches
            self.run_batch(self.waiting.pop(key))
        super().finish_claimed_elsewhere(poll_s)
        for key in list(self.waiting):  # rows another process left undone
            self.run_batch(self.waiting.pop(key))

    def run_batch(self, group: list[tuple[Example, list[Configuration]]]) -> None:
        """Every configuration any example of the group needs, over the examples that need it."""
        needed: list[Configuration] = []
        for _, todo in group:
            needed += [c for c in todo if c not in needed]
        everyone = [c for c in needed if c.method.caps.shares_prefill and all(c in todo for _, todo in group)]
        shared = None
        if everyone:
            request = StatsRequest()
            for c in everyone:
                request = request | c.method.stats_request()
            shared = prefill_batch(self.ctx.engine, [ex.split(c.query_aware)[0] for ex, _ in group], request)
        new, claimed = [], []
        for c in needed:
            examples = [ex for ex, todo in group if c in todo]
            split = [ex.split(c.query_aware) for ex in examples]
            own = self.ctx.engine if c.method.caps.shares_prefill else self.ctx.engine.prepared(c.method)
            if shared is not None and c in everyone:  # (shared is set whenever `everyone` is non-empty)
                prefill = shared
            else:
                prefill = prefill_batch(own, [p for p, _ in split], c.method.stats_request())
            first = examples[0]
            gens = generate_batch(
                own, prefill, c.method, c.budget, [s for _, s in split], first.max_new_tokens, first.stop
            )
            for ex, gen in zip(examples, gens):
                new.append(generation_row(c, ex, self.ctx, gen))
                claimed.append((c.hash, ex.example_id))
        self.save(new, claimed)
