"""The chunk sweep on its own: exact tilings, gaps, overlaps, and its cost on 100k chunks."""

import time

from mcore_ckpt_fixes.doctor.coverage import check


def test_exact_tilings():
    assert check((8, 4), [((0, 0), (4, 4)), ((4, 0), (4, 4))]) == []
    assert check((8, 4), [((0, 0), (8, 2)), ((0, 2), (4, 2)), ((4, 2), (4, 2))]) == []  # irregular
    assert check((8, 4), [((0, 0), (8, 4)), ((0, 0), (0, 4))]) == []  # an empty local shard
    assert check((), [((), ())]) == []


def test_gaps_overlaps_bounds():
    assert check((8, 4), [((0, 0), (4, 2)), ((0, 2), (4, 2)), ((4, 0), (4, 2))]) == [
        ("gap", "region [4:8, 2:4] is in no chunk")
    ]
    assert check((8, 4), [((0, 0), (4, 4)), ((0, 0), (4, 4)), ((4, 0), (4, 4))]) == [
        ("overlap", "region [0:4, 0:4] is written by 2 chunks")
    ]
    assert check((8, 4), [((0, 0), (8, 2)), ((0, 2), (4, 2)), ((3, 2), (4, 2))])[0] == (
        "overlap",
        "region [3:4, 2:4] is written by more than one chunk",
    )
    assert check((8, 4), [((0, 0), (8, 2)), ((0, 2), (4, 2)), ((5, 2), (3, 2))]) == [
        ("gap", "2 elements of region [0:8, 0:4] are in no chunk")
    ]
    assert check((4,), [((2,), (4,))])[0][0] == "out-of-bounds"


def test_100k_chunk_grid_is_fast():
    chunks = [((i * 4, j * 2), (4, 2)) for i in range(1000) for j in range(100)]
    start = time.perf_counter()
    assert check((4000, 200), chunks) == []
    assert time.perf_counter() - start < 1.0
    chunks[-1] = ((3996, 196), (4, 2))  # moved onto its neighbour
    assert [k for k, _ in check((4000, 200), chunks)] == ["overlap", "gap"]
