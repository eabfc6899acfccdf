"""The pipeline schedule (pipeline.schedule) as a table: what each stage does at each tick, for GPipe and
for the circular pipeline, written out by hand; and, for a range of meshes, that every item passes every
stage once, in order, one tick apart, and that stage 0 reads a repeat's input only after it was filed."""
import itertools

import numpy as np
import pytest

from pipeline import schedule


def table(n_stages, M, P):
    """{(tick, stage): (micro-batch, repeat, valid, stage 0 files slot (or -), output)}, concrete."""
    rows = {}
    for t, s in itertools.product(range(P * M + n_stages - 1), range(n_stages)):
        plan = schedule(t, s, n_stages, M, P)
        rows[t, s] = (int(plan.micro), int(plan.repeat), bool(plan.valid),
                      int(plan.slot) if bool(plan.file) else "-", bool(plan.output))
    return rows


def test_gpipe_by_hand():
    """pp 2, M 2: stage 1 works one tick behind stage 0 and files both outputs; the last tick of stage 0 and
    the first of stage 1 are bubbles."""
    assert table(2, 2, 1) == {
        (0, 0): (0, 0, True, "-", False), (0, 1): (0, 0, False, "-", False),
        (1, 0): (1, 0, True, "-", False), (1, 1): (0, 0, True, "-", True),
        (2, 0): (1, 0, False, "-", False), (2, 1): (1, 0, True, "-", True)}


def test_circular_by_hand():
    """pp 2, M 2, P 2: repeat 0's outputs go back to stage 0, which files micro-batch m in slot m the tick it
    arrives and runs it through its repeat-1 blocks at once (M = pp: no wait); only repeat 1's outputs are
    filed by the last stage."""
    assert table(2, 2, 2) == {
        (0, 0): (0, 0, True, "-", False), (0, 1): (0, 0, False, "-", False),
        (1, 0): (1, 0, True, "-", False), (1, 1): (0, 0, True, "-", False),
        (2, 0): (0, 1, True, 0, False), (2, 1): (1, 0, True, "-", False),
        (3, 0): (1, 1, True, 1, False), (3, 1): (0, 1, True, "-", True),
        (4, 0): (1, 1, False, "-", False), (4, 1): (1, 1, True, "-", True)}


@pytest.mark.parametrize("n_stages,M,P", [(1, 1, 1), (1, 3, 1), (4, 4, 1), (3, 5, 1), (2, 2, 2), (2, 4, 3),
                                          (4, 4, 2), (3, 7, 2)])
def test_every_item_passes_every_stage_once_in_order(n_stages, M, P):
    rows = table(n_stages, M, P)
    filed_at = {}                                       # micro-batch -> tick stage 0 last filed it
    for s in range(n_stages):
        done = [(r, m) for t in range(P * M + n_stages - 1) for (m, r, valid, _, _) in [rows[t, s]] if valid]
        assert done == [(r, m) for r in range(P) for m in range(M)], s      # each item once, in item order
        assert [t for t in range(P * M + n_stages - 1) if rows[t, s][2]] == list(range(s, s + P * M))
    for t in range(P * M + n_stages - 1):
        m, r, valid, slot, _ = rows[t, 0]
        if slot != "-":
            filed_at[slot] = t
        if valid and r > 0:                             # a later repeat's input, read from the buffer...
            assert filed_at.get(m) is not None and filed_at[m] <= t   # ...after it came back
            assert t - filed_at[m] == M - n_stages                    # and after waiting M - pp ticks
    outputs = sorted(m for t in range(P * M + n_stages - 1) for (m, r, _, _, out) in [rows[t, n_stages - 1]] if out)
    assert outputs == list(range(M))
    assert np.all([not rows[t, s][4] for t, s in rows if s != n_stages - 1])
