"""Fidelity columns (kvbench.native.fidelity): teacher forcing reproduces the run, KL and top-1 are what they say,
the full cache's rows are the reference, a lossless configuration has KL 0, and every generating row has them."""

import math

import pytest
import torch
from omegaconf import OmegaConf

from kvbench.methods import METHODS, Budget, build_method, method_defaults
from kvbench.model.attention import StatsRequest
from kvbench.model.load import load_model
from kvbench.native import fidelity
from kvbench.native.engine import Engine
from kvbench.run.runner import run
from tests.conftest import CONF_DIR, compose_config, native_method_names, tiny_overrides

# plain caches (one forward), per-layer lengths, decode-time eviction, re-indexed positions, quantized storage
CASES = [
    ("full", {}, None),
    ("snapkv", {"window_size": 8}, 0.3),
    ("pyramidkv", {"window_size": 8}, 0.5),
    ("h2o", {}, 0.25),
    ("streamingllm", {"positions": "rolling"}, 0.3),
    ("kivi", {"group_size": 16, "residual_length": 32}, None),
    ("turboquant", {}, None),
    ("chunkkv", {}, 0.3),
]


def build(name, params):
    return build_method(name, {**method_defaults(name), **params})


@pytest.mark.parametrize("name,params,budget", CASES, ids=[c[0] + str(i) for i, c in enumerate(CASES)])
def test_teacher_forcing_its_own_answer_gives_the_runs_own_distributions(tiny_engine, prompt_ids, name, params, budget):
    """Fed the answer it generated itself, a rebuilt cache gives the distributions its decoding read the answer from:
    the rebuilt cache is the one the row decoded from, and one forward (or token-by-token) equals decoding."""
    method, budget = build(name, params), Budget.parse(budget) if budget else None
    prompt, question = prompt_ids[:-12], prompt_ids[-12:]
    prefill = tiny_engine.prefill(prompt, method.stats_request())
    gen = tiny_engine.generate(prefill, method, budget, question, max_new_tokens=12, keep_logits=True)
    forced = fidelity.compressed_logits(tiny_engine, prefill, method, budget, question, gen.token_ids)
    decoded = torch.stack(gen.logits)  # (n, V)
    assert forced.shape == decoded.shape == (12, tiny_engine.lm.model.config.vocab_size)
    torch.testing.assert_close(forced, decoded, rtol=1e-4, atol=1e-4)
    columns = fidelity.compare(decoded, forced)
    assert columns["kl_mean"] < 1e-7 and columns["top1_agreement"] == 1.0 and columns["fidelity_tokens"] == 12


def test_compare_on_constructed_distributions():
    """KL(p ‖ q) in nats per step, its maximum and step, and the top-1 agreement, against hand-computed values."""
    p = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.25, 0.25], [0.1, 0.1, 0.8]])  # (3, 3)
    q = torch.tensor([[0.7, 0.2, 0.1], [0.25, 0.5, 0.25], [0.2, 0.2, 0.6]])
    want = [0.0, 0.5 * math.log(2) + 0.25 * math.log(0.5), 0.2 * math.log(0.5) + 0.8 * math.log(0.8 / 0.6)]
    got = fidelity.compare(p.log(), q.log() + 3.0)  # logits: any shift per row is the same distribution
    assert got["kl_mean"] == pytest.approx(sum(want) / 3, abs=1e-6)
    assert got["kl_max"] == pytest.approx(max(want), abs=1e-6) and got["kl_max_step"] == 1
    assert got["top1_agreement"] == pytest.approx(2 / 3) and got["fidelity_tokens"] == 3
    assert fidelity.compare(p.log(), p.log()) == fidelity.identical(3)


def rows_of(tiny_engine, prompt_ids, confs, with_full=True):
    """add_columns on configurations decoded from one shared prefill (the full cache first when `with_full`)."""
    prompt, question = prompt_ids[:-12], prompt_ids[-12:]
    request = StatsRequest()
    for method, _ in confs:
        request = request | method.stats_request()
    prefill = tiny_engine.prefill(prompt, request)
    runs = []
    for method, budget in ([(build("full", {}), None)] if with_full else []) + confs:
        gen = tiny_engine.generate(prefill, method, budget, question, max_new_tokens=10)
        runs.append(fidelity.Ran(method, budget, tiny_engine, prefill, gen))
    rows: list[dict] = [{} for _ in runs]
    fidelity.add_columns(rows, runs, tiny_engine, prefill, prompt, question, 10)
    return rows


def test_full_rows_are_the_reference_and_a_lossless_configuration_has_kl_zero(tiny_engine, prompt_ids):
    """The full cache's row: KL 0, top-1 1.0; knorm keeping every token (budget 1.0): KL ~0 through the whole path
    (a rebuilt cache, one forward); random eviction at 0.1: KL clearly above 0."""
    confs = [(build("knorm", {}), Budget.parse(1.0)), (build("random", {}), Budget.parse(0.1))]
    full, lossless, lossy = rows_of(tiny_engine, prompt_ids, confs)
    assert full["kl_mean"] == 0 and full["kl_max"] == 0 and full["top1_agreement"] == 1.0
    assert full["length_vs_full"] == 1.0 and full["fidelity_tokens"] == 10
    assert lossless["kl_mean"] < 1e-7 and lossless["top1_agreement"] == 1.0
    assert lossy["kl_mean"] > 1e-4 and lossy["kl_max"] >= lossy["kl_mean"]
    assert 0 <= lossy["kl_max_step"] < 10 and set(fidelity.COLUMNS) <= set(lossy)


def test_without_a_full_row_the_reference_is_decoded_here(tiny_engine, prompt_ids):
    """Rows computed without the full cache's (its row reused from the store) get the same columns."""
    confs = [(build("random", {}), Budget.parse(0.1))]
    with_full = rows_of(tiny_engine, prompt_ids, confs)[1]
    alone = rows_of(tiny_engine, prompt_ids, confs, with_full=False)[0]
    assert {k: alone[k] for k in fidelity.COLUMNS} == {k: with_full[k] for k in fidelity.COLUMNS}
    assert alone["fidelity_s"] > 0  # what the columns cost is recorded


def test_every_generating_row_has_the_columns_grid_or_not(tmp_path):
    """A run's rows (grid-batched or one by one: the same columns); the full cache's rows are the reference."""
    grid = ["grid.method=[snapkv,h2o]", "grid.budget=[0.2]", "task.max_new_tokens=5"]
    on = run(compose_config(*tiny_overrides(tmp_path / "on", *grid)), output_dir=tmp_path / "on" / "out")
    off = run(
        compose_config(*tiny_overrides(tmp_path / "off", *grid, "grid_batch=false")), output_dir=tmp_path / "off" / "o"
    )
    key = ["method", "budget", "example_id"]
    a, b = on.sort_values(key).reset_index(drop=True), off.sort_values(key).reset_index(drop=True)
    columns = list(fidelity.COLUMNS)
    assert a[columns].notna().all().all() and a[columns].equals(b[columns])
    full = a[a.method == "full"]
    assert (full.kl_mean == 0).all() and (full.top1_agreement == 1).all() and (full.length_vs_full == 1).all()
    assert (a[a.method != "full"].kl_mean > 0).all()


@pytest.mark.parametrize("name", native_method_names())
def test_every_method_at_its_lossless_setting_has_kl_zero(name, tiny, tiny_engine, prompt_ids):
    """Each method at its lossless parameters and budget 1.0 (tests/methods/test_methods.py: the full cache's tokens
    and logits exactly): through the fidelity path — the cache rebuilt, fed the full answer — KL 0 and top-1 1.0."""
    params = METHODS.get(name).lossless_params(tiny)
    if params is None:
        pytest.skip(f"{name} has no lossless setting")
    method = build_method(name, params)
    own = tiny_engine if method.caps.shares_prefill else tiny_engine.prepared(method)
    prompt, question = prompt_ids[:-12], prompt_ids[-12:]
    full_prefill = tiny_engine.prefill(prompt, StatsRequest())
    source = own.prefill(prompt, method.stats_request())
    full = build_method("full")
    gens = [
        e.generate(p, m, b, question, 8)
        for e, p, m, b in [(tiny_engine, full_prefill, full, None), (own, source, method, Budget.parse(1.0))]
    ]
    runs = [
        fidelity.Ran(full, None, tiny_engine, full_prefill, gens[0]),
        fidelity.Ran(method, Budget.parse(1.0), own, source, gens[1]),
    ]
    rows: list[dict] = [{}, {}]
    fidelity.add_columns(rows, runs, tiny_engine, full_prefill, prompt, question, 8)
    assert rows[1]["kl_mean"] < 1e-6 and rows[1]["kl_max"] < 1e-5 and rows[1]["top1_agreement"] == 1.0
    assert rows[1]["fidelity_tokens"] == 8 and rows[1]["length_vs_full"] == 1.0


def test_fidelity_false_skips_the_columns(tmp_path):
    rows = run(
        compose_config(*tiny_overrides(tmp_path, "task.max_new_tokens=4", "limit=1", "fidelity=false")),
        output_dir=tmp_path / "out",
    )
    assert len(rows) == 2 and not set(fidelity.COLUMNS) & set(rows.columns)


def test_rows_that_followed_the_answer_reuse_their_decoding(tiny_engine, prompt_ids):
    """A grid's rows keep the distributions they decoded from (a row decoded alone in one buffer allocated before its
    measurement): the full cache's are the reference, and where a row followed the full cache's answer those are its
    columns (no rebuild, no second pass), equal to what rebuilding the cache and forcing the answer gives."""
    from kvbench.native.grid_decode import generate_grid

    prompt, question = prompt_ids[:-12], prompt_ids[-12:]
    confs = [
        (build("full", {}), None),
        (build("snapkv", {"window_size": 8}), Budget.parse(0.5)),
        (build("h2o", {}), Budget.parse(0.9)),
        (build("rkv", {}), Budget.parse(0.5)),
        (build("h2o", {}), Budget.parse(0.05)),
        (build("kivi", {"bits": 8, "group_size": 16, "residual_length": 32}), None),
    ]
    request = StatsRequest()
    for method, _ in confs:
        request = request | method.stats_request()
    prefill = tiny_engine.prefill(prompt, request)
    gens = generate_grid(tiny_engine, prefill, confs, question, 10, max_padding=100.0, keep_logits=True)
    assert all(len(g.logits) == len(g.token_ids) for g in gens)
    kivi = gens[5].logits
    assert all(step.untyped_storage().data_ptr() == kivi[0].untyped_storage().data_ptr() for step in kivi)
    answer = gens[0].token_ids
    followed = [fidelity.decoded_logits(g, answer) is not None for g in gens[2:]]
    assert any(followed) and not all(followed)  # both paths: reused, and rebuilt where the row left the answer
    runs = [fidelity.Ran(m, b, tiny_engine, prefill, g) for (m, b), g in zip(confs, gens)]
    reused: list[dict] = [{} for _ in runs]
    fidelity.add_columns(reused, runs, tiny_engine, prefill, prompt, question, 10)
    for g in gens:
        g.logits = []
    forced: list[dict] = [{} for _ in runs]
    fidelity.add_columns(forced, runs, tiny_engine, prefill, prompt, question, 10)
    for a, b in zip(reused[1:], forced[1:]):
        assert a["kl_mean"] == pytest.approx(b["kl_mean"], rel=1e-4, abs=1e-7)
        assert a["kl_max"] == pytest.approx(b["kl_max"], rel=1e-4, abs=1e-7)
        assert (a["top1_agreement"], a["fidelity_tokens"]) == (b["top1_agreement"], b["fidelity_tokens"])


def test_rows_that_left_the_answer_are_forced_together_as_alone(tiny_engine, prompt_ids):
    """Rows fed token by token that left the full answer are forced along it as one grid batch (the CPU's
    row-independent kernels): each row's distributions are, bit for bit, its own forcing alone."""
    from kvbench.native.slots import decode_kernels

    if not decode_kernels(tiny_engine.lm.model):
        pytest.skip("no CPU decode kernels here: rows left the answer are forced one by one")
    prompt, question = prompt_ids[:-12], prompt_ids[-12:]
    confs = [(build("h2o", {}), Budget.parse(0.05)), (build("streamingllm", {}), Budget.parse(0.1))]
    request = StatsRequest()
    for method, _ in confs:
        request = request | method.stats_request()
    prefill = tiny_engine.prefill(prompt, request)
    full = tiny_engine.generate(prefill, build("full", {}), None, question, 10)
    answer = full.token_ids
    runs = [
        fidelity.Ran(m, b, tiny_engine, prefill, tiny_engine.generate(prefill, m, b, question, 10)) for m, b in confs
    ]
    together, seconds = fidelity.forced_rows(list(enumerate(runs)), question, answer, 10)
    assert set(together) == set(seconds) == {0, 1} and all(s > 0 for s in seconds.values())
    for i, (method, budget) in enumerate(confs):
        alone = fidelity.compressed_logits(tiny_engine, prefill, method, budget, question, answer, 10)
        assert torch.equal(together[i], alone.float())


@pytest.mark.parametrize("forks", [True, False], ids=["forked", "copied"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grid_rows_that_left_the_answer_resume_where_they_left_it_as_forced_alone(
    tiny_engine, prompt_ids, dtype, forks, monkeypatch
):
    """A grid row whose token first differs from the full cache's is forced along the answer from there: token by
    token as a forked row of the grid itself (or, without room in the batch, from a copy of its state after the
    grid), or from its compressed cache (one forward). Each row's distributions are, bit for bit, its cache
    compressed again and forced from the start alone."""
    from kvbench.native import grid_decode
    from kvbench.native.grid_decode import generate_grid
    from kvbench.native.slots import decode_kernels

    engine = tiny_engine
    if dtype == "bfloat16":
        engine = Engine(load_model(OmegaConf.load(CONF_DIR / "model" / "tiny-random.yaml"), "cpu", dtype))
    if not decode_kernels(engine.lm.model):
        pytest.skip("no CPU decode kernels here: no grid whose rows are their alone selves")
    prompt, question = prompt_ids[:-12], prompt_ids[-12:]
    confs = [(build("full", {}), None), (build("h2o", {}), Budget.parse(0.05)),
             (build("h2o", {}), Budget.parse(0.1)), (build("streamingllm", {}), Budget.parse(0.05)),
             (build("snapkv", {}), Budget.parse(0.05)), (build("random", {}), Budget.parse(0.05))]  # fmt: skip
    if not forks:
        monkeypatch.setattr(grid_decode, "MAX_ROWS", len(confs))  # a full batch: no room for a forked row
    request = StatsRequest()
    for method, _ in confs:
        request = request | method.stats_request()
    prefill = engine.prefill(prompt, request)
    gens = generate_grid(engine, prefill, confs, question, 10, max_padding=100.0, keep_logits=True)  # one batch
    answer = gens[0].token_ids
    left = [i for i, gen in enumerate(gens) if i and fidelity.decoded_logits(gen, answer) is None]
    by_token = [i for i in left if confs[i][0].name == "h2o"]
    forked = [i for i in left if gens[i].forced is not None]
    assert left and all((gens[i].divergence is None) == (i in forked) for i in left), "forked, or a copy kept"
    assert forked == (by_token if forks else []), "the token-by-token rows are forked where there is room"
    steps = {(gens[i].forced or gens[i].divergence).step for i in by_token}  # forced from here
    assert len(steps) == 2 and min(steps) > 0, "two rows resumed from two steps of their own (own positions)"
    for i in forked:
        assert len(gens[i].forced.logits) == len(answer) - gens[i].forced.step, "forced to the answer's end"
    runs = [fidelity.Ran(m, b, engine, prefill, gen) for (m, b), gen in zip(confs, gens)]
    forced, seconds = fidelity.forced_rows([(i, runs[i]) for i in left], question, answer, 10)
    assert all(seconds[i] > 0 for i in left)
    for i in left:
        method, budget = confs[i]
        alone = fidelity.compressed_logits(engine, prefill, method, budget, question, answer, 10)
        assert torch.equal(forced[i], alone.float()), method.name


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["gemma3"])  # the bundled Gemma 3's layout; tiny Mistral's rows keep its answer
def test_window_layer_rows_that_left_the_answer_are_forked_as_forced_alone(family, dtype):
    """Models with sliding-window layers (tests/model/families.py): a grid's rows stand at one position, so a row that
    leaves the full answer is forked into the grid there too (its windows copied with it), and its distributions are,
    bit for bit, its cache compressed again and forced from the start alone."""
    from kvbench.model.load import byte_tokenizer, finish
    from kvbench.native.grid_decode import generate_grid
    from kvbench.native.slots import decode_kernels
    from tests.model.families import build as build_family

    import transformers

    torch_dtype = getattr(torch, dtype)
    # bit for bit, but in fp32 under transformers < 5.3 (kvpress's venv), whose window layers' fp32 decode rounds by
    # the batch (test_window_layers_decode_in_the_grid_as_alone): within 1e-6 there
    old = tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (5, 3)
    exact = not (old and dtype == "float32")
    lm = finish(build_family(family, dtype=torch_dtype), byte_tokenizer(), family, torch.device("cpu"), torch_dtype)
    engine = Engine(lm)
    if not decode_kernels(lm.model):
        pytest.skip("the decode kernels do not take every linear layer of this model: its rows decode alone")
    ids = torch.randint(3, 300, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    confs = [(build("full", {}), None), (build("h2o", {}), Budget.parse(0.05)), (build("h2o", {}), Budget.parse(0.1)),
             (build("streamingllm", {}), Budget.parse(0.05)), (build("snapkv", {"window_size": 8}), Budget.parse(0.05))]  # fmt: skip
    request = StatsRequest()
    for method, _ in confs:
        request = request | method.stats_request()
    prefill = engine.prefill(ids, request)
    gens = generate_grid(engine, prefill, confs, [], 10, max_padding=100.0, keep_logits=True)  # one batch
    answer = gens[0].token_ids
    left = [i for i, gen in enumerate(gens) if i and fidelity.decoded_logits(gen, answer) is None]
    forked = [i for i in left if gens[i].forced is not None]
    assert forked and all(gens[i].forced.step > 0 for i in forked), "forked where they left, inside the grid"
    runs = [fidelity.Ran(m, b, engine, prefill, gen) for (m, b), gen in zip(confs, gens)]
    forced, _ = fidelity.forced_rows([(i, runs[i]) for i in left], [], answer, 10)
    for i in left:
        method, budget = confs[i]
        alone = fidelity.compressed_logits(engine, prefill, method, budget, [], answer, 10).float()
        if exact:
            assert torch.equal(forced[i], alone), (method.name, i in forked)
        else:
            assert (forced[i] - alone).abs().max() < 1e-6, (method.name, i in forked)
