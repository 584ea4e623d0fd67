"""`python -m kvbench.bench stability`: kept-set overlap between float32 and bfloat16, and tied scores at the cut."""

import pytest
import torch

from kvbench.bench.__main__ import main
from kvbench.bench.stability import Kept, overlap, tie_stats

TINY = ["model=tiny-random", "device=cpu", "task=niah", "task.context_lengths=[700]", "task.depths=[0.5]"]


def test_tie_stats_on_constructed_scores():
    scores = torch.tensor(
        [
            [5.0, 4.0, 3.0, 2.0, 1.0, float("inf")],  # no ties; the window (+inf) is not a score
            [3.0, 3.0, 3.0, 1.0, 0.0, float("inf")],  # three tied; the cut (3rd kept: 3.0) inside them
            [4.0, 2.0, 2.0, 1.0, 1.0, float("inf")],  # four tied; the cut (3rd kept: 2.0) inside a tie
        ]
    )
    tied, cut_tied = tie_stats(scores, 3)  # 3 kept: the window and the two best
    assert tied.tolist() == pytest.approx([0.0, 0.6, 0.8])
    assert cut_tied.tolist() == [False, True, True]  # kept: +inf, 4.0, 2.0 — and 2.0 is shared
    _, cut_tied = tie_stats(scores, 5)  # cut at the 4th score: 2.0, 1.0 (tied), 1.0 (tied)
    assert cut_tied.tolist() == [False, False, True]


def test_overlap_per_layer_and_head():
    a = Kept([torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]]), None])
    b = Kept([torch.tensor([[0, 1, 2, 9], [4, 5, 6, 7]]), None])
    (layer,) = overlap(a, b)  # the layer kept whole is not compared
    assert layer.tolist() == [0.75, 1.0]


def test_command_prints_the_table_for_the_scorers(capsys):
    code = main(["stability", *TINY, "grid.method=[knorm,snapkv,streamingllm]", "grid.budget=[0.25]"])
    out = capsys.readouterr().out.splitlines()
    assert code == 0
    assert sum(line.startswith("stability benchmark: ") for line in out) == 2  # a header per dtype loaded
    head = next(i for i, line in enumerate(out) if line.startswith("method"))
    lines = {line.split()[0]: line.split() for line in out[head + 1 : head + 4]}
    assert set(lines) == {"knorm", "snapkv", "streamingllm"}
    for cells in lines.values():
        assert cells[1] == "0.25" and 0 < float(cells[3]) <= 1 and float(cells[4]) <= float(cells[3])
    assert float(lines["streamingllm"][3]) == 1.0 and lines["streamingllm"][6] == "–"  # positions only, no scores
    assert float(lines["knorm"][3]) < 1.0  # bf16 keys reorder knorm's choice on the random model
    assert any(line.startswith("kept-set overlap per evicting layer") for line in out)
    assert any(line.startswith("  knorm 0.25: ") for line in out)


@pytest.mark.parametrize(
    "extra, message",
    [
        (["method=kivi", "method.group_size=16"], "the stability check compares"),
        (["method=nope"], "nope"),
        (["task.bogus=1"], "bogus"),
        (["bench.window=2"], "stability has no option bench.window; its options: none"),
    ],
)
def test_bad_input_is_one_line_exit_2(capsys, extra, message):
    assert main(["stability", *TINY, *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("kvbench.bench: error:") and message in err
