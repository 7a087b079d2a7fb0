"""Runs of contiguous pages, narrated: best fit, merging what is given back, tails freed by
shrink, and the eviction windows that open a wide run around a victim."""

import random

from kvstore.tiers.page_runs import PageRuns


def fill(runs: PageRuns, widths: list[int]) -> list[int]:
    return [runs.take(width, f"b{index}") for index, width in enumerate(widths)]


def test_blocks_are_placed_side_by_side_and_a_full_arena_refuses_more():
    runs = PageRuns(10)
    assert fill(runs, [3, 3, 4]) == [0, 3, 6]
    assert runs.free_pages == 0 and runs.widest_free() == 0
    assert runs.take(1, "late") is None


def test_freed_neighbours_merge_into_one_run():
    runs = PageRuns(10)
    starts = fill(runs, [2, 2, 2, 4])
    runs.give_back(starts[0])
    runs.give_back(starts[2])
    assert runs.widest_free() == 2 and runs.free_pages == 4
    runs.give_back(starts[1])  # between two free runs: all three merge
    assert runs.widest_free() == 6
    assert runs.take(6, "wide") == 0


def test_best_fit_keeps_the_wide_run_for_a_wide_block():
    runs = PageRuns(12)
    starts = fill(runs, [1, 1, 6, 1, 3])
    runs.give_back(starts[0])  # a hole of 1 at page 0
    runs.give_back(starts[2])  # a hole of 6 at page 2
    assert runs.take(1, "small") == 0  # the narrowest hole that fits, not the first wide one
    assert runs.take(6, "wide") == 2


def test_fragmented_free_pages_do_not_make_a_wide_run():
    runs = PageRuns(8)
    starts = fill(runs, [1] * 8)
    for start in starts[::2]:
        runs.give_back(start)
    assert runs.free_pages == 4 and runs.widest_free() == 1
    assert runs.take(2, "two") is None


def test_shrink_frees_the_tail_and_merges_it():
    runs = PageRuns(10)
    first = runs.take(6, "received")  # room for the largest block, before its size is known
    runs.shrink(first, 2)
    assert runs.free_pages == 8 and runs.widest_free() == 8
    assert runs.held_pages(first) == 2


def test_the_window_around_a_victim_frees_the_fewest_held_pages():
    runs = PageRuns(10)
    # pages: b0(2) b1(1) victim(1) b3(4) b4(2); a run of 4 around the victim: b1 + b0 free 3
    # pages besides the victim, b3 frees 4: the cheaper one goes
    _, _, victim, c, _ = fill(runs, [2, 1, 1, 4, 2])
    assert runs.window(victim, 4, lambda owner: True) == ["b1", "b0"]
    # with a pinned, the only window goes right
    assert runs.window(victim, 4, lambda owner: owner != "b0") == ["b3"]
    # nothing may go: no window
    assert runs.window(victim, 4, lambda owner: False) is None
    # the victim alone is wide enough: no neighbour goes
    assert runs.window(c, 3, lambda owner: True) == []


def test_a_window_counts_free_pages_next_to_the_victim():
    runs = PageRuns(10)
    _, victim, b, _ = fill(runs, [2, 2, 2, 4])
    runs.give_back(b)  # 2 free pages right of the victim
    assert runs.window(victim, 4, lambda owner: True) == []


def test_many_sizes_interleaved_keep_the_books_exact():
    """Random takes, shrinks and gives of many widths: free and held pages always tile the
    arena, no two free runs touch, and the widest free run is the true one."""
    rng = random.Random(7)
    runs = PageRuns(500)
    held: dict[int, int] = {}
    for step in range(3000):
        if held and rng.random() < 0.45:
            start = rng.choice(list(held))
            if rng.random() < 0.2 and held[start] > 1:
                held[start] = rng.randint(1, held[start])
                runs.shrink(start, held[start])
            else:
                runs.give_back(start)
                del held[start]
        else:
            width = rng.choice([1, 3, 9, 11, 33])
            start = runs.take(width, step)
            if start is not None:
                held[start] = width
        check_tiling(runs, held)


def check_tiling(runs: PageRuns, held: dict[int, int]) -> None:
    used = [False] * runs.capacity_pages
    for start, width in held.items():
        assert not any(used[start : start + width]), "two blocks share a page"
        used[start : start + width] = [True] * width
    assert runs.free_pages == used.count(False)
    widest = longest = 0
    for page_used in used:
        longest = 0 if page_used else longest + 1
        widest = max(widest, longest)
    assert runs.widest_free() == widest
