"""benchmarks/drafters.py: per-depth acceptance conditions on the depth each cycle reached."""

from __future__ import annotations

import math

from bench_loader import load_benchmark
from test_traces_helpers import small_cycle, small_manifest

from traces.writer import TraceWriter


def test_category_figures_condition_on_the_reached_depth(tmp_path):
    """A SpecFit-like run whose paths end at verified leaves: alpha_d = accepted(d) / reached(d),
    not what counting every cycle as reaching every drafted depth gives."""
    drafters = load_benchmark("drafters")
    run_dir = tmp_path / "run"
    # (num_accepted, reached_depth) per cycle: request 0 "math", request 1 "qa"
    cycles = {0: [(2, 2), (1, 2), (0, 1)], 1: [(1, 1), (0, 0)]}
    with TraceWriter(run_dir, small_manifest()) as writer:
        for rid, rows in cycles.items():
            generated: list[int] = []
            for i, (acc, reached) in enumerate(rows):
                tokens = list(range(10 + len(generated), 11 + len(generated) + acc))
                writer.add_cycle(
                    small_cycle(
                        rid, i, position=len(generated), context_len=4 + len(generated), num_accepted=acc,
                        num_committed=acc + 1, committed_token_ids=tokens, reached_depth=reached,
                    )
                )  # fmt: skip
                generated += tokens
            writer.add_request(rid, [1, 2, 3, 4], generated, "t", category=["math", "qa"][rid])
    figures = drafters.category_figures(run_dir, depth=3)
    assert set(figures) == {"math", "qa", "all"}
    # all: depth 1 reached by 4 cycles (not the root-only one), accepted by 3; depth 2 reached by
    # the 2 of those 3 whose accepted node had a verified child, accepted by 1; depth 3 never.
    alphas = figures["all"]["accept_depth"]
    assert alphas[:2] == [3 / 4, 1 / 2] and math.isnan(alphas[2])
    assert figures["qa"]["accept_depth"][0] == 1.0 and math.isnan(figures["qa"]["accept_depth"][1])
    assert figures["all"]["cycles"] == 5 and figures["all"]["cycles_reach_bounded"] == 0
    assert figures["all"]["tau"] == (3 + 2 + 1 + 2 + 1) / 5
    # every cycle reaching every drafted depth (the former formula) would say 3/5 and 1/3
    accepted = [a for rows in cycles.values() for a, _ in rows]
    assert [sum(a >= d for a in accepted) / sum(a >= d - 1 for a in accepted) for d in (1, 2)] == [3 / 5, 1 / 3]
