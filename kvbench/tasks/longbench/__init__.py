"""LongBench (v1) with the official definitions (THUDM/LongBench `LongBench/pred.py`, `eval.py`, `metrics.py`).

Prompt, exactly as pred.py builds it: format the subset's template with the record, tokenize (with the
tokenizer's special tokens), and when longer than `max_length` keep the first and the last `int(max_length/2)`
tokens and decode each half without special tokens (middle truncation); then apply the chat template, except
for trec, triviaqa, samsum, lsht, lcc and repobench-p. The final text is tokenized once (special tokens added by
the tokenizer for plain prompts, by the template for chat prompts), so context_ids + question_ids are the tokens
pred.py feeds the model.

Query-aware split: `question_ids` start where the text after `{context}` in the template starts (the closing
instruction, the input and the generation prompt); `context_ids` are everything before. The split is found in the
rendered text and mapped to the token boundary of the whole prompt's tokenization (a token straddling it goes to
the question), so splitting never changes the tokens. When truncation cut into that text, the question is what
survives of it (the kept last half).

Score: the official metric of the subset, maximum over the record's answers, after eval.py's first-line
post-processing for trec/triviaqa/samsum/lsht; in [0, 1]. LongBench reports 100 × the subset mean (`scorer`).
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from kvbench import KvbenchError
from kvbench.config.rules import Rule
from kvbench.tasks.base import TASKS, Example, Task
from kvbench.tasks.longbench.config import (
    E_SUBSETS,
    ENGLISH_SUBSETS,
    SCENARIOS,
    SubsetSpec,
    all_subset_names,
    length_bucket,
    subset_spec,
)
from kvbench.tasks.metrics import LONGBENCH_METRICS

# the official data (what pred.py's `load_dataset('THUDM/LongBench', ...)` reads): JSONL files in LongBench's schema
DATA_REPO, DATA_ARCHIVE = "THUDM/LongBench", "data.zip"
FIELDS: dict[str, type | tuple[type, ...]] = {
    "input": str,
    "context": str,
    "answers": list,
    "length": int,
    "dataset": str,
    "language": str,
    "all_classes": (list, type(None)),
    "_id": str,
}
SUBSET_GROUPS = {
    "english": ENGLISH_SUBSETS,
    "all": tuple(n for n in all_subset_names() if not n.endswith("_e")),
    "longbench_e": tuple(f"{s}_e" for s in E_SUBSETS),
}
# default max_length leaves this many tokens spare: decoding the two halves and tokenizing their join again can
# give a few more tokens than were kept (a multi-byte character cut at the seam, merges across it)
RETOKENIZE_MARGIN = 16
QUESTION_MARK = "\x00QUESTION\x00"  # marks the split inside the chat template's rendering


def validate_record(record, where: str, spec: SubsetSpec) -> dict:
    if not isinstance(record, dict):
        raise KvbenchError(f"{where}: expected a JSON object in LongBench's schema ({', '.join(FIELDS)})")
    for field, kind in FIELDS.items():
        if field not in record:
            raise KvbenchError(f"{where}: record has no field {field!r} (LongBench's schema: {', '.join(FIELDS)})")
        if not isinstance(record[field], kind) or isinstance(record[field], bool):
            raise KvbenchError(
                f"{where}: field {field!r} is a {type(record[field]).__name__}, expected "
                f"{'a list or null' if isinstance(kind, tuple) else kind.__name__}"
            )
    if spec.metric == "classification_score" and not record["all_classes"]:
        raise KvbenchError(f"{where}: {spec.name} is scored by classification and needs a list in 'all_classes'")
    return record


def read_records(directory: Path, spec: SubsetSpec) -> list[dict]:
    """`<subset>.jsonl` (or `.parquet`) from a directory of files in LongBench's schema, validated."""
    jsonl, parquet = directory / f"{spec.name}.jsonl", directory / f"{spec.name}.parquet"
    if jsonl.is_file():
        records = []
        try:
            lines = jsonl.read_text(encoding="utf-8").split("\n")  # not splitlines: U+2028 may sit inside a string
        except UnicodeDecodeError as error:
            raise KvbenchError(
                f"{jsonl} is not UTF-8 text (byte {error.start}: {error.reason}); LongBench's files "
                "are UTF-8 JSONL: convert it (e.g. iconv -t UTF-8) or replace it"
            ) from None
        for lineno, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise KvbenchError(f"{jsonl}, line {lineno}: not valid JSON ({error.msg})") from None
            records.append(validate_record(record, f"{jsonl}, line {lineno}", spec))
        return records
    if parquet.is_file():
        import pyarrow.parquet as pq

        rows = pq.read_table(parquet).to_pylist()
        return [validate_record(r, f"{parquet}, row {i}", spec) for i, r in enumerate(rows)]
    raise KvbenchError(
        f"LongBench file {jsonl.name} not found in task.data_dir={directory}: the directory needs "
        f"one <subset>.jsonl (or .parquet) per subset in LongBench's schema, e.g. the unzipped "
        f"{DATA_ARCHIVE}"
    )


def data_dir(cfg) -> Path:
    """task.data_dir, checked: a directory."""
    directory = Path(str(cfg.get("data_dir"))).expanduser()
    if not directory.is_dir():
        raise KvbenchError(
            f"task.data_dir={directory} is not a directory; point it at the unzipped "
            f"{DATA_ARCHIVE} (one <subset>.jsonl per subset), or set task.data_dir=null to "
            "download it"
        )
    return directory


def official_data_dir() -> Path:
    """Download the official data.zip once (Hugging Face hub) and unpack it into the kvbench cache."""
    from kvbench import cache_root

    target = cache_root() / "longbench" / "data"
    if any(target.glob("*.jsonl")):
        return target
    try:
        from huggingface_hub import hf_hub_download

        archive = hf_hub_download(DATA_REPO, DATA_ARCHIVE, repo_type="dataset")
    except Exception as error:  # offline, proxy, hub outage: all end in the same advice
        reason = (str(error).strip().splitlines() or [type(error).__name__])[0]
        raise KvbenchError(
            f"could not download LongBench's {DATA_ARCHIVE} from the Hugging Face hub ({DATA_REPO}: {reason}); "
            f"without network, unzip {DATA_ARCHIVE} on a machine that has it and set task.data_dir=DIR "
            "(a directory of <subset>.jsonl files)"
        ) from None
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=target.parent, prefix="data.tmp"))
    try:
        with zipfile.ZipFile(archive) as z:
            z.extractall(tmp)
        found = sorted({p.parent for p in tmp.rglob("*.jsonl")})
        if not found:
            raise KvbenchError(f"{archive} holds no .jsonl files; delete it from the hub cache and run again")
        os.replace(found[0], target)  # atomic: a half-unpacked archive is never read
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def middle_truncate(tokenizer, ids: list[int], max_length: int) -> tuple[str, str]:
    """pred.py's truncation of an over-long prompt: the decoded first and last `int(max_length/2)` tokens."""
    half = int(max_length / 2)
    return (
        tokenizer.decode(ids[:half], skip_special_tokens=True),
        tokenizer.decode(ids[-half:], skip_special_tokens=True),
    )


def common_prefix_length(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def build_prompt(tokenizer, spec: SubsetSpec, record: dict, max_length: int) -> tuple[list[int], list[int], bool]:
    """(context_ids, question_ids, truncated) for one record, as pred.py builds the prompt."""
    prompt = spec.prompt.format(**record)
    context_end = len(spec.prompt.split("{context}")[0].format(**record)) + len(record["context"])
    ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
    truncated = len(ids) > max_length
    if not truncated:
        text, split = prompt, context_end
    else:  # what survives of the question, decoded the same way, sits at the end of the truncated text
        first, last = middle_truncate(tokenizer, ids, max_length)
        text = first + last
        head_ids = tokenizer(prompt[:context_end], add_special_tokens=True)["input_ids"]
        context_tokens = common_prefix_length(ids, head_ids)
        question_start = max(len(ids) - int(max_length / 2), context_tokens)
        question = tokenizer.decode(ids[question_start:], skip_special_tokens=True)
        split = max(len(first), len(text) - len(question))
    head, tail = text[:split], text[split:]
    chat = spec.chat_template and bool(getattr(tokenizer, "chat_template", None))
    if chat:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": head + QUESTION_MARK + tail}], tokenize=False, add_generation_prompt=True
        )
        if rendered.count(QUESTION_MARK) != 1:
            raise KvbenchError(
                "the tokenizer's chat template rewrites the prompt text; use a model whose template "
                "passes the user message through"
            )
        head, tail = rendered.split(QUESTION_MARK)
    # a chat template writes its own BOS; a plain prompt gets the tokenizer's, as pred.py's tokenizer call does
    full = tokenizer(head + tail, add_special_tokens=not chat)["input_ids"]
    cut = common_prefix_length(full, tokenizer(head, add_special_tokens=not chat)["input_ids"])
    return full[:cut], full[cut:], truncated


def first_line(prediction: str) -> str:
    return prediction.lstrip("\n").split("\n")[0]


def score_prediction(spec: SubsetSpec, prediction: str, answers: list, all_classes: list | None) -> float:
    """eval.py's per-sample score: post-process, then the maximum of the metric over the answers (at least 0)."""
    if spec.first_line:
        prediction = first_line(prediction)
    metric = LONGBENCH_METRICS[spec.metric]
    return float(max([0.0] + [metric(prediction, answer, all_classes=all_classes) for answer in answers]))


def scorer(subset: str, predictions: list[str], answers: list[list], all_classes: list | None) -> float:
    """eval.py's subset score: 100 × mean of the per-sample scores, rounded to 2 decimals."""
    spec = subset_spec(subset)
    total = sum(score_prediction(spec, p, a, all_classes) for p, a in zip(predictions, answers))
    return round(100 * total / len(predictions), 2)


@TASKS.register("longbench")
class LongBench(Task):
    selection_keys = frozenset({"subsets", "categories", "limit_per_subset"})
    knobs = {
        "subsets": Rule("any"),  # a list of names, or one group name (task.subsets=all): checked by `select`
        "categories": Rule(
            "list",
            f"task.categories=[single_doc_qa] (null: all; valid: {', '.join(SCENARIOS)})",
            nullable=True,
            item=Rule("str", f"scenarios: {', '.join(SCENARIOS)}", choices=SCENARIOS),
        ),
        "limit_per_subset": Rule("int", "task.limit_per_subset=10 or null (every record)", nullable=True, min=1),
        "data_dir": Rule("str", "task.data_dir=DIR (one <subset>.jsonl per subset) or null (download)", nullable=True),
        "max_length": Rule("int", "task.max_length=3500 (prompt tokens) or null (fit the model)", nullable=True, min=2),
        "stop_at_newline": Rule("bool", "task.stop_at_newline=true or false"),
    }

    def __init__(self, cfg, tokenizer, seed: int, max_context: int | None = None):
        super().__init__(cfg, tokenizer, seed, max_context)
        self.specs = self.select(cfg)
        self.metric = "longbench"  # each row's own metric comes from metric_of
        self._all_classes: dict[str, list | None] = {}

    @classmethod
    def check(cls, cfg: dict) -> None:
        cls.select(cfg)
        if cfg.get("data_dir"):
            data_dir(cfg)

    @staticmethod
    def select(cfg) -> list[SubsetSpec]:
        subsets = cfg.get("subsets") or []
        requested = [subsets] if isinstance(subsets, str) else list(subsets)  # task.subsets=all works too
        if not requested:
            raise KvbenchError(
                "task.subsets is empty; name LongBench subsets (e.g. task.subsets=[hotpotqa,qasper]) "
                f"or a group: {', '.join(SUBSET_GROUPS)}"
            )
        names = [n for r in requested for n in SUBSET_GROUPS.get(str(r), (str(r),))]
        specs = [subset_spec(n) for n in dict.fromkeys(names)]
        categories = list(cfg.get("categories") or [])
        unknown = sorted(set(categories) - set(SCENARIOS))
        if unknown:
            raise KvbenchError(f"task.categories: unknown {', '.join(unknown)}; valid: {', '.join(SCENARIOS)}")
        if categories:
            specs = [s for s in specs if s.scenario in categories]
            if not specs:
                raise KvbenchError(
                    f"task.categories={categories} keeps none of task.subsets={requested}; widen "
                    "either (task.categories=null keeps every subset)"
                )
        limit = cfg.get("limit_per_subset")
        if limit is not None and int(limit) < 1:
            raise KvbenchError(f"task.limit_per_subset={limit}: use a positive number, or null for every record")
        return specs

    def max_length(self, spec: SubsetSpec) -> int:
        """Truncation length: task.max_length, or what leaves room in the model for generation and the template."""
        overhead = 0
        if spec.chat_template and getattr(self.tokenizer, "chat_template", None):
            empty = self.tokenizer.apply_chat_template(
                [{"role": "user", "content": ""}], tokenize=False, add_generation_prompt=True
            )
            overhead = len(self.tokenizer(empty, add_special_tokens=False)["input_ids"])
        room = None if self.max_context is None else self.max_context - spec.max_new_tokens - overhead
        if self.cfg.get("max_length") is not None:
            length = int(self.cfg.max_length)
            if room is not None and length > room:
                raise KvbenchError(
                    f"task.max_length={length} is more than the model can take for {spec.name} "
                    f"({self.max_context} tokens - {spec.max_new_tokens} new - {overhead} of chat "
                    f"template); use task.max_length={room} or less"
                )
        elif room is None:
            raise KvbenchError("the model's context window is unknown: set task.max_length (prompt tokens kept)")
        else:
            length = room - RETOKENIZE_MARGIN
        if length < 2:
            raise KvbenchError(f"task.max_length would be {length} tokens for {spec.name}: too small to keep both ends")
        return length

    def _data_dir(self) -> Path:
        return data_dir(self.cfg) if self.cfg.get("data_dir") else official_data_dir()

    def data_files(self) -> list[Path]:
        """Every LongBench file in the data directory (not only the selected subsets': subsets is a selection key,
        so rows stay reusable across selections, and any edit in the directory recomputes)."""
        directory = self._data_dir()
        return sorted(p for p in directory.iterdir() if p.suffix in (".jsonl", ".parquet") and p.is_file())

    def examples(self) -> list[Example]:
        directory, limit = self._data_dir(), self.cfg.get("limit_per_subset")
        out = []
        for spec in self.specs:
            records = read_records(directory, spec)
            max_length = self.max_length(spec)
            for record in records[: int(limit) if limit is not None else None]:
                out.append(self._example(spec, record, max_length))
        return out

    def _example(self, spec: SubsetSpec, record: dict, max_length: int) -> Example:
        context_ids, question_ids, truncated = build_prompt(self.tokenizer, spec, record, max_length)
        example_id = f"{spec.name}-{record['_id']}"
        n_tokens = len(context_ids) + len(question_ids)
        if self.max_context is not None and n_tokens + spec.max_new_tokens > self.max_context:
            raise KvbenchError(
                f"LongBench example {example_id} needs {n_tokens} prompt + {spec.max_new_tokens} new "
                f"tokens, more than the model's context of {self.max_context}; set task.max_length "
                f"lower than {max_length}"
            )
        self._all_classes[example_id] = record["all_classes"]
        meta = {
            "scenario": spec.scenario,
            "language": spec.language,
            "length": record["length"],
            "truncated": truncated,
        }
        if spec.is_e:
            meta["length_bucket"] = length_bucket(record["length"])
        # pred.py stops samsum at the newline token, but never on the first token; the engine's stop string
        # would also end on a leading newline, so by default decoding goes on and first-line scoring cuts instead
        stop = ("\n",) if spec.newline_stop and self.cfg.get("stop_at_newline") else ()
        return Example(
            example_id=example_id,
            context_ids=context_ids,
            question_ids=question_ids,
            answers=list(record["answers"]),
            max_new_tokens=spec.max_new_tokens,
            subset=spec.name,
            stop=stop,
            meta=meta,
        )

    def metric_of(self, example: Example) -> str:
        return subset_spec(example.subset).metric

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        spec = subset_spec(example.subset)
        return {"score": score_prediction(spec, prediction, example.answers, self._all_classes.get(example.example_id))}
