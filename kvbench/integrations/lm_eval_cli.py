"""`kvbench-lm-eval`: lm-eval's own command line with the `kvbench` model registered first.

lm-eval 0.4.x finds models only in its built-in table (lm_eval.models.MODEL_MAPPING) and reads no plugin entry
points, so `lm_eval --model kvbench` cannot see a third-party model; this script takes lm_eval's exact arguments:

    kvbench-lm-eval --model kvbench --model_args model=smollm2-135m,method=snapkv,budget=0.5 --tasks ...

With `--model kvbench`, every `--model_args` value is checked before lm-eval indexes its tasks or the model loads
(the run's Rules, kvbench.config.rules: one line naming the fix, exit 2), and a `--batch_size` above 1 is refused:
kvbench answers lm-eval's requests one at a time, so it would be ignored.

Exit codes: 0/1 lm-eval's own (done; its errors); 2 a bad `--model_args` value, a `--batch_size` above 1 or a task
name lm-eval does not index (one line, before lm-eval indexes tasks or the model loads).
"""

from __future__ import annotations

import sys

from kvbench import KvbenchError
from kvbench.config.rules import Rule, check_value
from kvbench.config.spec import DTYPE_CHOICES, TOP_LEVEL
from kvbench.preflight.entrance import check_method_params, method_class

MODEL_ARG_RULES: dict[str, Rule] = {  # kvbench.integrations.lm_eval_model.MODEL_ARGS, each with its rule
    "model": Rule("str", "model=smollm2-135m (a conf/model name)"),
    "pretrained": Rule("str", "pretrained=<hub id or local directory>"),
    "method": Rule("str", "method=snapkv (a conf/method name)"),
    "budget": Rule("budget", "budget=0.5 (a fraction in (0, 1]) or budget=512 (tokens)", nullable=True),
    "query_aware": Rule("bool", "query_aware=true or query_aware=false"),
    "dtype": Rule("str", "dtype=auto, bfloat16, float16 or float32", choices=DTYPE_CHOICES),
    "device": TOP_LEVEL["device"],
    "max_length": Rule("int", "max_length=4096 (the context lm-eval truncates to)", nullable=True, min=2),
    "max_gen_toks": Rule("int", "max_gen_toks=256", min=1),
    "chunk": Rule("int", "chunk=256 (tokens per streaming step)", min=1),
    "question_tokens": Rule("int", "question_tokens=64 (with query_aware=false)", min=0),
    "add_bos_token": Rule("bool", "add_bos_token=true or add_bos_token=false", nullable=True),
}


def check_model_args(model_args: dict, batch_size=None) -> None:
    """`--model_args` of `--model kvbench` (as lm-eval typed them) and `--batch_size`, before any work."""
    from kvbench import conf_dir
    from kvbench.integrations.lm_eval_model import MODEL_ARGS

    if batch_size is not None and str(batch_size) != "1":
        raise KvbenchError(
            f"--batch_size {batch_size} has no effect: kvbench answers lm-eval's requests one at a time (each with "
            "its own compressed cache); drop --batch_size"
        )
    args = {k: v for k, v in model_args.items() if not str(k).startswith("model.")}  # model overrides: the loader's
    for key in ("batch_size", "max_batch_size"):
        if args.get(key) not in (None, 1, "1"):
            raise KvbenchError(f"{key}={args[key]} has no effect: kvbench answers lm-eval's requests one at a time")
        args.pop(key, None)
    assert set(MODEL_ARG_RULES) == set(MODEL_ARGS), "every model arg needs its rule"
    for key, rule in MODEL_ARG_RULES.items():
        if key in args:
            check_value(key, args[key], rule)
    name = str(args.get("model", "smollm2-135m"))
    if "pretrained" not in args and not (conf_dir() / "model" / f"{name}.yaml").is_file():
        known = ", ".join(sorted(p.stem for p in (conf_dir() / "model").glob("*.yaml")))
        raise KvbenchError(f"model={name}: no such kvbench model ({known}); or pretrained=<hub id or directory>")
    knobs = {k: v for k, v in args.items() if k not in MODEL_ARGS}
    method = str(args.get("method", "full"))
    check_method_params("method", method_class("method", method), knobs, lambda knob, shown: f"{knob}={shown}")
    from kvbench.methods import build_method, method_defaults

    build_method(method, {**method_defaults(method), **knobs})  # unknown knobs named, the method's own checks


def main() -> None:
    from lm_eval._cli import HarnessCLI
    from lm_eval.utils import setup_logging

    import kvbench.integrations.lm_eval_model  # noqa: F401  (registers "kvbench" with lm-eval)

    try:
        setup_logging()
        parser = HarnessCLI()  # lm-eval's own cli_evaluate, with kvbench's checks between parsing and running
        args = parser.parse_args()
        if getattr(args, "model", None) == "kvbench":
            check_model_args(getattr(args, "model_args", None) or {}, getattr(args, "batch_size", None))
        parser.execute(args)
    except KvbenchError as error:
        print(f"kvbench-lm-eval: error: {error}", file=sys.stderr)
        sys.exit(2)
    except ValueError as error:  # lm-eval's own refusal of task names it does not index: bad input, one line
        if not str(error).startswith("Tasks not found"):
            raise
        print(
            f"kvbench-lm-eval: error: {error}; list them with `lm-eval ls tasks`, or give --include_path DIR "
            "(a directory of task yamls)",
            file=sys.stderr,
        )
        sys.exit(2)


if __name__ == "__main__":
    main()
