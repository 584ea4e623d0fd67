"""Keeping tokens (kvbench/kernels/compact.py; by runs in the CPU backend, kvbench/kernels/cpu/tokens.py): in place, slots [0, N) end
up exactly as a gather would make them; out of place, the very tensor torch's gather makes."""

import pytest
import torch

from kvbench.kernels import compact


def sorted_positions(n_old, n_keep, heads, seed):
    generator = torch.Generator().manual_seed(seed)
    rows = [torch.randperm(n_old, generator=generator)[:n_keep].sort().values for _ in range(heads)]
    return torch.stack(rows)[None]  # (1, H, N)


CASES = {
    "none evicted": lambda n, h: torch.arange(n).expand(1, h, n),
    "first": lambda n, h: torch.arange(1, n).expand(1, h, n - 1),
    "after the sinks": lambda n, h: torch.cat([torch.arange(4), torch.arange(5, n)]).expand(1, h, n - 1),
    "last": lambda n, h: torch.arange(n - 1).expand(1, h, n - 1),
    "per head, many": lambda n, h: sorted_positions(n, n // 3, h, seed=0),
}


@pytest.mark.parametrize("no_c", [False, True], ids=["c", "torch"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES)
def test_compacting_in_place_equals_a_gather(case, dtype, no_c, monkeypatch):
    if no_c:
        monkeypatch.setenv("KVBENCH_NO_CPU_EXT", "1")
    elif pytest.importorskip("kvbench.kernels.cpu.tokens")._function("compact_tokens", "plllllpl") is None:
        pytest.skip("no C compiler: the kernel is not built")
    grid = torch.randn(3, 3, 300, 16).to(dtype)  # (B, H, capacity, D): rows are slices, heads strided
    row = grid[1:2, :, :257]  # (1, H, 257, D) a grid row's view
    index = CASES[case](257, 3)
    want = row.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, 16)).clone()
    others = grid[[0, 2]].clone()
    compact.compact_tokens(row, index)
    assert torch.equal(row[:, :, : index.shape[-1]], want)
    assert torch.equal(grid[[0, 2]], others)  # the other rows untouched


def test_positions_out_of_order_take_the_gather_and_out_of_range_ones_raise():
    """The kernel takes strictly increasing positions only; others go to torch's gather (the result a decode alone
    gets), which raises for positions outside the cache — with nothing moved."""
    t = torch.randn(1, 2, 10, 4)
    before = t.clone()
    unsorted = torch.tensor([[[3, 1, 2], [0, 1, 2]]])
    compact.compact_tokens(t, unsorted)
    assert torch.equal(t[:, :, :3], before.gather(2, unsorted.unsqueeze(-1).expand(-1, -1, -1, 4)))
    t = before.clone()
    with pytest.raises(RuntimeError):
        compact.compact_tokens(t, torch.tensor([[[0, 1, 10], [0, 1, 2]]]))
    assert torch.equal(t, before)
    with pytest.raises(ValueError, match="one row"):
        compact.compact_tokens(torch.randn(2, 2, 10, 4), torch.zeros(2, 2, 3, dtype=torch.int64))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_gathering_equals_torchs_gather(dtype):
    """Compression's gather (kvbench.model.cache.gather_kv): batch rows, strided heads (a slice of a longer tensor), sorted
    and unsorted positions, repeats, none kept — the same values, shape and contiguity as torch's gather."""
    source = torch.randn(2, 3, 400, 16).to(dtype)[:, :, :300]  # (B, H, T, D), heads 400 tokens apart
    generator = torch.Generator().manual_seed(1)
    sorted_index = torch.stack([torch.stack([torch.randperm(300, generator=generator)[:90].sort().values
                                             for _ in range(3)]) for _ in range(2)])  # fmt: skip
    for index in (sorted_index, sorted_index.flip(-1), torch.zeros(2, 3, 5, dtype=torch.int64),
                  torch.arange(300).expand(2, 3, 300), torch.zeros(2, 3, 0, dtype=torch.int64)):  # fmt: skip
        want = source.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, 16))  # (B, H, N, D)
        got = compact.gather_tokens(source, index)
        assert torch.equal(got, want) and got.shape == want.shape and got.is_contiguous()
    heads = source[:, 1:]  # (B, 2, T, D): a head slice (batch stride ≠ H · head stride)
    index = sorted_index[:, :2]
    assert torch.equal(compact.gather_tokens(heads, index), heads.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, 16)))
    one_row = sorted_index[:1]  # (1, H, N) against two rows: torch gathers from the first row only, and so do we
    want = source.gather(2, one_row.unsqueeze(-1).expand(-1, -1, -1, 16))
    assert torch.equal(compact.gather_tokens(source, one_row), want)
    with pytest.raises(RuntimeError):  # a position outside the cache: torch's gather says so
        compact.gather_tokens(source, torch.full((2, 3, 4), 300))


def test_gathering_a_prefills_keys_as_the_projection_laid_them_out():
    """A prefill's keys are a (B, T, H, D) tensor seen as (B, H, T, D): gathered without a copy of the whole, the
    values torch's gather gives."""
    source = torch.randn(2, 50, 3, 8).transpose(1, 2)  # (B, H, T, D), stored (B, T, H, D)
    index = torch.stack([torch.randperm(50)[:20].sort().values for _ in range(6)]).view(2, 3, 20)  # (B, H, N)
    got = compact.gather_tokens(source, index)
    assert torch.equal(got, source.gather(2, index.unsqueeze(-1).expand(-1, -1, -1, 8))) and got.is_contiguous()
