"""An example's work in a run: rows reused from the store, computed here, or awaited from another process."""

from __future__ import annotations

import time

from kvbench.config.spec import RunSpec
from kvbench.run import workload
from kvbench.run.config_hash import grid_batching, grid_padding
from kvbench.run.configuration import Configuration
from kvbench.run.rows import generation_rows, stream_rows
from kvbench.store.claims import Claims
from kvbench.store.results import fault_text
from kvbench.tasks import Example


class ExampleWork:
    """Rows of one example × configurations: reused from the store, computed here, or — when another process
    has claimed them (concurrent writers, see kvbench.store.claims) — awaited and collected from the store."""

    def __init__(self, spec: RunSpec, confs, task, engine, store, run_id, common, lm):
        self.spec, self.confs, self.task, self.engine, self.store = spec, confs, task, engine, store
        self.run_id, self.common, self.lm = run_id, common, lm
        # workload tasks and prefix caching run requests in order: a sequence is measured whole, never partly reused
        self.requests = workload.WorkloadRunner(engine, spec, lm) if spec.prefix_cache or task.workload else None
        self.seen = store.versions()  # before reading: a file written in between is read again, never missed
        self.existing = {} if spec.rerun or self.requests else store.existing()
        self.claims = Claims(store.root)
        self.rows: list[dict] = []
        self.computed: list[dict] = []
        self.saved = 0  # rows of self.computed in the store (the last save that succeeded)
        self.reported: set[int] = set()  # pids of stopped claim owners already named
        self.elsewhere: list[tuple[Example, list[Configuration]]] = []
        self.side: list[dict] = []  # diagnose=true: per-(layer, KV head) records (kvbench.guide.diagnose_run)
        self.failed: dict[str, str] = {}  # configuration label → its first error line (its rows are skipped)
        self.diagnose = None
        if spec.diagnose:
            from kvbench.guide.diagnose_run import thresholds_for

            self.diagnose = thresholds_for(spec, task)

    def _reuse(self, c: Configuration, ex: Example) -> list[dict] | None:
        old = [self.existing.get((c.hash, row_id)) for row_id in self.task.row_ids(ex)]
        done = all(r is not None and (self.diagnose is None or isinstance(r.get("verdict"), str)) for r in old)
        return [{**r, "reused": True} for r in old if r is not None] if done else None

    def do(self, ex: Example) -> None:
        todo = [c for c in self.todo(ex) if label(c) not in self.failed]
        if not todo:
            return
        try:
            new = self.compute(ex, todo)
        except Exception as error:  # one configuration's failure must not lose the others' rows
            if len(todo) == 1:
                self.fail(todo[0], ex, error)
                return
            new = []
            for c in todo:  # alone, to find the one that fails
                try:
                    new.extend(self.compute(ex, [c]))
                except Exception as alone:
                    self.fail(c, ex, alone)
        self.save(new, [(c.hash, ex.example_id) for c in todo])

    def fail(self, c: Configuration, ex: Example, error: BaseException) -> None:
        line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        self.failed[label(c)] = f"{type(error).__name__}: {line} (example {ex.example_id})"
        self.claims.release([(c.hash, ex.example_id)])

    def compute(self, ex: Example, todo: list[Configuration]) -> list[dict]:
        """The rows of `todo` on example `ex`."""
        if hasattr(self.task, "compute_rows"):  # tasks that drive the engine themselves (lm-eval's requests)
            return self.task.compute_rows(self.engine, todo, ex, self.common, self.lm)
        if self.task.streaming:
            return [row for c in todo for row in stream_rows(self.engine, c, ex, self.task, self.common, self.lm)]
        if self.requests:
            return self.requests.rows(todo, ex, self.task, self.common, self.lm, self.diagnose, self.side)
        args = (self.engine, todo, ex, self.task, self.common, self.lm, self.diagnose, self.side)
        grid_batch = grid_batching(self.spec, self.lm, requested=len(self.confs) - 1)  # confs[0]: the baseline
        inline_chunk = (self.spec.prefill, self.spec.prefill_chunk)
        return generation_rows(
            *args, inline_chunk=inline_chunk, grid_batch=grid_batch, grid_padding=grid_padding(self.spec)
        )

    def todo(self, ex: Example) -> list[Configuration]:
        """The configurations this process computes for `ex` (others are reused, or claimed elsewhere)."""
        todo, busy = [], []
        for c in self.confs:
            old = self._reuse(c, ex)
            if old is not None:
                self.rows.extend(old)
            elif self.claims.try_claim(c.hash, ex.example_id):
                todo.append(c)
            else:
                busy.append(c)
        if busy:
            self.elsewhere.append((ex, busy))
        if todo and not self.requests:  # a claim won just after another process saved these rows and released it
            for row in self.store.rows_since(self.seen, self.store.rows_dir / f"{self.run_id}.parquet"):
                self.existing[(row["config_hash"], row["example_id"])] = row
            done = [c for c in todo if self._reuse(c, ex) is not None]
            for c in done:
                self.rows.extend(self._reuse(c, ex) or [])
            self.claims.release((c.hash, ex.example_id) for c in done)
            todo = [c for c in todo if c not in done]
        return todo

    def save(self, new: list[dict], claimed: list[tuple[str, str]]) -> None:
        self.computed.extend(new)
        self.rows.extend(new)
        path = self.store.save_run(self.run_id, self.computed)  # after every example: an interrupted sweep resumes
        self.saved = len(self.computed)
        if self.diagnose is not None:
            from kvbench.guide.diagnose_run import write_side_table

            write_side_table(self.side, path)
        self.claims.release(claimed)

    def finish_claimed_elsewhere(self, poll_s: float = 2.0) -> None:
        """Wait for rows other processes were computing, then take them from the store (or compute what a
        process that died left undone)."""
        pending, self.elsewhere = self.elsewhere, []
        if pending:
            print(
                f"[kvbench] waiting for {sum(len(b) for _, b in pending)} rows claimed by another process", flush=True
            )
        for ex, busy in pending:
            while held := [(c.hash, ex.example_id) for c in busy if self.claims.held_elsewhere(c.hash, ex.example_id)]:
                self.report_stopped(held)
                time.sleep(poll_s)
            self.existing = self.store.existing()
            confs, self.confs = self.confs, busy
            try:
                self.do(ex)
            finally:
                self.confs = confs
        if self.elsewhere:  # claimed again meanwhile (another late process): wait once more
            self.finish_claimed_elsewhere(poll_s)

    def report_stopped(self, keys: list[tuple[str, str]]) -> None:
        """Name, once each, a stopped process of this host (ctrl-Z) holding claims this run waits for: alive, so
        its claims are not stale, and it will not finish them until it is resumed."""
        for pid, n in self.claims.stopped_owners(keys).items():
            if pid not in self.reported:
                self.reported.add(pid)
                print(
                    f"[kvbench] process {pid} on this host holds {n} claim(s) this run waits for and is stopped "
                    f"(ctrl-Z): resume it (kill -CONT {pid}, or fg in its shell) and it finishes them, or end it "
                    f"(kill -9 {pid}) and this run takes them over",
                    flush=True,
                )

    def fault(self, error: OSError) -> str:
        """A store write that failed mid-run, in one line: what happened, the rows that are safe, how to resume."""
        what, remedy = fault_text(error)
        return (
            f"{what}: the {self.saved} rows this run computed before are safe in the store {self.store.rows_dir} "
            f"(nothing half-written); {remedy}, then rerun to resume"
        )


def label(c: Configuration) -> str:
    """A configuration as the summary names it: method, its knobs, budget."""
    knobs = ",".join(f"{k}={v}" for k, v in sorted(c.method.params().items()))
    return (
        f"{c.method.name}({knobs}) budget={c.budget_value:g}" if knobs else f"{c.method.name} budget={c.budget_value:g}"
    )
