"""An example's work in a run: rows reused from the store, computed here, or awaited from another process."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from kvbench.config.spec import RunSpec
from kvbench.rows import modes
from kvbench.rows.build import RowContext, engine_rows, generation_rows, stream_rows
from kvbench.rows.configuration import Configuration
from kvbench.rows.modes import RunFacts
from kvbench.run import requests
from kvbench.store.claims import Claims
from kvbench.store.results import fault_text
from kvbench.tasks import Example


class ExampleWork:
    """Rows of one example × configurations: reused from the store, computed here, or — when another process
    has claimed them (concurrent writers, see kvbench.store.claims) — awaited and collected from the store."""

    def __init__(self, spec: RunSpec, confs, ctx: RowContext, store, run_id: str, facts: RunFacts, out_dir: Path):
        self.spec, self.confs, self.ctx, self.store, self.run_id = spec, confs, ctx, store, run_id
        self.task = ctx.task
        self.out_dir = out_dir  # a failed configuration's traceback goes into out_dir/failures/
        # workload tasks and prefix caching run requests in order: a sequence is measured whole, never partly reused
        self.requests = requests.RequestRunner(ctx.engine, spec) if modes.requests_in_order(facts) else None
        self.seen = store.versions()  # before reading: a file written in between is read again, never missed
        self.existing = {} if spec.rerun or self.requests else store.existing()
        self.claims = Claims(store.root)
        self.rows: list[dict] = []
        self.computed: list[dict] = []
        self.saved = 0  # rows of self.computed in the store (the last save that succeeded)
        self.reported: set[int] = set()  # pids of stopped claim owners already named
        self.elsewhere: list[tuple[Example, list[Configuration]]] = []
        self.failed: dict[str, str] = {}  # configuration label → its first error line (its rows are skipped)
        # how an example becomes rows, by the task's declared kind (kvbench.tasks.base.Task.kind)
        self.kinds: dict[str, Callable[[Example, list[Configuration]], list[dict]]] = {
            "generate": lambda ex, todo: generation_rows(ctx, todo, ex),
            "stream": lambda ex, todo: [row for c in todo for row in stream_rows(ctx, c, ex)],
            "workload": lambda ex, todo: self.requests.rows(ctx, todo, ex),  # type: ignore[union-attr]
            "external": lambda ex, todo: self.task.compute_rows(ctx, todo, ex),
            "engine": lambda ex, todo: engine_rows(ctx, todo, ex),  # a serving engine (kvbench.engines)
        }

    @property
    def diagnose(self):
        return self.ctx.diagnose

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
        """Skip configuration `c` from here on; its traceback goes into the run directory, named in its one line."""
        line = (str(error).strip().splitlines() or [type(error).__name__])[0]
        where = self.write_traceback(c, ex, error)
        self.failed[label(c)] = f"{type(error).__name__}: {line} (example {ex.example_id}; traceback: {where})"
        self.claims.release([(c.hash, ex.example_id)])

    def write_traceback(self, c: Configuration, ex: Example, error: BaseException) -> str:
        """out_dir/failures/<config_hash>.txt with the configuration, example and whole traceback (where the run
        directory cannot take it, the error's own line is all there is)."""
        import traceback

        path = self.out_dir / "failures" / f"{c.hash or 'configuration'}.txt"
        text = f"{label(c)}\nexample {ex.example_id}\n\n" + "".join(traceback.format_exception(error))
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        except OSError as fault:
            return f"not written ({fault.strerror})"
        return str(path)

    def compute(self, ex: Example, todo: list[Configuration]) -> list[dict]:
        """The rows of `todo` on example `ex`: by the task's kind (any task runs as requests in order under the
        prefix cache; a serving engine's rows come from its process)."""
        kind = "engine" if self.ctx.serving_engine else "workload" if self.requests is not None else self.task.kind
        return self.kinds[kind](ex, todo)

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

            write_side_table(self.ctx.side, path)
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
