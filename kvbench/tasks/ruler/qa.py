"""RULER's QA generator (data/synthetic/qa.py), draw for draw: sample i asks SQuAD's (qa_1) or HotpotQA's (qa_2)
i-th answerable question, its gold paragraphs among as many distractor paragraphs as the length holds."""

from __future__ import annotations

from functools import cache, partial

from kvbench.tasks.ruler import source
from kvbench.tasks.ruler.stream import Sample, Stream, retry

DOCUMENT = "Document {i}:\n{document}"


@cache
def squad() -> tuple[list[dict], list[str]]:
    data = source.qa_json("squad")
    docs = sorted({p["context"] for d in data["data"] for p in d["paragraphs"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = []
    for d in data["data"]:
        more = [index[p["context"]] for p in d["paragraphs"]]
        for p in d["paragraphs"]:
            for qa in p["qas"]:
                if not qa["is_impossible"]:
                    qas.append(
                        {
                            "query": qa["question"],
                            "outputs": [a["text"] for a in qa["answers"]],
                            "context": [index[p["context"]]],
                            "more_context": [i for i in more if i != index[p["context"]]],
                        }
                    )
    return qas, docs


@cache
def hotpotqa() -> tuple[list[dict], list[str]]:
    data = source.qa_json("hotpotqa")
    docs = sorted({f"{t}\n{''.join(p)}" for d in data for t, p in d["context"]})
    index = {c: i for i, c in enumerate(docs)}
    qas = [
        {
            "query": d["question"],
            "outputs": [d["answer"]],
            "context": [index[f"{t}\n{''.join(p)}"] for t, p in d["context"]],
        }
        for d in data
    ]
    return qas, docs


class QA:
    def __init__(self, args: dict, template: str, answer_prefix: str, stream: Stream):
        self.qas, docs = {"squad": squad, "hotpotqa": hotpotqa}[args["dataset"]]()
        self.docs = list(docs)  # the script shuffles its list in place when a prompt holds every paragraph
        self.template, self.answer_prefix, self.s = template, answer_prefix, stream

    def sample(self, index: int, num_docs: int) -> Sample:
        qa = self.qas[index]
        gold, more = qa["context"], qa.get("more_context", [])
        if num_docs < len(self.docs):
            if num_docs - len(gold) > len(more):
                taken = set(gold + more)
                others = [i for i in range(len(self.docs)) if i not in taken]
                picked = gold + more + self.s.rng.sample(others, max(0, num_docs - len(gold) - len(more)))
            else:
                picked = gold + self.s.rng.sample(more, num_docs - len(gold))
            docs = [self.docs[i] for i in picked]
        else:
            docs = self.docs
        self.s.shuffled(docs)
        context = "\n\n".join(DOCUMENT.format(i=i + 1, document=d) for i, d in enumerate(docs))
        fill = {"context": context, "query": qa["query"]}
        whole = self.template + self.answer_prefix
        after = whole.split("{context}", 1)[1]
        return Sample(whole.format(**fill), qa["outputs"], after.format(**fill), self.answer_prefix.format(**fill))

    def generate(self, length: int, ttg: int, num_samples: int) -> list[Sample]:
        step = 10
        n, total = step, 0
        while total + ttg < length:
            sample = self.sample(0, n)
            total = self.s.count(sample.text + f" {sample.answers}")  # the list's repr, as the script counts it
            if total + ttg > length:
                n -= step
                break
            n += step
            if n > len(self.docs):
                n = len(self.docs)
                break
        if num_samples > len(self.qas):
            num_samples = len(self.qas)
        return [retry(partial(self._at, i), n, step, length, ttg, self.s, "qa") for i in range(num_samples)]

    def _at(self, index: int, num_docs: int) -> Sample:
        return self.sample(index, num_docs)
