"""Per-episode randomness: a row's draws depend on its own generator alone."""

import torch

from hieragent.sampling import draw, episode_generators, episode_seed, rows_of


def _probs(rows, n, seed):
    return torch.softmax(torch.randn(rows, n, generator=torch.Generator().manual_seed(seed)), -1)


def test_a_rows_draws_do_not_depend_on_the_other_rows_of_its_batch():
    keys = [(7, 0), (7, 1), (8, 0)]
    probs = _probs(3, 50, 0)
    alone = [draw(probs[i:i + 1], episode_generators(0, [k])) for i, k in enumerate(keys)]
    together = draw(probs, episode_generators(0, keys))
    assert together.tolist() == [int(a) for a in alone]
    # and in another order, with another neighbour, row (8, 0) draws the same
    again = draw(torch.stack([probs[2], _probs(1, 50, 9)[0]]), episode_generators(0, [keys[2], (99, 3)]))
    assert int(again[0]) == int(together[2])


def test_inactive_rows_do_not_advance_their_stream():
    probs = _probs(2, 30, 1)
    gens = episode_generators(3, [(1, 0), (2, 0)])
    first = draw(probs, gens, active=torch.tensor([True, False]))
    second = draw(probs, gens)
    fresh = episode_generators(3, [(1, 0), (2, 0)])
    assert int(first[1]) == 0  # did not draw
    assert int(second[1]) == int(draw(probs[1:], fresh[1:])[0])  # its first draw comes now
    assert int(first[0]) == int(draw(probs[:1], fresh[:1])[0])


def test_a_shared_stream_draws_as_torch_multinomial_does():
    probs = _probs(4, 20, 2)
    ours = draw(probs, torch.Generator().manual_seed(5))
    theirs = torch.multinomial(probs, 1, generator=torch.Generator().manual_seed(5)).squeeze(-1)
    assert torch.equal(ours, theirs)


def test_seeds_differ_by_key_and_rows_of_picks_the_rows():
    seeds = {episode_seed(0, k, i) for k in range(50) for i in range(4)}
    assert len(seeds) == 200 and all(0 <= s < 2**63 for s in seeds)
    assert episode_seed(0, 1, 2) == episode_seed(0, 1, 2) != episode_seed(1, 1, 2)
    gens = episode_generators(0, [(1,), (2,), (3,)])
    assert rows_of(gens, [2, 0]) == [gens[2], gens[0]]
    shared = torch.Generator()
    assert rows_of(shared, [1]) is shared and rows_of(None, [0]) is None
