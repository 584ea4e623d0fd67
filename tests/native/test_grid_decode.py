"""Configurations of one example decoded as one batch (kvbench.native.grid_decode) give what each gives alone."""

import pandas as pd
import pytest
from omegaconf import OmegaConf

from kvbench import KvbenchError
from kvbench.methods import Budget, build_method, method_defaults
from kvbench.model.load import load_model
from kvbench.native.engine import Engine
from kvbench.native.grid_decode import generate_grid, groups
from kvbench.run.runner import run
from kvbench.store.results import read_rows
from tests.conftest import CONF_DIR, compose_config, tiny_overrides

# (name, knobs, budget, decoded in the grid?)
GRID = [
    ("full", {}, None, True),
    ("snapkv", {"window_size": 8}, 0.25, True),
    ("snapkv", {"window_size": 8}, 0.5, True),
    ("pyramidkv", {"window_size": 8}, 0.5, True),  # per-layer counts
    ("h2o", {}, 0.25, True),  # decode-time eviction with accumulated attention, on its own row
    ("streamingllm", {}, 0.3, True),  # decode-time eviction, absolute positions
    ("tova", {}, 0.4, True),
    ("knorm", {}, 0.5, True),
    ("decoding", {"compress_every": 2, "decode_budget": 100}, 0.6, True),  # re-selects every 2 steps
    ("kivi", {"group_size": 16, "residual_length": 32}, None, False),  # storage of its own
    ("streamingllm", {"positions": "rolling"}, 0.3, False),  # re-indexed positions
]


def build(name, params):
    return build_method(name, {**method_defaults(name), **params})


def confs():
    return [(build(n, p), Budget.parse(b) if b else None) for n, p, b, _ in GRID]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("suffix", [0, 12], ids=["query_aware", "appended_question"])
def test_grid_rows_equal_one_by_one(tiny_engine, prompt_ids, suffix, dtype):
    """fp32 and bf16 (the row-independent linear kernel: kvbench/kernels/cpu/decode_linear.py, which the loader installs)."""
    from kvbench.native.slots import decode_kernels

    if dtype == "bfloat16":
        tiny_engine = Engine(load_model(OmegaConf.load(CONF_DIR / "model" / "tiny-random.yaml"), "cpu", dtype))
    if not decode_kernels(tiny_engine.lm.model):
        pytest.skip("no C compiler: the decode-linear kernel is not built")
    prompt, question = (prompt_ids[:-suffix], prompt_ids[-suffix:]) if suffix else (prompt_ids, [])
    request = None
    for method, _ in confs():
        request = method.stats_request() if request is None else request | method.stats_request()
    prefill = tiny_engine.prefill(prompt, request)
    together = generate_grid(tiny_engine, prefill, confs(), question, max_new_tokens=10, max_padding=100.0)  # 1 batch
    alone = [tiny_engine.generate(prefill, m, b, question, max_new_tokens=10) for m, b in confs()]
    for (name, _, budget, in_grid), got, want in zip(GRID, together, alone):
        label = f"{name} {budget}"
        assert got.token_ids == want.token_ids and got.text == want.text, label
        assert got.decode_steps == want.decode_steps == 9, label
        assert got.kv_bytes == want.kv_bytes and got.kv_bytes_full == want.kv_bytes_full, label
        assert got.kv_ratio == want.kv_ratio and got.context_tokens == want.context_tokens, label
        assert getattr(got, "batch_size", 1) == (sum(g[3] for g in GRID) if in_grid else 1), label
    assert len({g.kv_bytes for g in together}) > 5  # the rows really differ in size


def test_padding_bounds_the_groups():
    lengths = [[100] * 3, [50] * 3, [50] * 3, [25] * 3, [25] * 3, [10] * 3, [10] * 3, [10] * 3]
    out = groups(lengths, max_padding=2.0)
    assert sorted(r for g in out for r in g) == list(range(8))
    for g in out:
        padded = len(g) * sum(max(lengths[r][layer] for r in g) for layer in range(3))
        assert padded <= 2.0 * sum(sum(lengths[r]) for r in g)
    assert out == [[0, 1, 2, 3, 4], [5, 6, 7]]  # 5 × 100 = 2 × 250; one more row of 10 would pass 2×
    assert groups(lengths[:6], max_padding=2.0) == [[0, 1, 2, 3, 4, 5]]  # a last row alone joins the batch before
    assert groups(lengths) == [list(range(8))]  # the default, 3: 8 × 100 = 2.86 × 280
    assert groups(lengths, max_padding=4.0) == [list(range(8))]  # 8 × 100 = 2.86 × 280: one batch (grid_padding=4)
    assert groups(lengths, max_padding=1.0) == [[0], [1, 2], [3, 4], [5, 6, 7]]  # no pads: equal lengths only
    assert groups([[100], [100], [10]], max_padding=1.0) == [[0, 1, 2]]  # but a last row alone joins (+ one row)


def test_runner_grid_batch_switch(tmp_path):
    """grid_batch=true and false: the same rows (predictions, scores, bytes, ratios, hashes); only timings differ."""
    kivi = "{name:kivi,group_size:16,residual_length:32}"
    grid = [f"grid.method=[snapkv,h2o,streamingllm,{kivi}]", "grid.budget=[0.2,0.5]", "task.max_new_tokens=5"]
    on = run(compose_config(*tiny_overrides(tmp_path / "on", *grid)), output_dir=tmp_path / "on" / "out")  # auto: fp32
    off = run(
        compose_config(*tiny_overrides(tmp_path / "off", *grid, "grid_batch=false")),
        output_dir=tmp_path / "off" / "out",
    )
    key = ["method", "budget", "example_id"]
    a, b = on.sort_values(key).reset_index(drop=True), off.sort_values(key).reset_index(drop=True)
    same = ["prediction", "score", "kv_bytes", "kv_bytes_full", "kv_ratio", "new_tokens", "config_hash"]
    assert a[same].equals(b[same])
    assert (b.batch_size == 1).all()
    assert set(a[a.method == "kivi"].batch_size) == {1}  # decoded alone
    assert (a[a.method.isin(["snapkv", "h2o", "streamingllm"])].batch_size > 1).all()
    assert len(read_rows(tmp_path / "on" / "store")) == len(a)
    no_pads = (
        run(
            compose_config(*tiny_overrides(tmp_path / "pads", *grid, "grid_padding=1")),
            output_dir=tmp_path / "pads" / "out",
        )
        .sort_values(key)
        .reset_index(drop=True)
    )
    assert no_pads[same].equals(a[same])  # grid_padding changes the batches, never the rows
    in_grid = a.method.isin(["snapkv", "h2o", "streamingllm"])
    assert no_pads[in_grid].batch_size.max() < a[in_grid].batch_size.max()
    with pytest.raises(KvbenchError, match="grid_padding=3"):
        run(compose_config(*tiny_overrides(tmp_path / "bad", "grid_padding=0.5")), output_dir=tmp_path / "bad")


def test_a_single_method_run_decodes_each_configuration_alone(tmp_path, capsys):
    """The default job's shape (one method + the full baseline): grid_batch=auto decodes each configuration on its
    own, so each row's decode_ms_per_token is its method's; the rows are grid_batch=true's but for the timings,
    batch_size and the process's peak memory (hashes included), and there the summary shows the batch's step."""
    auto = run(compose_config(*tiny_overrides(tmp_path / "auto", "task.max_new_tokens=5")), tmp_path / "auto" / "o")
    alone = capsys.readouterr().out
    forced = run(
        compose_config(*tiny_overrides(tmp_path / "on", "task.max_new_tokens=5", "grid_batch=true")),
        output_dir=tmp_path / "on" / "out",
    )
    together = capsys.readouterr().out
    key = ["method", "budget", "example_id"]
    a, b = auto.sort_values(key).reset_index(drop=True), forced.sort_values(key).reset_index(drop=True)
    timings = {
        "run_id",
        "timestamp",
        "prefill_s",
        "decode_s",
        "decode_ms_per_token",
        "decode_tokens_per_s",
        "fidelity_s",
        "bandwidth_share",
    }
    measured = timings | {
        "step_bytes",
        "latency_s",
        "batch_size",
        "peak_mem_bytes",
        "peak_mem_delta_bytes",
    }  # RSS: per process
    assert [c for c in a.columns if c not in measured and not a[c].equals(b[c])] == []
    assert set(a.method) == {"full", "streamingllm"} and (a.batch_size == 1).all() and (b.batch_size == 2).all()
    assert "batch_ms_per_step" not in alone and "decode_ms_per_token" in alone
    assert "batch_ms_per_step" in together


def test_guide_compares_decode_speed_only_between_rows_timed_alone():
    """A grid-batched row's decode ms/token is its batch's step time: the guide's decode_vs_full skips it."""
    import pandas as pd

    from kvbench.guide.selection import guide_table
    from tests.report.test_report import row

    def rows(method, budget, ms, batch):
        return [row(method, budget, f"ex{i}", 1.0, decode_ms_per_token=ms, batch_size=batch) for i in range(6)]

    frame = pd.DataFrame(rows("full", 1.0, 40.0, 1) + rows("snapkv", 0.5, 20.0, 1) + rows("h2o", 0.5, 40.0, 3))
    table = guide_table(frame).set_index("config")
    assert table.loc["snapkv", "decode_vs_full"] == 0.5
    assert pd.isna(table.loc["h2o", "decode_vs_full"])


def test_grid_batch_auto_follows_row_independence_and_forced_elsewhere_hashes_apart():
    """auto decodes together where rows come out as alone: with the row-independent decode kernels in float32 and
    bfloat16, without them in float32 only; forcing it elsewhere gives its rows a hash of their own, and rows of the
    kernels hash apart from torch's."""
    from types import SimpleNamespace

    import torch

    from kvbench.config.spec import RunSpec
    from kvbench.kernels.backend import backend
    from kvbench.native.slots import decode_kernels
    from kvbench.rows.config_hash import grid_batching, hash_configuration
    from kvbench.rows.configuration import configurations

    cpu = backend("cpu")

    def lm(dtype, kernel: bool):
        model = torch.nn.Sequential(torch.nn.Linear(4, 4, bias=False))
        if kernel:
            assert cpu is not None and cpu.install(model) == 1
        layout = SimpleNamespace(has_sliding=False)  # all layers global, as the tiny model's
        return SimpleNamespace(dtype=dtype, device=torch.device("cpu"), model=model, layout=layout)

    fp32, bf16 = lm(torch.float32, False), lm(torch.bfloat16, False)
    assert grid_batching(RunSpec(grid_batch="auto"), fp32, 2) and not grid_batching(RunSpec(), bf16, 2)
    assert grid_batching(RunSpec(grid_batch=True), bf16, 2)
    assert not grid_batching(RunSpec(grid_batch=False), fp32, 2)
    assert grid_batching(RunSpec(), lm(torch.bfloat16, True), 2) and grid_batching(
        RunSpec(), lm(torch.float32, True), 2
    )
    # one requested configuration besides the baseline (the default job): auto decodes each alone, true still batches
    assert not grid_batching(RunSpec(), lm(torch.bfloat16, True), 1) and not grid_batching(RunSpec(), fp32, 1)
    assert grid_batching(RunSpec(grid_batch=True), fp32, 1)
    hashes = {}
    for setting in ("auto", True, False):
        for model in (fp32, bf16, lm(torch.bfloat16, True)):
            cfg = compose_config(f"grid_batch={str(setting).lower()}", "model=tiny-random")
            kernel = decode_kernels(model.model)
            hashes[setting, str(model.dtype), kernel] = hash_configuration(
                configurations(RunSpec.of(cfg))[0], RunSpec.of(cfg), model
            )
    assert hashes["auto", "torch.float32", False] == hashes[True, "torch.float32", False]
    assert hashes["auto", "torch.float32", False] == hashes[False, "torch.float32", False]
    assert hashes["auto", "torch.bfloat16", False] == hashes[False, "torch.bfloat16", False]
    assert hashes["auto", "torch.bfloat16", False] != hashes[True, "torch.bfloat16", False]
    kernel_rows = {hashes[setting, "torch.bfloat16", True] for setting in ("auto", True, False)}
    assert len(kernel_rows) == 1  # with the kernels a grid row is the one-by-one row: one hash whatever the setting
    assert kernel_rows.isdisjoint(set(hashes.values()) - kernel_rows)  # ... their own: they round unlike torch's


def test_groups_hold_at_most_max_rows():
    lengths = [[10] * 2] * 40
    out = groups(lengths, max_rows=16)
    assert [len(g) for g in out] == [16, 16, 8] and sorted(r for g in out for r in g) == list(range(40))
    assert [len(g) for g in groups(lengths[:17], max_rows=16)] == [16, 1]  # no room: the last row stays alone


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_grid_step_attends_row_by_row_as_alone(tiny, dtype):
    """Each row of a padded grid step gets the bits its own batch-1 attention call gives; the rows that record
    statistics get the fused decode step's output and its probabilities (zero past the row's length)."""
    import torch

    from kvbench.kernels.attention_stats import decode_attention_with_probs
    from kvbench.model.attention import StatsRequest, _attention
    from kvbench.model.padded import PaddedKV
    from kvbench.native.grid_decode import RowsRecorder

    dt = getattr(torch, dtype)
    module = tiny.model.model.layers[0].self_attn
    generator = torch.Generator().manual_seed(0)
    lengths = [37, 90, 5, 64]
    n_q, n_kv, dim = tiny.n_q_heads, tiny.n_kv_heads, tiny.head_dim
    query = torch.randn(4, n_q, 1, dim, generator=generator).to(dt)  # (B, H_q, 1, D)
    keys, values = (torch.randn(4, n_kv, 96, dim, generator=generator).to(dt) for _ in range(2))  # (B, H_kv, T, D)
    mask = (torch.arange(90) < torch.tensor(lengths)[:, None])[:, None, None, :]  # (B, 1, 1, T)
    padded_k = PaddedKV(keys[:, :, :90], mask, lengths)
    padded_v = PaddedKV(values[:, :, :90], mask, lengths)
    out, _ = _attention(module, query, padded_k, padded_v, None, dim**-0.5)
    for row, n in enumerate(lengths):
        alone, _ = _attention(
            module, query[row : row + 1], keys[row : row + 1, :, :n], values[row : row + 1, :, :n], None, dim**-0.5
        )
        assert torch.equal(out[row : row + 1], alone), row
    recorder = RowsRecorder(StatsRequest(all_queries=True), [1, 2], "cpu")
    from kvbench.model.attention import recording

    with recording(recorder.request, recorder):
        out, _ = _attention(module, query, padded_k, padded_v, None, dim**-0.5)
    for i, row in enumerate([1, 2]):
        n = lengths[row]
        fused, probs = decode_attention_with_probs(
            query[row : row + 1], keys[row : row + 1, :, :n], values[row : row + 1, :, :n], dim**-0.5
        )
        assert torch.equal(out[row : row + 1], fused)
        assert torch.equal(recorder.all_queries[0][i, :, :n], probs[0])
        assert not recorder.all_queries[0][i, :, n:].any()


WINDOW_GRID = [  # (name, knobs, budget, decoded in the grid?)
    ("full", {}, None, True),
    ("snapkv", {"window_size": 8}, 0.25, True),
    ("knorm", {}, 0.5, True),
    ("pyramidkv", {"window_size": 8}, 0.5, True),  # per-layer counts on the global layers
    ("h2o", {}, 0.25, True),  # evicts while decoding (never a window layer)
    ("streamingllm", {}, 0.25, True),
    ("kivi", {"group_size": 16, "residual_length": 16}, None, False),  # storage of its own (on global layers)
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("family", ["gemma3", "mistral", "gemma2", "gpt-oss"])
def test_window_layers_decode_in_the_grid_as_alone(family, dtype):
    """Models with sliding-window layers (tests/model/families.py, windows of 64 under a 150-token prompt): the rows
    share one batch (their windows stacked: GridWindowLayer; the methods that evict while decoding too — they never
    evict a window layer) and give what each gives alone: the same tokens and bytes, the same logits bit for bit
    (within 1e-6 where noted below)."""
    import torch

    from kvbench.model.load import byte_tokenizer, finish
    from kvbench.native.slots import decode_kernels
    from tests.model.families import build as build_family

    import transformers

    torch_dtype = getattr(torch, dtype)
    # bit for bit, but Gemma 2's soft-capped eager attention over a batch (~1e-7), and fp32 under transformers < 5.3
    # (kvpress's venv: its window layers' fp32 decode rounds by the batch, ~3e-7): within 1e-6 there, tokens equal
    old = tuple(int(p) for p in transformers.__version__.split(".")[:2]) < (5, 3)
    exact = family != "gemma2" and not (old and dtype == "float32")
    lm = finish(build_family(family, dtype=torch_dtype), byte_tokenizer(), family, torch.device("cpu"), torch_dtype)
    engine = Engine(lm)
    if not decode_kernels(lm.model):
        pytest.skip("the decode kernels do not take every linear layer of this model: its rows decode alone")
    ids = torch.randint(3, 300, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    confs = [(build(n, p), Budget.parse(b) if b else None) for n, p, b, _ in WINDOW_GRID]
    request = None
    for method, _ in confs:
        request = method.stats_request() if request is None else request | method.stats_request()
    prefill = engine.prefill(ids, request)
    together = generate_grid(engine, prefill, confs, [], max_new_tokens=10, max_padding=100.0, keep_logits=True)
    alone = [engine.generate(prefill, m, b, [], max_new_tokens=10, keep_logits=True) for m, b in confs]
    for (name, _, budget, in_grid), got, want in zip(WINDOW_GRID, together, alone):
        label = f"{family} {name} {budget}"
        assert got.token_ids == want.token_ids and got.kv_bytes == want.kv_bytes, label
        apart = max(float((a - b).abs().max()) for a, b in zip(got.logits, want.logits))
        assert apart <= (0.0 if exact else 1e-6), label
        if family == "gemma3" and in_grid is not None:  # global and window layers (the others: every layer alike)
            assert (getattr(got, "batch_size", 1) >= 4) == in_grid, label


@pytest.mark.parametrize("family", ["gemma3", "mistral", "gemma2"])
def test_an_appended_question_goes_in_one_forward_past_window_layers(family, monkeypatch):
    """A question appended after compression (query_aware=false) is one forward when only the window layers hold
    fewer tokens than the others (each window layer masks from its own offset: kvbench.model.cache.one_mask), and
    gives what feeding it token by token gives."""
    import torch

    import kvbench.native.engine as engine_module
    from kvbench.model.cache import WINDOW_MASK_APART, one_mask
    from kvbench.model.load import byte_tokenizer, finish
    from tests.model.families import build as build_family

    lm = finish(build_family(family), byte_tokenizer(), family, torch.device("cpu"), torch.float32)
    engine = Engine(lm)
    ids = torch.randint(3, 300, (150,), generator=torch.Generator().manual_seed(1)).tolist()
    question = ids[20:50]
    method, budget = build("snapkv", {}), Budget.parse(0.5)
    start = engine.compressed(engine.prefill(ids, method.stats_request()), method, budget, [])
    # the window layers hold 63 tokens, the others 75 (Mistral: every layer a window layer, all of one length)
    assert one_mask(start.cache) == (WINDOW_MASK_APART or family == "mistral")
    one = engine.generate(engine.prefill(ids, method.stats_request()), method, budget, question, 8, keep_logits=True)
    monkeypatch.setattr(engine_module, "one_mask", lambda cache: False)
    each = engine.generate(engine.prefill(ids, method.stats_request()), method, budget, question, 8, keep_logits=True)
    assert one.token_ids == each.token_ids and one.kv_bytes == each.kv_bytes
    assert max(float((a - b).abs().max()) for a, b in zip(one.logits, each.logits)) < 1e-4


def test_a_sweeps_predictions_are_each_configuration_run_alone(tmp_path):
    """The sweep at its fastest (one shared prefill, the grid decoded as one batch, fidelity on) answers exactly as
    every configuration run on its own (its own prefill, decoded alone, no fidelity): same predictions and bytes."""
    grid = ["grid.method=[snapkv,h2o,streamingllm,random]", "grid.budget=[0.25,0.5]", "task.max_new_tokens=8"]
    sweep = run(compose_config(*tiny_overrides(tmp_path / "sweep", *grid)), output_dir=tmp_path / "sweep" / "o")
    assert sweep.batch_size.max() > 2 and sweep.kl_mean.notna().all()
    key = ["method", "budget", "example_id"]
    alone = []
    for method in ["snapkv", "h2o", "streamingllm", "random"]:
        for budget in [0.25, 0.5]:
            own = tiny_overrides(tmp_path / f"{method}{budget}", f"method={method}", f"budget={budget}")
            alone.append(
                run(
                    compose_config(*own, "task.max_new_tokens=8", "fidelity=false", "grid_batch=false"),
                    output_dir=tmp_path / f"{method}{budget}" / "o",
                )
            )
    each = pd.concat(alone).drop_duplicates(key).set_index(key).sort_index()
    ours = sweep.set_index(key).sort_index().loc[each.index]
    assert ours.prediction.tolist() == each.prediction.tolist()
    assert ours.kv_bytes.tolist() == each.kv_bytes.tolist()


def test_rows_leaving_a_grid_move_the_fewest_rows_and_keep_every_rows_tokens():
    """Finished rows leave by holes filled from the batch's end (fill_holes): each kept row's own slots are what
    they were, the batch is the kept count, and a row that did not move was not copied."""
    import torch

    from kvbench.native.grid_decode import GridLayer, fill_holes

    assert fill_holes([0, 2, 4]) == [0, 4, 2]
    assert fill_holes([1, 2, 3]) == [3, 1, 2]
    assert fill_holes([0, 1]) == [0, 1]
    generator = torch.Generator().manual_seed(0)
    rows = [
        (torch.randn(1, 2, n, 4, generator=generator), torch.randn(1, 2, n, 4, generator=generator))
        for n in (7, 3, 9, 1, 5)
    ]
    grid = GridLayer(rows)
    storage = grid.keys.data_ptr()
    order = fill_holes([0, 2, 4])
    grid.move_rows(order)
    assert grid.lengths == [7, 5, 9] and grid.keys.shape[0] == 3 and grid.keys.data_ptr() == storage
    for i, old in enumerate(order):
        k, v = rows[old]
        assert torch.equal(grid.keys[i : i + 1, :, : k.shape[2]], k) and torch.equal(
            grid.values[i : i + 1, :, : k.shape[2]], v
        )


def test_a_grid_trims_malloc_once_per_compression(tiny_engine, prompt_ids, monkeypatch):
    """On the CPU each reset of the peak returns malloc's free memory to the OS (malloc_trim), and every page the next
    steps touch then faults in again: a grid of C configurations resets once, then once per compression (whose
    reset also tells what the caches compressed before it hold) — not again to read that, nor before a decode whose
    peak no row reports. Each row's peak is its compression's less those earlier caches, never below the prefill's."""
    import functools
    import operator

    import kvbench.native.engine as engine_module
    from kvbench.native import memory

    trims, starts = [], []
    monkeypatch.setattr(memory, "_trim", lambda: trims.append(1))
    compressed = engine_module.Engine.compressed

    def recorded(self, *args, **kwargs):
        start = compressed(self, *args, **kwargs)
        starts.append(start)
        return start

    monkeypatch.setattr(engine_module.Engine, "compressed", recorded)
    in_grid = [(m, b) for (m, b), row in zip(confs(), GRID) if row[3]]
    prefill = tiny_engine.prefill(prompt_ids, functools.reduce(operator.or_, (m.stats_request() for m, _ in in_grid)))
    trims.clear()
    gens = generate_grid(tiny_engine, prefill, in_grid, [], max_new_tokens=6, max_padding=100.0)
    assert len(trims) == 1 + len(in_grid)  # the base, then each compression's own
    assert all(g.batch_size == len(in_grid) for g in gens)
    assert all(g.peak_mem_bytes >= prefill.peak_mem_bytes for g in gens)
    assert len(starts) == len(in_grid) and all(s.start_bytes > 0 for s in starts)  # the RSS each compression began at


def test_a_forked_row_is_its_parents_slots_in_a_reserved_row():
    """GridLayer.fork: a new last row holding a copy of a row's tokens — in a reserved row of the same storage (no other
    row copied), still there after rows left and after the slots grew; with no row reserved the tensors grow by one."""
    import torch

    from kvbench.native.grid_decode import GROW, GridLayer, fill_holes

    generator = torch.Generator().manual_seed(0)
    rows = [
        (torch.randn(1, 2, n, 4, generator=generator), torch.randn(1, 2, n, 4, generator=generator)) for n in (7, 3, 5)
    ]
    grid = GridLayer(rows, reserve=2)
    storage = grid.keys.data_ptr()
    grid.move_rows(fill_holes([0, 2]))  # row 1 left: rows 0 and 2 (now at index 1) stay
    grid.fork(1)
    assert grid.lengths == [7, 5, 5] and grid.keys.shape[0] == 3 and grid.keys.data_ptr() == storage
    assert torch.equal(grid.keys[2, :, :5], rows[2][0][0]) and torch.equal(grid.values[2, :, :5], rows[2][1][0])
    token = torch.randn(3, 2, 1, 4, generator=generator)  # (B, H_kv, 1, D)
    for _ in range(GROW + 1):  # past the capacity: the slots grow, the reserve stays
        grid.update(token, token)
    assert grid.keys.shape[2] == 7 + 2 * GROW and grid.lengths == [7 + GROW + 1, 6 + GROW, 6 + GROW]
    grid.fork(0)
    assert grid.keys.shape[0] == 4 and torch.equal(
        grid.keys[3, :, : grid.lengths[3]], grid.keys[0, :, : grid.lengths[0]]
    )
    assert torch.equal(grid.keys[2, :, :5], rows[2][0][0]) and torch.equal(grid.keys[2, :, 5], token[2, :, 0])
    grid.fork(3)  # no row reserved any more: the tensors grow by one row
    assert grid.keys.shape[0] == 5 and torch.equal(
        grid.values[4, :, : grid.lengths[4]], grid.values[0, :, : grid.lengths[0]]
    )
