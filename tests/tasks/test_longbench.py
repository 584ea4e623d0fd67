"""LongBench: the official metrics on hand-computed cases, the official definitions, prompt building and middle
truncation (byte-level tokenizer of the tiny model: one token per ASCII character), data validation, and an
end-to-end run on the tiny model over the fixtures in tests/fixtures/longbench (self-written, LongBench's schema)."""

import hashlib
import json
import random
import zipfile
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from kvbench import KvbenchError
from kvbench.run.runner import run
from kvbench.tasks import build_task
from kvbench.tasks.longbench import build_prompt, scorer
from kvbench.tasks.longbench.config import (
    E_SUBSETS,
    ENGLISH_SUBSETS,
    PROMPTS,
    all_subset_names,
    length_bucket,
    subset_spec,
)
from kvbench.tasks.metrics import (
    LONGBENCH_METRICS,
    classification_score,
    code_sim_score,
    count_score,
    fuzz_ratio,
    normalize_answer,
    normalize_zh_answer,
    qa_f1_score,
    qa_f1_zh_score,
    retrieval_score,
    retrieval_zh_score,
    rouge_score,
    rouge_zh_score,
)
from tests.conftest import CONF_DIR, compose_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "longbench"
TREC_CLASSES = ["Country", "Other", "location", "Other location", "City"]


def _task(tokenizer, max_context=16384, **overrides):
    cfg = OmegaConf.load(CONF_DIR / "task" / "longbench.yaml")
    cfg.update({"data_dir": str(FIXTURES), **overrides})
    return build_task(cfg, tokenizer, 0, max_context)


def _record(subset, index=0):
    return json.loads((FIXTURES / f"{subset}.jsonl").read_text(encoding="utf-8").splitlines()[index])


def _chat(tokenizer, text):
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
    )


# ---- metrics ----------------------------------------------------------------------------------------------------


def test_normalize_answer_drops_punctuation_then_whole_word_articles():
    assert normalize_answer("Theater, an apple; THE end.") == "theater apple end"
    assert normalize_answer("the-end") == "theend"  # punctuation goes first, so no article is left to drop
    assert normalize_zh_answer("你好，世界！ A b。") == "你好世界ab"


def test_qa_f1_counts_overlap_with_multiplicity():
    assert qa_f1_score("The Eiffel Tower!", "eiffel tower") == 1.0
    assert qa_f1_score("a cat and the dog", "cat dog") == pytest.approx(0.8)  # P 2/3, R 1
    assert qa_f1_score("cat cat", "cat") == pytest.approx(2 / 3)  # P 1/2, R 1
    assert qa_f1_score("nothing here", "cat") == 0.0


def test_qa_f1_zh_segments_with_jieba():
    # jieba: 北京 | 是 | 中国 | 的 | 首都 | 。 → five tokens once the full stop is normalised away
    assert qa_f1_zh_score("北京是中国的首都。", "北京") == pytest.approx(2 * (1 / 5) / (1 / 5 + 1))
    assert qa_f1_zh_score("小明在北京大学读书", "北京大学") == pytest.approx(2 * (1 / 4) / (1 / 4 + 1))


def test_rouge_is_the_rouge_packages_rouge_l_f():
    assert rouge_score("cat sat", "cat sat down") == pytest.approx(0.8, abs=1e-6)  # LCS 2: P 1, R 2/3
    assert rouge_score("the cat sat", "the cat sat") == pytest.approx(1.0, abs=1e-6)
    assert rouge_score("", "the cat sat") == 0.0  # the package raises on an empty hypothesis
    # 会议 讨论 了 预算 问题 vs 预算 问题: LCS 2, P 2/5, R 1
    assert rouge_zh_score("会议讨论了预算问题", "预算问题") == pytest.approx(2 * 0.4 / 1.4, abs=1e-6)


def test_classification_partial_matches_and_the_official_removal_quirk():
    assert classification_score("City", "City", all_classes=TREC_CLASSES) == 1.0
    assert classification_score("City or Country", "City", all_classes=TREC_CLASSES) == 0.5
    assert classification_score("Country", "City", all_classes=TREC_CLASSES) == 0.0
    # matches [Other, location, Other location]; removing "Other" skips "location" in the official loop
    assert classification_score("Other location", "Other location", all_classes=TREC_CLASSES) == 0.5


def test_retrieval_and_count_are_shares_of_the_numbers_in_the_prediction():
    assert retrieval_score("Paragraph 3, or maybe Paragraph 12", "Paragraph 3") == 0.5
    assert retrieval_score("Paragraph 30", "Paragraph 3") == 0.0
    assert retrieval_score("no idea", "Paragraph 3") == 0.0
    assert retrieval_zh_score("答案是段落2", "段落2") == 1.0
    assert count_score("There are 7 unique paragraphs out of 10", "7") == 0.5
    assert count_score("7", "7") == 1.0


def test_code_sim_takes_the_first_line_without_markdown_or_comments():
    prediction = "\n\n```python\n# the perimeter\n// not this\n    return 2 * math.pi * radius\nprint(1)"
    assert code_sim_score(prediction, "    return 2 * math.pi * radius") == 1.0
    assert code_sim_score("abcd", "abce") == 0.75  # difflib: 2·3 matches / 8 characters
    assert code_sim_score("  return x", "return x") == 0.89  # 16/18 → round(88.9) = 89
    assert code_sim_score("# only a comment\n`x`", "x = 1") == 0.0


def test_fuzz_ratio_is_fuzzywuzzys_pure_python_ratio():
    fuzz = pytest.importorskip("fuzzywuzzy.fuzz")
    if fuzz.SequenceMatcher.__module__ != "difflib":
        pytest.skip("python-Levenshtein is installed: fuzzywuzzy no longer uses the official difflib ratio")
    rng = random.Random(0)
    for _ in range(2000):
        a, b = ("".join(rng.choice("ab c(x)=\n") for _ in range(rng.randint(0, 20))) for _ in range(2))
        assert fuzz_ratio(a, b) == fuzz.ratio(a, b)


# ---- official definitions ---------------------------------------------------------------------------------------


def test_templates_and_lengths_are_the_official_config_files():
    # sha256 of THUDM/LongBench LongBench/config/dataset2prompt.json (json.dumps, sorted keys, ensure_ascii=False)
    digest = hashlib.sha256(json.dumps(PROMPTS, sort_keys=True, ensure_ascii=False).encode()).hexdigest()
    assert digest == "e7d865d712fe45e2455f5e864ac474001d7758d68d349e76ffbcdd382483358f"
    maxlen = {name: subset_spec(name).max_new_tokens for name in PROMPTS}
    assert hashlib.sha256(json.dumps(maxlen, sort_keys=True).encode()).hexdigest() == (
        "39a79d9491ead3dc8bcea6dbd8b963b29248eb4c344dde1e176b0a58b4e758a9"
    )


def test_subset_definitions():
    names = all_subset_names()
    assert len(names) == 21 + 13 and len(E_SUBSETS) == 13 and len(ENGLISH_SUBSETS) == 16
    specs = [subset_spec(n) for n in names]
    assert {s.metric for s in specs} == set(LONGBENCH_METRICS)
    assert {s.base for s in specs if not s.chat_template} == {
        "trec",
        "triviaqa",
        "samsum",
        "lsht",
        "lcc",
        "repobench-p",
    }
    assert {s.base for s in specs if s.first_line} == {"trec", "triviaqa", "samsum", "lsht"}
    e = subset_spec("qasper_e")
    assert (e.is_e, e.base, e.prompt, e.max_new_tokens) == (True, "qasper", PROMPTS["qasper"], 128)
    assert [length_bucket(n) for n in (0, 3999, 4000, 7999, 8000)] == ["0-4k", "0-4k", "4-8k", "4-8k", "8k+"]
    with pytest.raises(KvbenchError, match="valid subsets: narrativeqa.*repobench-p_e"):
        subset_spec("musique_e")  # musique is not in LongBench-E


# ---- prompts ----------------------------------------------------------------------------------------------------


def test_chat_prompt_splits_after_the_context(tiny):
    tok, record = tiny.tokenizer, _record("hotpotqa")
    context_ids, question_ids, truncated = build_prompt(tok, subset_spec("hotpotqa"), record, 10_000)
    official = PROMPTS["hotpotqa"].format(**record)
    assert not truncated
    assert tok.decode(context_ids + question_ids) == _chat(tok, official)
    assert tok.decode(context_ids).endswith(record["context"])
    assert tok.decode(question_ids).startswith("\n\nAnswer the question based on the given passages.")
    assert tok.decode(question_ids).endswith(f"Question: {record['input']}\nAnswer:<|im_end|>\n<|im_start|>assistant\n")


def test_no_chat_template_for_few_shot_and_code_subsets(tiny):
    tok = tiny.tokenizer
    for subset in ("trec", "lcc"):
        record = _record(subset)
        context_ids, question_ids, _ = build_prompt(tok, subset_spec(subset), record, 10_000)
        assert tok.decode(context_ids + question_ids) == PROMPTS[subset].format(**record)
    trec = _record("trec")
    assert tok.decode(build_prompt(tok, subset_spec("trec"), trec, 10_000)[1]) == "\n" + trec["input"]


@pytest.mark.parametrize("max_length", [120, 121])
def test_middle_truncation_keeps_the_first_and_last_half(tiny, max_length):
    tok, record = tiny.tokenizer, _record("trec")  # no chat template: the prompt's own bytes
    prompt = PROMPTS["trec"].format(**record)
    context_ids, question_ids, truncated = build_prompt(tok, subset_spec("trec"), record, max_length)
    half = max_length // 2
    assert truncated and len(context_ids) + len(question_ids) == 2 * half
    assert tok.decode(context_ids + question_ids) == prompt[:half] + prompt[-half:]
    assert tok.decode(question_ids) == "\n" + record["input"]  # the question survives whole


def test_truncation_of_a_chat_prompt_and_a_question_longer_than_half(tiny):
    tok, record = tiny.tokenizer, _record("hotpotqa")
    overhead = len(tok(_chat(tok, ""), add_special_tokens=False)["input_ids"])
    context_ids, question_ids, truncated = build_prompt(tok, subset_spec("hotpotqa"), record, 200)
    assert truncated and len(context_ids) + len(question_ids) == 200 + overhead
    prompt = PROMPTS["hotpotqa"].format(**record)
    # the text after the context is longer than 100 tokens: the question part is all of the kept last half
    assert tok.decode(question_ids) == prompt[-100:] + "<|im_end|>\n<|im_start|>assistant\n"


def test_default_max_length_fits_the_model_and_explicit_ones_are_checked(tiny):
    task = _task(tiny.tokenizer, max_context=800, subsets=["all", "qasper_e", "lcc_e"])
    examples = task.examples()  # gov_report keeps 800 - 512 new - chat template - margin: truncated
    assert len(examples) == 46 and any(ex.meta["truncated"] for ex in examples)
    assert all(ex.n_tokens + ex.max_new_tokens <= 800 for ex in examples)
    with pytest.raises(KvbenchError, match="task.max_length=800 is more than the model can take"):
        _task(tiny.tokenizer, max_context=800, subsets=["trec"], max_length=800).examples()
    with pytest.raises(KvbenchError, match="set task.max_length"):
        _task(tiny.tokenizer, max_context=None, subsets=["trec"]).examples()


# ---- scoring ----------------------------------------------------------------------------------------------------


def test_scores_use_first_line_and_the_records_classes(tiny):
    task = _task(tiny.tokenizer, subsets=["trec", "samsum", "hotpotqa"], limit_per_subset=1)
    examples = {ex.subset: ex for ex in task.examples()}
    assert task.metric == "longbench"
    assert task.metric_of(examples["trec"]) == "classification_score"
    assert task.score("\n\nCity\nOther location", examples["trec"]) == {"score": 1.0}
    assert task.score("Other location City", examples["trec"])["score"] == 0.5
    assert task.score("\nKim found her keys in the car.\nDialogue: more", examples["samsum"])["score"] == (
        pytest.approx(1.0, abs=1e-6)
    )
    assert task.score("Hartford\nHartford", examples["hotpotqa"])["score"] == pytest.approx(2 / 3)  # no first-line
    assert examples["samsum"].stop == () and _task(tiny.tokenizer, subsets=["samsum"], stop_at_newline=True).examples()[
        0
    ].stop == ("\n",)
    assert scorer("triviaqa", ["Canberra\nmore", "five"], [["Canberra"], ["four", "4"]], None) == 50.0


# ---- data -------------------------------------------------------------------------------------------------------


def _write(path, records):
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")


def test_data_dir_errors_name_the_file_line_and_field(tiny, tmp_path):
    with pytest.raises(KvbenchError, match=r"narrativeqa.jsonl not found in task.data_dir="):
        _task(tiny.tokenizer, data_dir=str(tmp_path), subsets=["narrativeqa"]).examples()
    good = _record("hotpotqa")
    _write(tmp_path / "hotpotqa.jsonl", [good, {k: v for k, v in good.items() if k != "answers"}])
    with pytest.raises(KvbenchError, match=r"hotpotqa.jsonl, line 2: record has no field 'answers'"):
        _task(tiny.tokenizer, data_dir=str(tmp_path), subsets=["hotpotqa"]).examples()
    _write(tmp_path / "hotpotqa.jsonl", [dict(good, length="12")])
    with pytest.raises(KvbenchError, match=r"line 1: field 'length' is a str, expected int"):
        _task(tiny.tokenizer, data_dir=str(tmp_path), subsets=["hotpotqa"]).examples()
    (tmp_path / "hotpotqa.jsonl").write_text("{not json\n")
    with pytest.raises(KvbenchError, match=r"line 1: not valid JSON"):
        _task(tiny.tokenizer, data_dir=str(tmp_path), subsets=["hotpotqa"]).examples()
    _write(tmp_path / "trec.jsonl", [dict(_record("trec"), all_classes=None)])
    with pytest.raises(KvbenchError, match=r"needs a list in 'all_classes'"):
        _task(tiny.tokenizer, data_dir=str(tmp_path), subsets=["trec"]).examples()
    with pytest.raises(KvbenchError, match="is not a directory"):
        _task(tiny.tokenizer, data_dir=str(tmp_path / "nope"), subsets=["trec"]).examples()


def test_parquet_files_are_read_too(tiny, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    records = [_record("lcc", 0), _record("lcc", 1)]
    pq.write_table(pa.Table.from_pylist(records), tmp_path / "lcc.parquet")
    examples = _task(tiny.tokenizer, data_dir=str(tmp_path), subsets=["lcc"]).examples()
    assert [ex.answers for ex in examples] == [r["answers"] for r in records]


def test_selection_by_subsets_categories_and_limit(tiny):
    task = _task(tiny.tokenizer, subsets=["english"], categories=["code", "synthetic"], limit_per_subset=1)
    assert [ex.subset for ex in task.examples()] == ["passage_count", "passage_retrieval_en", "lcc", "repobench-p"]
    assert {task.metric_of(ex) for ex in task.examples()} == {"count_score", "retrieval_score", "code_sim_score"}
    with pytest.raises(KvbenchError, match="unknown LongBench subset 'nope'; valid subsets: narrativeqa"):
        _task(tiny.tokenizer, subsets=["nope"])
    with pytest.raises(KvbenchError, match="task.subsets is empty"):
        _task(tiny.tokenizer, subsets=[])
    with pytest.raises(KvbenchError, match="keeps none of task.subsets"):
        _task(tiny.tokenizer, subsets=["trec"], categories=["code"])
    with pytest.raises(KvbenchError, match="task.categories: unknown fewshot; valid: single_doc_qa"):
        _task(tiny.tokenizer, categories=["fewshot"])
    with pytest.raises(KvbenchError, match="limit_per_subset=0"):
        _task(tiny.tokenizer, limit_per_subset=0)


def test_hub_download_offline_is_one_clear_message_and_online_reads_data_zip(tiny, tmp_path, monkeypatch):
    import huggingface_hub

    def offline(*args, **kwargs):
        raise ConnectionError("Failed to resolve 'huggingface.co'")

    monkeypatch.setenv("KVBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", offline)
    with pytest.raises(KvbenchError, match="could not download LongBench's data.zip.*set task.data_dir=DIR"):
        _task(tiny.tokenizer, data_dir=None, subsets=["trec"]).examples()

    archive = tmp_path / "data.zip"  # the official archive's layout: data/<subset>.jsonl
    with zipfile.ZipFile(archive, "w") as z:
        for path in FIXTURES.glob("*.jsonl"):
            z.write(path, f"data/{path.name}")
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda repo, name, repo_type: str(archive))
    assert len(_task(tiny.tokenizer, data_dir=None, subsets=["trec", "lcc_e"]).examples()) == 4
    assert (tmp_path / "cache" / "longbench" / "data" / "trec.jsonl").exists()


# ---- end to end -------------------------------------------------------------------------------------------------


def test_offline_run_on_the_tiny_model(tmp_path):
    cfg = compose_config(
        "model=tiny-random",
        "device=cpu",
        "dtype=float32",
        f"results_dir={tmp_path / 'store'}",
        "task=longbench",
        f"task.data_dir={FIXTURES}",
        "task.limit_per_subset=1",
        "task.subsets=[2wikimqa,trec,lcc_e,multifieldqa_zh]",
    )
    rows = run(cfg, output_dir=tmp_path / "out")
    assert len(rows) == 4 * 2  # full baseline + streamingllm
    assert set(rows.subset) == {"2wikimqa", "trec", "lcc_e", "multifieldqa_zh"}
    assert rows.score.between(0, 1).all()
    by_subset = rows.drop_duplicates("subset").set_index("subset")
    assert by_subset.metric.to_dict() == {
        "2wikimqa": "qa_f1_score",
        "trec": "classification_score",
        "lcc_e": "code_sim_score",
        "multifieldqa_zh": "qa_f1_zh_score",
    }
    assert by_subset.length_bucket["lcc_e"] == "0-4k" and by_subset.scenario["trec"] == "few_shot"
    assert (tmp_path / "out" / "rows.parquet").exists()
