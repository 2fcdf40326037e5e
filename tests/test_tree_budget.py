"""TreeBudget: the tree size with the most tokens per second, found from measured passes."""

from tierflow.speculative.sizing import TreeBudget


def run(budget: TreeBudget, accepted_at, seconds_at, passes: int = 60, timed: bool = True) -> list[int]:
    sizes = []
    for _ in range(passes):
        size = budget.next(timed)
        budget.update(size, accepted_at(size), seconds_at(size))
        sizes.append(size)
    return sizes


def test_a_flat_verify_cost_climbs_to_the_largest_tree():
    sizes = run(TreeBudget(64, start=1), lambda n: min(n, 20) * 0.5, lambda n: 1.0)
    assert sum(size >= 32 for size in sizes[-20:]) >= 15


def test_a_cost_that_grows_with_size_settles_on_a_small_tree():
    sizes = run(TreeBudget(64), lambda n: min(n, 2), lambda n: 0.01 * (3 + n))
    assert max(set(sizes[-20:]), key=sizes[-20:].count) == 2


def test_without_timing_the_size_follows_acceptance_alone():
    good = run(TreeBudget(16, start=4), lambda n: n, lambda n: 0.0, timed=False)
    poor = run(TreeBudget(16, start=4), lambda n: 0, lambda n: 0.0, timed=False)
    assert good[-1] >= 8 and poor[-1] <= 2


def test_where_no_draft_pays_it_settles_on_plain_decoding():
    sizes = run(TreeBudget(64), lambda n: 0, lambda n: 0.01 * (1 + n))
    assert sizes[-20:].count(0) >= 18
