"""LongBench-style document with several questions (offline, seeded): `shared_doc_qa`.

One long multi-paragraph document per workload (the haystack's prose grouped into paragraphs, default the Python
reference's English prose) holds `questions` facts about fictional towns, societies and works — who founded what,
when a bridge was completed, which river a town lies on — each in a paragraph of its own at evenly spread depths.
Every request asks one of them in LongBench's `multifieldqa_en` prompt (THUDM/LongBench config/dataset2prompt.json,
verbatim, with the chat template as pred.py applies it) and is scored with that subset's official metric, token F1
(`qa_f1_score`, kvbench.tasks.metrics = THUDM's metrics.py), so partial answers ("the Marrow River" for "Marrow
River" scores 1.0 after normalisation, "Ada" for "Ada Fenwick" 0.67) are measured, not counted wrong.

Each fact's subject is unique in its document and every answer differs, so a question has exactly one answer in
the text. The document is the shared prefix (`Example.context_ids`, what reuse=compress_once compresses once);
the question, the closing instruction and the generation prompt are each request's own.
"""

from __future__ import annotations

import random
from collections.abc import Sequence

from kvbench import KvbenchError
from kvbench.config.rules import Rule
from kvbench.tasks.base import TASKS, Example
from kvbench.tasks.haystack import HAYSTACKS, Encoded
from kvbench.tasks.longbench import score_prediction
from kvbench.tasks.longbench.config import PROMPTS, subset_spec
from kvbench.tasks.shared_prefix import MARK, Fact, SharedPrefixTask, chat_split

SUBSET = "multifieldqa_en"  # LongBench's single-document QA template and metric (qa_f1_score), English

TOWNS = (
    "Ashmere Brackenford Caldmoor Dunhallow Elmsworth Fennick Glenharrow Hollinby Ivelstone Kestlewick Larchmont "
    "Marrowby Northwold Oakhurst Pellingham Quarrington Redcastle Saltmarsh Thornbury Umberleigh Valemont Westmere "
    "Yarrowby Brightwater Coldhaven Dunholme Fairhaven Greystoke Highmoor Kingsholt Lowenby Millbrook"
).split()
FIRST_NAMES = (
    "Ada Bertram Clara Desmond Edith Felix Greta Horace Ingrid Jasper Lena Magnus Nora Oswald Petra Quentin Rosa "
    "Silas Tilda Ulric Vera Walter Yvonne Ansel Beatrix Cyril Dorothea Emil Flora Gideon Hester Ivo"
).split()
SURNAMES = (
    "Ashcombe Blackwood Carrow Dunmore Everard Fenwick Galloway Harrington Iversen Jellicoe Kettering Lindqvist "
    "Marchbank Norrington Ormsby Pendleton Quayle Rathbone Selwyn Thackeray Underhill Vosper Whitlock Yeardley "
    "Ainsworth Bellamy Corrigan Delacourt Ellsworth Fairbairn Goodfellow Hawthorne"
).split()
SOCIETIES = (
    "Botanical Society",
    "Rowing Club",
    "Weaving Company",
    "Observatory",
    "Printing House",
    "Glassworks",
    "Choral Society",
    "Savings Bank",
    "Museum of Clocks",
    "Chess Club",
)
STRUCTURES = ("stone bridge", "clock tower", "lighthouse", "public library", "railway station", "town hall")
WORKS = ("water works", "tramway", "canal project", "harbour extension", "power station", "grain exchange")
FESTIVALS = ("lantern festival", "harvest fair", "kite festival", "boat race", "music festival", "cheese market")
PRODUCTS = (
    "hand-painted porcelain",
    "copper kettles",
    "wool blankets",
    "glass lenses",
    "oak barrels",
    "brass telescopes",
    "leather saddles",
    "pocket watches",
)
COLOURS = ("red", "blue", "green", "golden", "silver", "black", "white", "purple")
ANIMALS = ("heron", "stag", "otter", "falcon", "badger", "salmon", "wolf", "swan", "hare", "owl")
RIVERS = ("Marrow", "Tessel", "Aldwin", "Corran", "Lune", "Varro", "Ebberly", "Skell")
MONTHS = "January February March April May June July August September October November December".split()
ASIDES = (
    "Local records describe this in some detail.",
    "The parish archive still keeps the original documents.",
    "Visitors are often surprised to learn it.",
    "Several accounts from the period mention it.",
    "It is still remembered in the region.",
    "Historians of the district agree on this point.",
)

# (fact, question, answer): slots {person}, {person2}, {town}, {town2}, {society}, {structure}, {work}, {festival},
# {product}, {colour}, {colour2}, {animal}, {river}, {year}, {count}, {month}; the subject (what the question names)
# is its slot values minus the answer's, unique within a document
RELATIONS = (
    ("The {town} {society} was founded in {year} by {person}.", "Who founded the {town} {society}?", "{person}"),
    (
        "The {structure} at {town} was completed in {year}, after nine years of work.",
        "In what year was the {structure} at {town} completed?",
        "{year}",
    ),
    (
        "In {year} the {town} {society} moved its headquarters to {town2}.",
        "To which town did the {town} {society} move its headquarters?",
        "{town2}",
    ),
    (
        "The chief engineer of the {town} {work} is {person}.",
        "Who is the chief engineer of the {town} {work}?",
        "{person}",
    ),
    (
        "The {town} {work} employs {count} people full time.",
        "How many people does the {town} {work} employ full time?",
        "{count}",
    ),
    (
        "The flag of {town} shows a {colour} {animal} on a {colour2} field.",
        "What animal is shown on the flag of {town}?",
        "{colour} {animal}",
    ),
    (
        "{town} lies on the {river} River, a few hours upstream of the sea.",
        "On which river does {town} lie?",
        "{river} River",
    ),
    (
        "The {town} {society} is best known for its {product}.",
        "What is the {town} {society} best known for?",
        "{product}",
    ),
    (
        "The annual {festival} of {town} is held every {month}.",
        "In which month is the annual {festival} of {town} held?",
        "{month}",
    ),
    ("The first mayor of {town} was {person}, elected in {year}.", "Who was the first mayor of {town}?", "{person}"),
)


def draw_slots(rng: random.Random) -> dict[str, str]:
    def person() -> str:
        return f"{rng.choice(FIRST_NAMES)} {rng.choice(SURNAMES)}"

    town, town2 = rng.sample(TOWNS, 2)
    colour, colour2 = rng.sample(COLOURS, 2)
    return {
        "person": person(),
        "person2": person(),
        "town": town,
        "town2": town2,
        "society": rng.choice(SOCIETIES),
        "structure": rng.choice(STRUCTURES),
        "work": rng.choice(WORKS),
        "festival": rng.choice(FESTIVALS),
        "product": rng.choice(PRODUCTS),
        "colour": colour,
        "colour2": colour2,
        "animal": rng.choice(ANIMALS),
        "river": rng.choice(RIVERS),
        "year": str(rng.randint(1650, 1950)),
        "count": str(rng.randint(120, 4800)),
        "month": rng.choice(MONTHS),
    }


def draw_facts(rng: random.Random, n: int, tries: int = 10_000) -> list[Fact]:
    """`n` facts, relations taken in turn (a shuffled cycle), each question and each answer distinct."""
    relations = list(RELATIONS)
    rng.shuffle(relations)
    facts: list[Fact] = []
    questions: set[str] = set()
    answers: set[str] = set()
    for _ in range(tries):
        if len(facts) == n:
            return facts
        fact, question, answer = relations[len(facts) % len(relations)]
        slots = draw_slots(rng)
        q, a = question.format(**slots), answer.format(**slots)
        if q in questions or a.lower() in answers:
            continue
        questions.add(q)
        answers.add(a.lower())
        facts.append(Fact(text=f"{fact.format(**slots)} {rng.choice(ASIDES)}", question=q, answer=a))
    raise KvbenchError(f"task.questions={n}: could not draw that many distinct facts; use at most a few hundred")


@TASKS.register("shared_doc_qa")
class SharedDocumentQA(SharedPrefixTask):
    """A LongBench-style document (multifieldqa_en) asked `questions` questions, one request each."""

    name = "shared_doc_qa"
    metric = subset_spec(SUBSET).metric
    knobs = {
        "questions": Rule("int", "task.questions=20 (facts in each document, one request each)", min=1),
        "documents": Rule("int", "task.documents=1 (workloads)", min=1),
        "context_length": Rule("int", "task.context_length=2048 (tokens of the shared context)", min=1),
        "haystack": Rule("str", "task.haystack=prose, noise or file", choices=HAYSTACKS),
        "haystack_files": Rule("list", "task.haystack_files=[a.txt,b.txt]", item=Rule("str", "file paths")),
        "paragraph_sentences": Rule("int", "task.paragraph_sentences=5 (sentences per paragraph)", min=1),
        "max_new_tokens": Rule("int", "task.max_new_tokens=64 (LongBench's for multifieldqa_en)", min=1),
    }

    def units(self, sentences: list[str]) -> Sequence[list[int]]:
        """Paragraphs of `paragraph_sentences` sentences, each after a blank line (tokenized as taken)."""
        k = int(self.cfg.paragraph_sentences)
        paragraphs = [" ".join(sentences[i : i + k]) for i in range(0, len(sentences), k)]
        return Encoded(["\n\n" + p for p in paragraphs], self.encode)

    def request_facts(self, rng: random.Random, n: int) -> tuple[str, list[Fact]]:
        facts = draw_facts(rng, n)
        return "", [Fact("\n\n" + f.text, f.question, f.answer) for f in facts]  # a paragraph of its own

    def subset(self) -> str:
        return f"{self.cfg.haystack}-{SUBSET}"

    def rng_seed(self, doc: int) -> str:
        cfg = self.cfg
        return f"{self.seed}:{self.name}:{cfg.haystack}:{cfg.context_length}:{doc}"

    def prompt(self, instruction, facts, i):
        """multifieldqa_en's template around the document; the blank line before {context} moves into the
        document (every paragraph starts with one), so the rendered text is the template's, verbatim."""
        user = PROMPTS[SUBSET].format(context=MARK, input=facts[i].question).replace("\n\n" + MARK, MARK, 1)
        return chat_split(self.tokenizer, [{"role": "user", "content": user}], "")

    def score(self, prediction: str, example: Example) -> dict[str, float]:
        return {"score": score_prediction(subset_spec(SUBSET), prediction, example.answers, None)}
