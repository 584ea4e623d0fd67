"""lm-evaluation-harness tasks run from kvbench's CLI and grids:

    python -m kvbench task=lm_eval 'task.tasks=[kvbench_qa,kvbench_mc]' task.include_path=tests/fixtures/lm_eval
    python -m kvbench task=lm_eval 'task.tasks=[longbench_hotpotqa]' grid.method=[snapkv,kivi] grid.budget=[0.25]

One example per lm-eval document. Its requests (every choice of a multiple-choice question, a generation, a
rolling text) go through kvbench.integrations.lm_eval_model for every configuration at once (one prefill per distinct
context), lm-eval's own filters and `process_results` score them, and each (filter, metric) becomes one row:
`metric` is lm-eval's key ("acc,none", "exact_match,strict-match"), `subset` is "<lm-eval task>/<metric key>"
(so the report never averages two metrics), `score` is the metric's aggregation over this one document (the
document's value for mean-aggregated metrics; its own perplexity or BLEU for corpus-level ones, whose task-level
number lm-eval computes over all documents instead). Measurement columns sum or take the largest over the
document's requests (see `measurements`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from kvbench import KvbenchError
from kvbench.config.rules import Rule
from kvbench.tasks.base import TASKS, Example, Task
from kvbench.tasks.facts import TaskFacts


@TASKS.register("lm_eval")
class LmEvalTask(Task):
    kind = "external"  # drives kvbench's model as lm-eval's LM and scores with lm-eval's own process_results
    metric = "lm_eval"  # placeholder: every row names lm-eval's own metric key
    # metrics differ per row (accuracy in [0, 1], BLEU in [0, 100], perplexities): each row carries lm-eval's
    # `higher_is_better` for its metric; the task as a whole declares no range
    facts = TaskFacts(score_range=(-math.inf, math.inf))
    # the documents' ids name their lm-eval task, so selecting other tasks or fewer documents reuses stored rows
    selection_keys = frozenset({"tasks", "limit_per_task", "include_defaults"})
    knobs = {
        "tasks": Rule(
            "list",
            "task.tasks=[kvbench_qa,kvbench_mc] (lm-eval task, group or tag names)",
            item=Rule("str", "lm-eval task names"),
        ),  # [] (the shipped default) fails in examples()
        "include_path": Rule("path", "task.include_path=DIR (lm-eval task yamls) or null", nullable=True),
        "limit_per_task": Rule("int", "task.limit_per_task=10 or null (every document)", nullable=True, min=1),
        "num_fewshot": Rule("int", "task.num_fewshot=0 or null (each task's own)", nullable=True, min=0),
        "max_length": Rule("int", "task.max_length=4096 or null (the model's context)", nullable=True, min=2),
        "max_gen_toks": Rule("int", "task.max_gen_toks=256", min=1),
        "chunk": Rule("int", "task.chunk=256 (tokens per streaming step)", min=1),
        "question_tokens": Rule("int", "task.question_tokens=64 (with query_aware=false)", min=0),
        "metadata": Rule("dict", "task.metadata={max_seq_lengths: [4096]} (lm-eval's --metadata)"),
    }

    def examples(self) -> list[Example]:
        from lm_eval.tasks import TaskManager

        cfg = self.cfg
        names = list(cfg.get("tasks") or [])
        if not names:
            raise KvbenchError(
                "task=lm_eval needs task.tasks=[NAME,...] (lm-eval task or group names; custom "
                "tasks: task.include_path=DIR)"
            )
        metadata = {"pretrained": self.tokenizer.name_or_path} if self.tokenizer.name_or_path else {}
        metadata.update(cfg.get("metadata") or {})  # e.g. RULER's max_seq_lengths; its tokenizer: the model's
        manager = TaskManager(
            include_path=cfg.get("include_path") or None,
            include_defaults=bool(cfg.get("include_defaults", True)),
            metadata=metadata,
        )
        unknown = [
            n
            for n in names
            if n not in manager.all_subtasks and n not in manager.all_groups and n not in manager.all_tags
        ]
        if unknown:
            raise KvbenchError(
                f"unknown lm-eval task(s) {', '.join(unknown)}; list them with `lm-eval ls tasks`, "
                "or point task.include_path at a directory of task yamls"
            )
        self.docs: dict[str, tuple] = {}  # example_id → (lm-eval task, doc, its instances sorted by idx)
        self.loaded = manager.load(names)["tasks"]
        out = []
        for name, task in self.loaded.items():
            if cfg.get("num_fewshot") is not None:
                task.set_config(key="num_fewshot", value=int(cfg.num_fewshot))
            task.set_fewshot_seed(seed=int(cfg.fewshot_seed))
            task.build_all_requests(limit=cfg.get("limit_per_task"))
            by_doc: dict[int, list] = {}
            for inst in task.instances:
                by_doc.setdefault(inst.doc_id, []).append(inst)
            for doc_id, instances in sorted(by_doc.items()):
                instances.sort(key=lambda inst: inst.idx)
                example_id = f"{name}/{doc_id}"
                self.docs[example_id] = (task, instances[0].doc, instances)
                out.append(self._example(example_id, name, task, instances))
        return out

    def _example(self, example_id: str, name: str, task, instances) -> Example:
        """The document's longest prompt as truncated for the model (check_fits), its largest generation length."""
        max_length = int(self.cfg.get("max_length") or self.max_context or 2048)
        prompts: list[list[int]] = [[]]
        new_tokens = 0
        for inst in instances:
            if inst.request_type == "generate_until":
                n = int(inst.args[1].get("max_gen_toks", self.cfg.max_gen_toks))
                new_tokens = max(new_tokens, n)
                prompts.append(self.tokenizer(inst.args[0])["input_ids"][-(max_length - n) :])
            elif inst.request_type == "loglikelihood":
                prompts.append(self.tokenizer(inst.args[0] + inst.args[1])["input_ids"][-max_length:])
            # rolling texts stream through the bounded cache and may run past the context window (as ppl)
        target = task.doc_to_target(instances[0].doc)
        return Example(
            example_id=example_id,
            context_ids=max(prompts, key=len),
            question_ids=[],
            answers=[target if isinstance(target, str) else json.dumps(target, default=str)],
            max_new_tokens=new_tokens,
            subset=name,
            meta={"lm_eval_task": name, "request_type": instances[0].request_type},
        )

    def data_files(self) -> list[Path]:
        """Local files that shape the documents: the task yamls under include_path and the loaded tasks'
        `data_files` (a hub dataset is identified by its name and revision in the task config instead)."""
        files = list(Path(self.cfg.include_path).rglob("*.yaml")) if self.cfg.get("include_path") else []
        for task in self.loaded.values():
            data_files = (task.config.dataset_kwargs or {}).get("data_files") or []
            values = data_files.values() if isinstance(data_files, dict) else [data_files]
            for value in values:
                files += [Path(v) for v in ([value] if isinstance(value, str) else value) if Path(v).is_file()]
        return sorted(set(files))

    def metric_keys(self, task, instances) -> list[str]:
        filters = [f.name for f in getattr(task, "_filters", [])] or ["none"]
        return [f"{metric},{name}" for name in filters for metric in task.aggregation()]

    def row_ids(self, example: Example) -> list[str]:
        task, _, instances = self.docs[example.example_id]
        return [f"{example.example_id}/{key}" for key in self.metric_keys(task, instances)]

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        raise KvbenchError("task lm_eval is scored by lm-eval's process_results in compute_rows")

    # ---- rows (called by the runner instead of its own generation loop) ---------------------------------
    def compute_rows(self, ctx, todo: list, ex: Example) -> list[dict]:
        from kvbench.integrations.lm_eval_model import KvbenchLM
        from kvbench.native.engine import Engine
        from kvbench.rows.build import row_for

        if getattr(self, "_engine", None) is None:
            self._engine = Engine(ctx.lm)  # its own: KvbenchLM stops at `hf`'s EOS ids
        cfg = self.cfg
        model = KvbenchLM(
            self._engine,
            todo,
            max_length=cfg.get("max_length"),
            max_gen_toks=int(cfg.max_gen_toks),
            chunk=int(cfg.chunk),
            question_tokens=int(cfg.question_tokens),
        )
        task, doc, instances = self.docs[ex.example_id]
        answers: dict[int, list] = {}  # id(instance) → one Answer per configuration
        for kind, run in (
            ("loglikelihood", model.loglikelihood_answers),
            ("generate_until", model.generate_answers),
            ("loglikelihood_rolling", model.rolling_answers),
        ):
            batch = [inst for inst in instances if inst.request_type == kind]
            if batch:
                answers.update(zip(map(id, batch), run(batch)))
        if len(answers) != len(instances):
            raise KvbenchError(
                f"{ex.example_id}: request types {sorted({i.request_type for i in instances})} are "
                "not all supported by kvbench (loglikelihood, generate_until, loglikelihood_rolling)"
            )
        rows = []
        higher = task.higher_is_better()
        for k, c in enumerate(todo):
            for inst in instances:  # greedy decoding: every repeat gets the same answer
                inst.resps, inst.filtered_resps = [answers[id(inst)][k].value] * (inst.repeats or 1), {}
            _apply_filters(task, instances)
            measured = measurements([answers[id(inst)][k] for inst in instances])
            for filter_key in instances[0].filtered_resps:
                responses = [inst.filtered_resps[filter_key] for inst in instances]
                for metric, value in task.process_results(doc, responses).items():
                    key, score = f"{metric},{filter_key}", doc_score(task, metric, value)
                    if score == NOT_APPLICABLE and value == NOT_APPLICABLE:
                        continue  # RULER's "this document is of another length": no row (reruns recompute these)
                    rows.append(
                        row_for(
                            c,
                            ex,
                            ctx,
                            example_id=f"{ex.example_id}/{key}",
                            subset=f"{ex.subset}/{key}",
                            metric=key,
                            score=score,
                            higher_is_better=bool(higher.get(metric, True)),
                            prediction=json.dumps(responses if len(responses) > 1 else responses[0], default=str),
                            answers=json.dumps(ex.answers),
                            **measured,
                        )
                    )
        return rows


def _apply_filters(task, instances) -> None:
    """lm-eval's filter pipelines (e.g. regex answer extraction) on one document's instances."""
    for ensemble in getattr(task, "_filters", []):
        ensemble.apply(instances)
    if not getattr(task, "_filters", None):
        for inst in instances:
            inst.filtered_resps["none"] = inst.resps[0]


NOT_APPLICABLE = -1  # lm-eval's RULER tasks score every length and mark the others -1, which aggregation skips


def doc_score(task, metric: str, value) -> float:
    """The metric's aggregation over this one document: its value for means, the document's own perplexity or
    BLEU for corpus-level metrics."""
    aggregate = task.aggregation().get(metric)
    if aggregate is None:
        if isinstance(value, (int, float)):
            return float(value)
        raise KvbenchError(f"lm-eval metric {metric} has a non-numeric per-document value and no aggregation")
    return float(aggregate([value]))


def measurements(answers: list) -> dict:
    """A document's measurement columns from its requests' answers: the largest cache held (bytes and ratio from
    the same request), summed times and tokens, the peak memory."""
    largest = max(answers, key=lambda a: a.kv_bytes_full)
    new_tokens = sum(a.new_tokens for a in answers)
    decode_s = sum(a.decode_s for a in answers)
    return dict(
        context_tokens=max(a.context_tokens for a in answers),
        new_tokens=new_tokens,
        kv_bytes=largest.kv_bytes,
        kv_bytes_full=largest.kv_bytes_full,
        kv_bytes_full_dense=largest.kv_bytes_full_dense,
        kv_ratio=largest.kv_bytes / largest.kv_bytes_full,
        kv_bytes_mha=largest.kv_bytes_mha,
        peak_mem_bytes=max(a.peak_mem_bytes for a in answers),
        prefill_s=sum(a.prefill_s for a in answers),
        decode_s=decode_s,
        decode_ms_per_token=1000 * decode_s / new_tokens if new_tokens else math.nan,
    )
