"""kvbench as an lm-evaluation-harness model, registered as `kvbench`:

    kvbench-lm-eval --model kvbench --model_args model=smollm2-135m,method=snapkv,budget=0.5 --tasks ...

What each lm-eval request means with a compressed cache (tokenization and truncation are lm-eval's `hf` model's):
- generate_until: the prompt (left-truncated to max_length - max_gen_toks) is prefilled once, compressed by the
  method, then decoded greedily until a stop string, the model's EOS (its generation config's, as `hf`) or
  max_gen_toks new tokens.
- loglikelihood(context, continuation): the context is prefilled and compressed, then the continuation is fed
  through the compressed cache (teacher forcing) and its log-probability summed. Its first token is predicted
  by the prefill's last position, which, like the first generated token, still sees the whole context
  (compression follows the prefill); the rest see only what the method kept. Continuation tokens are appended
  like an uncompressed question (`Compression.on_extend`): decode-time evicting methods (H2O, StreamingLLM) do not
  evict the context to make room for them. Requests that share a context share one prefill.
- loglikelihood_rolling(text): the prefix token + the text stream through a bounded cache `chunk` tokens at a
  time, as in the `ppl` task (kvbench.native.streaming); a fractional budget is a fraction of the text's tokens. At
  budget 1.0 this is `hf`'s number for a text that fits max_length; a longer text continues in one stream
  (positions keep counting) where `hf` restarts disjoint windows.
- query_aware=false: the prompt's last `question_tokens` tokens are appended uncompressed after compression.
At method=full every number equals `hf`'s on the same model (tests/integrations/test_lm_eval.py).

One object can serve several configurations at once (`configurations`): each request is prefilled once for all
of them (the `lm_eval` task's grids); the lm-eval methods answer for the first.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import (
    handle_stop_sequences,
    has_bos_prefix,
    normalize_gen_kwargs,
    postprocess_generated_text,
    resolve_max_length,
)
from tqdm import tqdm

from kvbench import KvbenchError
from kvbench.model.attention import StatsRequest
from kvbench.model.cache import cache_nbytes
from kvbench.native.engine import Engine
from kvbench.native.memory import read_peak, reset_peak, synchronize

log = logging.getLogger(__name__)

# model_args that are not method knobs (anything else is a knob of `method`, e.g. window_size=16)
MODEL_ARGS = {
    "model",
    "pretrained",
    "method",
    "budget",
    "query_aware",
    "dtype",
    "device",
    "max_length",
    "max_gen_toks",
    "chunk",
    "question_tokens",
    "add_bos_token",
}


@dataclass
class Answer:
    """One request under one configuration: lm-eval's value plus kvbench's measurements."""

    value: Any  # generate_until: str; loglikelihood: (logprob, is_greedy); loglikelihood_rolling: logprob
    context_tokens: int
    new_tokens: int
    kv_bytes: int
    kv_bytes_full: int
    kv_bytes_mha: int
    peak_mem_bytes: int
    prefill_s: float  # prefill (charged once per distinct context) + compression
    decode_s: float  # generation, or the continuation's forward
    kv_bytes_full_dense: int = 0


@register_model("kvbench")
class KvbenchLM(TemplateLM):
    def __init__(
        self,
        engine: Engine,
        configurations: list,
        max_length: int | None = None,
        max_gen_toks: int = 256,
        chunk: int = 256,
        question_tokens: int = 0,
        add_bos_token: bool | None = None,
    ):
        super().__init__()
        if not configurations:
            raise KvbenchError("KvbenchLM needs at least one configuration")
        if any(not c.query_aware for c in configurations) and question_tokens < 1:
            raise KvbenchError(
                "query_aware=false needs question_tokens=N: lm-eval prompts have no context/question "
                "split, so the prompt's last N tokens are appended uncompressed"
            )
        self.engine, self.configurations = engine, configurations
        self.lm = engine.lm
        self.tokenizer = self.lm.tokenizer
        self._max_length = int(max_length) if max_length else resolve_max_length(self.lm.config, self.tokenizer)
        self._max_gen_toks, self.chunk, self.question_tokens = int(max_gen_toks), int(chunk), int(question_tokens)
        self.add_bos_token = add_bos_token
        # stop where `hf`'s model.generate stops: the generation config's EOS ids
        eos = getattr(getattr(self.lm.model, "generation_config", None), "eos_token_id", None)
        eos = eos if eos is not None else self.tokenizer.eos_token_id
        engine.eos_ids = set(eos) if isinstance(eos, (list, tuple)) else {eos}
        self._device = self.lm.device

    # ---- construction from lm-eval's --model_args --------------------------------------------------------
    @classmethod
    def create_from_arg_string(cls, arg_string: str, additional_config: dict | None = None) -> KvbenchLM:
        from lm_eval.utils import simple_parse_args_string

        return cls.create_from_arg_obj(simple_parse_args_string(arg_string), additional_config)

    @classmethod
    def create_from_arg_obj(cls, arg_dict: dict, additional_config: dict | None = None) -> KvbenchLM:
        args = {k: v for k, v in (additional_config or {}).items() if v is not None and k == "device"}
        args.update(arg_dict)  # --model_args win over the CLI's --device (whose default is cuda:0)
        return from_model_args(args)

    # ---- lm-eval's interface -----------------------------------------------------------------------------
    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self._max_length

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return str(
            self.tokenizer.apply_chat_template(
                chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
            )
        )

    def tok_encode(
        self, string: str, add_special_tokens: bool | None = None, left_truncate_len: int | None = None, **kwargs
    ) -> list[int]:
        """As `hf`: the tokenizer's own special tokens unless told, none when the text already starts with BOS."""
        if add_special_tokens is None:
            add_special_tokens = self.add_bos_token
            if has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
                add_special_tokens = False
        kwargs = {} if add_special_tokens is None else {"add_special_tokens": add_special_tokens}
        ids = self.tokenizer.encode(string, **kwargs)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens))

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        return [answers[0].value for answers in self.loglikelihood_answers(requests, disable_tqdm)]

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        return [answers[0].value for answers in self.generate_answers(requests, disable_tqdm)]

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        return [answers[0].value for answers in self.rolling_answers(requests, disable_tqdm)]

    # ---- every configuration at once ---------------------------------------------------------------------
    def loglikelihood_answers(self, requests, disable_tqdm: bool = True) -> list[list[Answer]]:
        """Per request, one Answer per configuration (tokenized as `hf` by TemplateLM.loglikelihood)."""
        return super().loglikelihood(requests, disable_tqdm=True) if requests else []

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[list[Answer]]:
        by_context: dict[tuple, list[int]] = {}
        inputs = []
        for i, (_, context, continuation) in enumerate(requests):
            if not continuation or len(continuation) > self.max_length:
                raise KvbenchError(
                    f"a loglikelihood continuation of {len(continuation)} tokens: it must have 1 to "
                    f"max_length={self.max_length} tokens"
                )
            context = context[-(self.max_length + 1 - len(continuation)) :]  # `hf`'s left truncation
            inputs.append((context, continuation))
            by_context.setdefault(tuple(context), []).append(i)
        out: list[list[Answer]] = [[] for _ in requests]
        for context, members in tqdm(by_context.items(), desc="loglikelihood contexts", disable=disable_tqdm):
            prompt, suffix = self._split(list(context))
            for c, engine, prefill in self._prefills(prompt):
                for n, i in enumerate(members):
                    out[i].append(self._score(engine, prefill, c, suffix, inputs[i][1], charge_prefill=n == 0))
        for (request, _, _), answers in zip(requests, out):
            if request is not None:
                self.cache_hook.add_partial("loglikelihood", request, answers[0].value)
        return out

    def generate_answers(self, requests, disable_tqdm: bool = True) -> list[list[Answer]]:
        out = []
        for request in tqdm(requests, desc="generate_until", disable=disable_tqdm):
            context, gen_kwargs = request.args
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0) > 0:
                raise KvbenchError(
                    f"kvbench decodes greedily; this task samples ({gen_kwargs}): pass "
                    "--gen_kwargs do_sample=false,temperature=0"
                )
            until = [
                s
                for s in handle_stop_sequences(
                    kwargs.pop("until", None), eos=self.tok_decode(self.eot_token_id, skip_special_tokens=False)
                )
                if s
            ]
            max_gen_toks = int(kwargs.pop("max_gen_toks"))
            if max_gen_toks >= self.max_length:
                raise KvbenchError(f"max_gen_toks={max_gen_toks} must be below max_length={self.max_length}")
            prompt, suffix = self._split(self._encode_prompt(context, self.max_length - max_gen_toks))
            answers = []
            for c, engine, prefill in self._prefills(prompt):
                gen = engine.generate(prefill, c.method, c.budget, suffix, max_gen_toks, tuple(until))
                text = postprocess_generated_text(gen.text, until, None)
                answers.append(
                    Answer(
                        text,
                        gen.context_tokens,
                        len(gen.token_ids),
                        gen.kv_bytes,
                        gen.kv_bytes_full,
                        gen.kv_bytes_mha,
                        gen.peak_mem_bytes,
                        gen.prefill_s,
                        gen.decode_s,
                    )
                )
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), answers[0].value)
            out.append(answers)
        return out

    def rolling_answers(self, requests, disable_tqdm: bool = True) -> list[list[Answer]]:
        from kvbench.native.streaming import stream_budget, stream_perplexity

        out = []
        for request in tqdm(requests, desc="loglikelihood_rolling", disable=disable_tqdm):
            (text,) = request.args
            ids = [self.prefix_token_id] + self.tok_encode(text)
            answers = []
            for c in self.configurations:
                windows = stream_perplexity(
                    self.engine.prepared(c.method), c.method, stream_budget(c.budget, len(ids)), ids, self.chunk
                )
                last, n = windows[-1], sum(w.n_predicted for w in windows)
                answers.append(
                    Answer(
                        -sum(w.nll_sum for w in windows),
                        len(ids),
                        n,
                        last.kv_bytes,
                        last.kv_bytes_full,
                        self.engine.full_layout.mha_bytes(len(ids)),
                        max(w.peak_mem_bytes for w in windows),
                        sum(w.seconds for w in windows),
                        0.0,
                        last.kv_bytes_full_dense,
                    )
                )
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), answers[0].value)
            out.append(answers)
        return out

    # ---- helpers ------------------------------------------------------------------------------------------
    def _encode_prompt(self, context: str, max_tokens: int) -> list[int]:
        """As `hf`'s tok_batch_encode for one string: BOS check on the text, then left truncation."""
        if has_bos_prefix(context, self.tokenizer.bos_token):
            kwargs = {"add_special_tokens": False}
        else:
            kwargs = {} if self.add_bos_token is None else {"add_special_tokens": self.add_bos_token}
        return self.tokenizer(context, **kwargs)["input_ids"][-max_tokens:]

    def _split(self, ids: list[int]) -> tuple[list[int], list[int]]:
        """(ids to prefill and compress, ids appended uncompressed): all compressed when query-aware."""
        if all(c.query_aware for c in self.configurations):
            return ids, []
        if any(c.query_aware for c in self.configurations):
            raise KvbenchError("one KvbenchLM serves query_aware=true or false, not both")
        keep = min(self.question_tokens, len(ids) - 1)
        return ids[: len(ids) - keep], ids[len(ids) - keep :]

    def _prefills(self, prompt: list[int]):
        """(configuration, engine, prefill): one prefill for every configuration that shares it (the union of
        their statistics), its own for methods that change the model (head merging)."""
        shared = [c for c in self.configurations if c.method.caps.shares_prefill]
        request = StatsRequest()
        for c in shared:
            request = request | c.method.stats_request()
        prefill = self.engine.prefill(prompt, request) if shared else None
        for c in self.configurations:
            if c.method.caps.shares_prefill:
                yield c, self.engine, prefill
            else:
                own = self.engine.prepared(c.method)
                yield c, own, own.prefill(prompt, c.method.stats_request())

    @torch.inference_mode()
    def _score(
        self, engine: Engine, prefill, c, suffix: list[int], continuation: list[int], charge_prefill: bool
    ) -> Answer:
        """log P(continuation | compressed context) and whether greedy decoding would produce it."""
        device = self.lm.device
        reset_peak(device)
        start = time.perf_counter()
        c.method.bind(engine.lm)
        compression = c.method.begin(prefill.n_tokens, len(prefill.kv), c.budget)
        cache = compression.run(prefill.kv, prefill.stats)
        synchronize(device)
        compress_s = time.perf_counter() - start
        fed = suffix + continuation[:-1]
        rows = [prefill.last_logits[None]]  # (1, V): predicts the token after the prompt
        if fed:
            rows.append(engine._extend(cache, compression, fed, prefill.n_tokens, all_logits=True))  # (len(fed), V)
        logits = torch.cat(rows)[len(suffix) :]  # (len(continuation), V): row i predicts continuation[i]
        target = torch.tensor(continuation, device=logits.device)  # (len(continuation),)
        logprob = torch.log_softmax(logits, dim=-1).gather(1, target[:, None]).sum()
        greedy = bool((logits.argmax(dim=-1) == target).all())
        synchronize(device)
        tokens = prefill.n_tokens + len(fed)
        return Answer(
            (float(logprob), greedy),
            prefill.n_tokens + len(suffix),
            len(continuation),
            cache_nbytes(cache),
            engine.full_layout.full_bytes(tokens),
            engine.full_layout.mha_bytes(tokens),
            max(prefill.peak_mem_bytes, read_peak(device)),
            (prefill.seconds_for(c.method) if charge_prefill else 0.0) + compress_s,
            time.perf_counter() - start - compress_s,
            engine.full_layout.dense_bytes(tokens),
        )


def from_model_args(args: dict) -> KvbenchLM:
    """Build the model from lm-eval's `--model_args` (values already typed by lm-eval): `model` (a conf/model
    name) or `pretrained` (a hub id or local directory), `model.KEY=...` model overrides, `method`, `budget`,
    `query_aware`, `dtype`, `device`, `max_length`, `max_gen_toks`, `chunk`, `question_tokens`, and the method's
    knobs by name."""
    from omegaconf import OmegaConf

    from kvbench import conf_dir
    from kvbench.model.load import load_model, model_config
    from kvbench.preflight.support import is_hybrid, refusal
    from kvbench.rows.configuration import DEFAULT_BUDGET, make_configuration, method_config

    args = dict(args)
    for key in ("batch_size", "max_batch_size"):  # lm-eval's; kvbench runs one request at a time
        args.pop(key, None)
    model_overrides = {k.removeprefix("model."): args.pop(k) for k in list(args) if k.startswith("model.")}
    name = str(args.pop("model", "smollm2-135m"))
    if "pretrained" in args:
        name, model_overrides["name_or_path"] = "hub", str(args.pop("pretrained"))
    path = conf_dir() / "model" / f"{name}.yaml"
    if not path.exists():
        known = ", ".join(sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml")))
        raise KvbenchError(f"model={name}: no such kvbench model ({known}); or pretrained=<hub id or directory>")
    model_cfg = OmegaConf.load(path)
    for key, value in model_overrides.items():
        OmegaConf.update(model_cfg, key, value)
    method_name = str(args.pop("method", "full"))
    knobs = {k: args.pop(k) for k in list(args) if k not in MODEL_ARGS}
    method_cfg = {**method_config(method_name), **knobs, "name": method_name}
    budget = args.pop("budget", None)
    configuration = make_configuration(
        method_cfg, DEFAULT_BUDGET if budget is None else budget, bool(args.pop("query_aware", True))
    )
    if budget is not None and configuration.budget is None and configuration.method.caps.family != "none":
        raise KvbenchError(f"method {method_name} takes no budget (it keeps every token); drop budget=")
    device = str(args.pop("device", "auto"))
    if device.startswith("cuda") and not torch.cuda.is_available():
        log.warning("device=%s but no CUDA GPU is visible: running on the CPU", device)
        device = "cpu"
    config = model_config(model_cfg, cheap=True)  # None: the bundled GGUF before its first conversion
    reason = None if config is None else refusal(configuration.method, config)
    if config is not None and is_hybrid(config):
        reason = (
            "lm-eval on a hybrid model (linear-attention or Mamba layers) is not supported: its requests stream "
            "through the cache in chunks, which do not carry the model's recurrent state; use python -m kvbench"
        )
    if reason:
        raise KvbenchError(reason)
    lm = load_model(model_cfg, device, str(args.pop("dtype", "auto")))
    return KvbenchLM(Engine(lm), [configuration], **args)
