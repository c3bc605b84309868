"""`bench/turns_cpu.py --pairs`: both trees run as often, interleaved, and averaged per turn."""

from bench.turns_cpu import interleaved, mean_rows


def test_pairs_alternate_which_tree_runs_first():
    assert interleaved(1) == ["gateway", "baseline"]
    order = interleaved(4)
    assert order == ["gateway", "baseline", "baseline", "gateway"] * 2
    assert order.count("gateway") == order.count("baseline") == 4


def test_runs_are_averaged_turn_by_turn():
    runs = [
        [
            {"turn": 1, "requests": 8, "cpu_ms_per_request": 2.0},
            {"turn": 2, "requests": 8, "cpu_ms_per_request": 3.0},
        ],
        [
            {"turn": 1, "requests": 8, "cpu_ms_per_request": 4.0},
            {"turn": 2, "requests": 8, "cpu_ms_per_request": 1.0},
        ],
    ]
    rows = mean_rows(runs)
    assert [row["cpu_ms_per_request"] for row in rows] == [3.0, 2.0]
    assert [row["turn"] for row in rows] == [1, 2]
