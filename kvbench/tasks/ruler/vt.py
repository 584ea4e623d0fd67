"""RULER's variable tracking generator (data/synthetic/variable_tracking.py), draw for draw: a solved example at
500 tokens first (3-letter variables), then the samples, each with that example's variables renamed in front."""

from __future__ import annotations

import string

from kvbench.tasks.ruler.stream import Sample, Stream, retry

NOISE = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"


class VariableTracking:
    def __init__(self, args: dict, template: str, answer_prefix: str, stream: Stream):
        self.chains, self.hops = int(args.get("num_chains", 1)), int(args.get("num_hops", 4))
        self.template, self.answer_prefix, self.s = template, answer_prefix, stream

    def _name(self, k: int) -> str:
        return "".join(self.s.rng.choices(string.ascii_uppercase, k=k)).upper()

    def _chains(self, is_icl: bool) -> tuple[list[list[str]], list[list[str]]]:
        k, hops = (3, min(10, self.hops)) if is_icl else (5, self.hops)
        names = [self._name(k) for _ in range((hops + 1) * self.chains)]
        while len(set(names)) < self.chains * (hops + 1):
            names.append(self._name(k))
        variables, chains = [], []
        for i in range(0, len(names), hops + 1):  # a repeated name leaves a short chain at the end, as the script's
            these = names[i : i + hops + 1]
            variables.append(these)
            chain = [f"VAR {these[0]} = {self.s.np_rng.randint(10000, 99999)}"]
            chain += [f"VAR {these[j + 1]} = VAR {these[j]} " for j in range(hops)]
            chains.append(chain)
        return variables, chains

    def sample(self, num_noises: int, is_icl: bool = False) -> Sample:
        variables, chains = self._chains(is_icl)
        sentences = [NOISE] * num_noises
        if len(sentences) <= len(chains[0]):
            sentences = [n + "." if n.strip() else n for n in (x for noise in sentences for x in noise.split("."))]
            if len(sentences) <= len(chains[0]):
                chains = [chain[: len(sentences) - 1] for chain in chains]
        for chain in chains:
            positions = sorted(self.s.rng.sample(range(len(sentences)), len(chain)))
            for j, at in enumerate(positions):
                sentences.insert(at + j, chain[j])
        context = " ".join(sentences).replace(". \n", ".\n")
        fill = {"context": context, "query": chains[0][0].split("=")[-1].strip(), "num_v": self.hops + 1}
        whole = self.template + self.answer_prefix
        after = whole.split("{context}", 1)[1]
        return Sample(whole.format(**fill), variables[0], after.format(**fill), self.answer_prefix.format(**fill))

    def _run(self, num_samples: int, length: int, ttg: int, step: int, icl: Sample | None) -> list[Sample]:
        what = "vt" if icl is not None else "vt's solved example (RULER draws it at 500 tokens, whatever the length)"
        example, example_tokens = "", 0
        if icl is not None:
            example = icl.text + " " + " ".join(icl.answers) + "\n\n"
            example_tokens = self.s.count(example)
        n, total = step, 0
        while total + ttg + example_tokens < length:
            sample = self.sample(n, is_icl=icl is None)
            total = self.s.count(sample.text + f" {sample.answers}")  # the list's repr, as the script counts it
            if total + ttg + example_tokens > length:
                n -= step
                break
            n += step
        out = []
        for _ in range(num_samples):
            sample = retry(
                lambda m: self.sample(m, is_icl=icl is None), n, step, length - example_tokens, ttg, self.s, what, False
            )
            if icl is not None:  # the solved example goes in front of the task template (at 0 for RULER's base)
                cut = sample.text.index(self.template[:20])
                sample.text = sample.text[:cut] + " " + self._renamed(example) + "\n\n" + sample.text[cut:]
            out.append(sample)
        return out

    def _renamed(self, example: str) -> str:
        """randomize_icl: the example's answer variables renamed, every occurrence."""
        cut = example.index(self.answer_prefix[-10:])
        for item in example[cut + 10 :].strip().split():
            example = example.replace(item, self._name(len(item)))
        return example

    def generate(self, length: int, ttg: int, num_samples: int) -> list[Sample]:
        (icl,) = self._run(1, 500, ttg, 5, None)
        return self._run(num_samples, length, ttg, 10, icl)
