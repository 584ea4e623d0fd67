"""Metrics as small pure functions `name(prediction, ground_truth, **kwargs) -> float`."""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from difflib import SequenceMatcher

from kvbench import KvbenchError


def string_match(prediction: str, ground_truth: str, **kwargs) -> float:
    """1.0 when the answer occurs in the prediction (case-insensitive), as RULER's string match."""
    return float(ground_truth.lower() in prediction.lower())


def partial_match(prediction: str, ground_truth: str, **kwargs) -> float:
    """Longest run of the answer's characters found contiguously in the prediction, over the answer's length.

    A 7-digit value returned with only its first 5 digits scores 5/7 (exact match would hide that).
    """
    if not ground_truth:
        return 0.0
    pred, truth = prediction.lower(), ground_truth.lower()
    match = SequenceMatcher(None, pred, truth, autojunk=False).find_longest_match(0, len(pred), 0, len(truth))
    return match.size / len(truth)


def string_match_all(prediction: str, ground_truths: list[str], **kwargs) -> float:
    """RULER: the fraction of the references found in the prediction."""
    return sum(string_match(prediction, t) for t in ground_truths) / len(ground_truths)


def string_match_part(prediction: str, ground_truths: list[str], **kwargs) -> float:
    """RULER (QA): 1.0 when any reference is found in the prediction."""
    return max(string_match(prediction, t) for t in ground_truths)


# ---- LongBench (v1): the official metrics of THUDM/LongBench LongBench/metrics.py, same names and call shape ----
# Each returns exactly what the official function returns on the same inputs (including its quirks, which the
# published scores contain); tests/tasks/test_longbench.py pins them on hand-computed cases.

_ZH_PUNCTUATION = "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."  # noqa: E501 (one official string)
_EN_PUNCTUATION = frozenset(string.punctuation)
_ALL_PUNCTUATION = frozenset(string.punctuation + _ZH_PUNCTUATION)


def _jieba_cut(text: str) -> list[str]:
    """jieba's default (accurate) mode, as the official metrics use; imported lazily (its dictionary loads once)."""
    try:
        import jieba
    except ImportError:
        raise KvbenchError("LongBench's Chinese metrics need jieba: pip install jieba==0.42.1") from None
    jieba.setLogLevel(logging.WARNING)  # its dictionary-loading messages would interleave with the progress bar
    return list(jieba.cut(text, cut_all=False))


def normalize_answer(s: str) -> str:
    """Lowercase, drop ASCII punctuation, drop the articles a/an/the as whole words, collapse whitespace."""
    s = "".join(ch for ch in s.lower() if ch not in _EN_PUNCTUATION)
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", s).split())


def normalize_zh_answer(s: str) -> str:
    """Lowercase, drop ASCII and Chinese punctuation, remove all whitespace."""
    return "".join("".join(ch for ch in s.lower() if ch not in _ALL_PUNCTUATION).split())


def _token_f1(prediction: list[str], ground_truth: list[str]) -> float:
    common = Counter(prediction) & Counter(ground_truth)  # overlap counted with multiplicity
    same = sum(common.values())
    if same == 0:
        return 0.0
    precision, recall = same / len(prediction), same / len(ground_truth)
    return 2 * precision * recall / (precision + recall)


def qa_f1_score(prediction: str, ground_truth: str, **kwargs) -> float:
    return _token_f1(normalize_answer(prediction).split(), normalize_answer(ground_truth).split())


def qa_f1_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    def tokens(text: str) -> list[str]:
        return [t for t in map(normalize_zh_answer, _jieba_cut(text)) if t]

    return _token_f1(tokens(prediction), tokens(ground_truth))


def rouge_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """ROUGE-L F of the `rouge` package (its own tokenisation: case-sensitive, set-based summary-level LCS)."""
    try:
        from rouge import Rouge
    except ImportError:
        raise KvbenchError("LongBench's summarization metrics need rouge: pip install rouge==1.0.1") from None
    try:
        scores = Rouge().get_scores([prediction], [ground_truth], avg=True)
    except Exception:  # the official code scores 0 whenever the package raises (e.g. an empty prediction)
        return 0.0
    return scores["rouge-l"]["f"]


def rouge_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    return rouge_score(" ".join(_jieba_cut(prediction)), " ".join(_jieba_cut(ground_truth)))


def classification_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """1/len(matches) when the ground truth is among the classes found in the prediction, else 0.

    Classes that are substrings of the ground truth (but not equal to it) are dropped from the matches; the
    official loop removes them from the list it iterates over, so the entry after each removed one is skipped.
    That quirk is kept: it is part of every published trec/lsht score.
    """
    matches = [name for name in kwargs["all_classes"] if name in prediction]
    for term in matches:  # mutating while iterating, exactly as the official code does
        if term in ground_truth and term != ground_truth:
            matches.remove(term)
    return 1.0 / len(matches) if ground_truth in matches else 0.0


def _fraction_equal(prediction: str, target: str) -> float:
    numbers = re.findall(r"\d+", prediction)
    return 0.0 if not numbers else sum(n == str(target) for n in numbers) / len(numbers)


def retrieval_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Share of the numbers in the prediction that equal the paragraph number in 'Paragraph N'."""
    return _fraction_equal(prediction, re.findall(r"Paragraph (\d+)", ground_truth)[0])


def retrieval_zh_score(prediction: str, ground_truth: str, **kwargs) -> float:
    return _fraction_equal(prediction, re.findall(r"段落(\d+)", ground_truth)[0])


def count_score(prediction: str, ground_truth: str, **kwargs) -> float:
    return _fraction_equal(prediction, ground_truth)


def fuzz_ratio(s1: str, s2: str) -> int:
    """fuzzywuzzy 0.18.0's `fuzz.ratio` as installed by LongBench's requirements (fuzzywuzzy without
    python-Levenshtein, i.e. difflib's SequenceMatcher). Written out so that a python-Levenshtein that happens
    to be installed cannot silently switch the algorithm (its ratio differs)."""
    if s1 == s2:
        return 100
    if not s1 or not s2:
        return 0
    return round(100 * SequenceMatcher(None, s1, s2).ratio())


def code_sim_score(prediction: str, ground_truth: str, **kwargs) -> float:
    """Similarity of the first generated line that is not markdown or a comment (no `, # or //) to the answer."""
    line = next(
        (ln for ln in prediction.lstrip("\n").split("\n") if "`" not in ln and "#" not in ln and "//" not in ln), ""
    )
    return fuzz_ratio(line, ground_truth) / 100


LONGBENCH_METRICS = {
    f.__name__: f
    for f in (
        qa_f1_score,
        qa_f1_zh_score,
        rouge_score,
        rouge_zh_score,
        classification_score,
        retrieval_score,
        retrieval_zh_score,
        count_score,
        code_sim_score,
    )
}
