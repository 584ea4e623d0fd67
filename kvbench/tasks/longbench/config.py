"""LongBench (v1) definitions, as in THUDM/LongBench `LongBench/`: prompt templates (config/dataset2prompt.json,
verbatim, typos included), max new tokens (config/dataset2maxlen.json), metrics (eval.py), the subsets that get
no chat template (pred.py), first-line post-processing (eval.py) and the LongBench-E length buckets (eval.py).

Kept in Python rather than a JSON file next to it so that it installs with the package without package-data.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvbench import KvbenchError

SCENARIOS = ("single_doc_qa", "multi_doc_qa", "summarization", "few_shot", "synthetic", "code")

_MULTI_DOC_QA = (
    "Answer the question based on the given passages. Only give me the answer and do not output any other words."
    "\n\nThe following are given passages.\n{context}\n\nAnswer the question based on the given passages. Only "
    "give me the answer and do not output any other words.\n\nQuestion: {input}\nAnswer:"
)
PROMPTS = {  # verbatim, including "asconcisely" and qasper's "\n\n Answer"
    "narrativeqa": "You are given a story, which can be either a novel or a movie script, and a question. Answer "
    "the question asconcisely as you can, using a single phrase if possible. Do not provide any explanation.\n\n"
    "Story: {context}\n\nNow, answer the question based on the story asconcisely as you can, using a single "
    "phrase if possible. Do not provide any explanation.\n\nQuestion: {input}\n\nAnswer:",
    "qasper": "You are given a scientific article and a question. Answer the question as concisely as you can, "
    "using a single phrase or sentence if possible. If the question cannot be answered based on the information "
    'in the article, write "unanswerable". If the question is a yes/no question, answer "yes", "no", or '
    '"unanswerable". Do not provide any explanation.\n\nArticle: {context}\n\n Answer the question based on '
    "the above article as concisely as you can, using a single phrase or sentence if possible. If the question "
    'cannot be answered based on the information in the article, write "unanswerable". If the question is a '
    'yes/no question, answer "yes", "no", or "unanswerable". Do not provide any explanation.\n\n'
    "Question: {input}\n\nAnswer:",
    "multifieldqa_en": "Read the following text and answer briefly.\n\n{context}\n\nNow, answer the following "
    "question based on the above text, only give me the answer and do not output any other words.\n\n"
    "Question: {input}\nAnswer:",
    "multifieldqa_zh": "阅读以下文字并用中文简短回答：\n\n{context}\n\n现在请基于上面的文章回答下面的问题，只告诉我答案，"  # noqa: E501
    "不要输出任何其他字词。\n\n问题：{input}\n回答：",
    "hotpotqa": _MULTI_DOC_QA,
    "2wikimqa": _MULTI_DOC_QA,
    "musique": _MULTI_DOC_QA,
    "dureader": "请基于给定的文章回答下述问题。\n\n文章：{context}\n\n请基于上述文章回答下面的问题。\n\n问题：{input}\n回答：",  # noqa: E501
    "gov_report": "You are given a report by a government agency. Write a one-page summary of the report.\n\n"
    "Report:\n{context}\n\nNow, write a one-page summary of the report.\n\nSummary:",
    "qmsum": "You are given a meeting transcript and a query containing a question or instruction. Answer the query "
    "in one or more sentences.\n\nTranscript:\n{context}\n\nNow, answer the query based on the above meeting "
    "transcript in one or more sentences.\n\nQuery: {input}\nAnswer:",
    "multi_news": "You are given several news passages. Write a one-page summary of all news. \n\nNews:\n{context}"
    "\n\nNow, write a one-page summary of all the news.\n\nSummary:",
    "vcsum": "下面有一段会议记录，请你阅读后，写一段总结，总结会议的内容。\n会议记录：\n{context}\n\n会议总结：",
    "trec": "Please determine the type of the question below. Here are some examples of questions.\n\n{context}\n"
    "{input}",
    "triviaqa": "Answer the question based on the given passage. Only give me the answer and do not output any other "
    "words. The following are some examples.\n\n{context}\n\n{input}",
    "samsum": "Summarize the dialogue into a few short sentences. The following are some examples.\n\n{context}\n\n"
    "{input}",
    "lsht": "请判断给定新闻的类别，下面是一些例子。\n\n{context}\n{input}",
    "passage_count": "There are some paragraphs below sourced from Wikipedia. Some of them may be duplicates. Please "
    "carefully read these paragraphs and determine how many unique paragraphs there are after removing duplicates. "
    "In other words, how many non-repeating paragraphs are there in total?\n\n{context}\n\nPlease enter the final "
    "count of unique paragraphs after removing duplicates. The output format should only contain the number, such "
    "as 1, 2, 3, and so on.\n\nThe final answer is: ",
    "passage_retrieval_en": "Here are 30 paragraphs from Wikipedia, along with an abstract. Please determine which "
    "paragraph the abstract is from.\n\n{context}\n\nThe following is an abstract.\n\n{input}\n\nPlease enter the "
    'number of the paragraph that the abstract is from. The answer format must be like "Paragraph 1", '
    '"Paragraph 2", etc.\n\nThe answer is: ',
    "passage_retrieval_zh": "以下是若干段落文字，以及其中一个段落的摘要。请确定给定的摘要出自哪一段。\n\n{context}\n\n"
    '下面是一个摘要\n\n{input}\n\n请输入摘要所属段落的编号。答案格式必须是"段落1"，"段落2"等格式\n\n答案是：',
    "lcc": "Please complete the code given below. \n{context}Next line of code:\n",
    "repobench-p": "Please complete the code given below. \n{context}{input}Next line of code:\n",
}

# subset: (max new tokens, official metric, language, scenario)
_TABLE = {
    "narrativeqa": (128, "qa_f1_score", "en", "single_doc_qa"),
    "qasper": (128, "qa_f1_score", "en", "single_doc_qa"),
    "multifieldqa_en": (64, "qa_f1_score", "en", "single_doc_qa"),
    "multifieldqa_zh": (64, "qa_f1_zh_score", "zh", "single_doc_qa"),
    "hotpotqa": (32, "qa_f1_score", "en", "multi_doc_qa"),
    "2wikimqa": (32, "qa_f1_score", "en", "multi_doc_qa"),
    "musique": (32, "qa_f1_score", "en", "multi_doc_qa"),
    "dureader": (128, "rouge_zh_score", "zh", "multi_doc_qa"),
    "gov_report": (512, "rouge_score", "en", "summarization"),
    "qmsum": (512, "rouge_score", "en", "summarization"),
    "multi_news": (512, "rouge_score", "en", "summarization"),
    "vcsum": (512, "rouge_zh_score", "zh", "summarization"),
    "trec": (64, "classification_score", "en", "few_shot"),
    "triviaqa": (32, "qa_f1_score", "en", "few_shot"),
    "samsum": (128, "rouge_score", "en", "few_shot"),
    "lsht": (64, "classification_score", "zh", "few_shot"),
    "passage_count": (32, "count_score", "en", "synthetic"),
    "passage_retrieval_en": (32, "retrieval_score", "en", "synthetic"),
    "passage_retrieval_zh": (32, "retrieval_zh_score", "zh", "synthetic"),
    "lcc": (64, "code_sim_score", "code", "code"),
    "repobench-p": (64, "code_sim_score", "code", "code"),
}
# pred.py: "chat models are better off without build prompts on these tasks" (few-shot / completion style)
NO_CHAT_TEMPLATE = frozenset({"trec", "triviaqa", "samsum", "lsht", "lcc", "repobench-p"})
# eval.py keeps only the first line of these predictions (after stripping leading newlines)
FIRST_LINE = frozenset({"trec", "triviaqa", "samsum", "lsht"})
# pred.py ends samsum's generation at the newline token as well (and forbids it as the first token)
NEWLINE_STOP = frozenset({"samsum"})

# LongBench-E: these 13 subsets again, sampled evenly over lengths, reported per length bucket
E_SUBSETS = (
    "qasper",
    "multifieldqa_en",
    "hotpotqa",
    "2wikimqa",
    "gov_report",
    "multi_news",
    "trec",
    "triviaqa",
    "samsum",
    "passage_count",
    "passage_retrieval_en",
    "lcc",
    "repobench-p",
)
# the 16 English + code subsets that KV-cache compression papers (SnapKV, PyramidKV, ...) report
ENGLISH_SUBSETS = tuple(s for s, row in _TABLE.items() if row[2] != "zh")


@dataclass(frozen=True)
class SubsetSpec:
    name: str  # as in the data (`qasper_e` for LongBench-E)
    base: str  # the LongBench subset whose definitions apply (`qasper`)
    prompt: str
    max_new_tokens: int
    metric: str  # a function name in kvbench.tasks.metrics (LONGBENCH_METRICS)
    language: str  # en | zh | code
    scenario: str  # one of SCENARIOS
    chat_template: bool
    first_line: bool
    newline_stop: bool

    @property
    def is_e(self) -> bool:
        return self.name != self.base


def all_subset_names() -> list[str]:
    return list(_TABLE) + [f"{s}_e" for s in E_SUBSETS]


def subset_spec(name: str) -> SubsetSpec:
    base = name.removesuffix("_e") if name.endswith("_e") and name.removesuffix("_e") in E_SUBSETS else name
    if base not in _TABLE:
        raise KvbenchError(f"unknown LongBench subset {name!r}; valid subsets: {', '.join(all_subset_names())}")
    max_new_tokens, metric, language, scenario = _TABLE[base]
    return SubsetSpec(
        name,
        base,
        PROMPTS[base],
        max_new_tokens,
        metric,
        language,
        scenario,
        chat_template=base not in NO_CHAT_TEMPLATE,
        first_line=base in FIRST_LINE,
        newline_stop=base in NEWLINE_STOP,
    )


def length_bucket(length: int) -> str:
    """LongBench-E's buckets of the record's `length` (words; characters for Chinese)."""
    return "0-4k" if length < 4000 else "4-8k" if length < 8000 else "8k+"
