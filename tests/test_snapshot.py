"""The snapshot reads what docs/design.md says the controller sees, from the engine's own state."""
from __future__ import annotations

import math

from engine.snapshot import HIST_EDGES, LENGTH_WINDOW_S, OUT_RATIO_WINDOW
from engine.request import Request


def test_snapshot_reports_utilisation_queue_reservation_and_histograms(make_engine):
    eng = make_engine(num_blocks=64, block_size=16, segment_blocks=8, max_num_seqs=2, overcommit=1.5)
    first = eng.snapshot()
    assert first.alloc_ratio == 0 and first.queue_len == 0 and first.frag_entropy == 0
    for i, n in enumerate([9, 20, 150, 300]):
        eng.submit(Request(f"r{i}", 0.0, n, 6, 10))
    eng.step()
    snap = eng.snapshot()
    running = eng.scheduler.running
    assert snap.running == len(running) == 2  # max_num_seqs
    assert snap.queue_len == 2
    assert snap.alloc_ratio == eng.kv.blocks.num_used / 64 > 0
    assert snap.alloc_slope == (snap.alloc_ratio - first.alloc_ratio) / (snap.time_s - first.time_s)
    assert snap.reserved_ratio == sum(s.peak_blocks for s in running) / 64
    assert snap.overcommit == 1.5
    assert math.isclose(sum(snap.queue_hist), 1.0) and math.isclose(sum(snap.running_hist), 1.0)
    assert len(snap.queue_hist) == len(HIST_EDGES) - 1
    assert snap.running_hist[0] == 1.0  # both running contexts are under 128 tokens
    assert snap.queue_hist[1] == snap.queue_hist[2] == 0.5  # waiting: 150 and 300 tokens
    assert 0 < snap.device_free < 1
    assert snap.decode_ms == 0  # the first iteration was all prefill


def test_snapshot_sees_fragmentation_finished_lengths_and_swapped_sequences(make_engine):
    eng = make_engine(num_blocks=32, block_size=4, segment_blocks=8)
    for i, (p, o) in enumerate([(8, 2), (8, 12), (8, 2), (8, 12)]):
        eng.submit(Request(f"r{i}", 0.0, p, o, o))
    while eng.records["r2"].finish_s is None:
        eng.step()
    snap = eng.snapshot()
    assert snap.len_mean == 10 and snap.len_std == 0  # r0 and r2 finished: 8 + 2 tokens each
    assert eng.kv.blocks.holes() > 0 and 0 < snap.frag_entropy <= 1
    assert snap.decode_ms > 0
    eng.evict(1.0)
    assert eng.snapshot().swapped == 2
    eng.compact()
    assert eng.snapshot().frag_entropy == 0


def test_out_ratio_remembers_the_last_finished_requests_however_old(make_engine):
    """out_ratio averages output / declared max_tokens over the last OUT_RATIO_WINDOW finished
    requests: a minute without a finish (long outputs) keeps it, where a time window would fall
    back to 1 and read every running request as one that uses all it declared."""
    eng = make_engine(num_blocks=64, block_size=4, segment_blocks=8)
    assert eng.snapshot().out_ratio == 1.0  # nothing finished yet: the worst case
    eng.submit(Request("r0", 0.0, 8, 2, 8))
    eng.submit(Request("r1", 0.0, 8, 6, 8))
    while eng.has_work():
        eng.step()
    assert eng.snapshot().out_ratio == (2 / 8 + 6 / 8) / 2
    eng.clock += 2 * LENGTH_WINDOW_S  # long after: the lengths' window is empty, the ratio is kept
    snap = eng.snapshot()
    assert snap.len_mean == 0 and snap.out_ratio == 0.5
    for i in range(OUT_RATIO_WINDOW):  # the window holds the last OUT_RATIO_WINDOW requests only
        eng.submit(Request(f"s{i}", eng.clock, 8, 8, 8))
    while eng.has_work():
        eng.step()
    assert eng.snapshot().out_ratio == 1.0
