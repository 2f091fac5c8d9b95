"""Client partitions: every example once, the same for the same seed, and the label skew the
Dirichlet concentration asks for, measured on the digits."""

import numpy as np
import pytest

from meshtrain.data.clients import dirichlet_partition, group_skew
from meshtrain.data.images import digits


def _labels():
    return digits()[1]


def test_every_example_goes_to_exactly_one_client():
    labels = _labels()
    seed = int(np.random.default_rng().integers(1 << 30))
    for alpha in (0.1, 1.0, 100.0):
        parts = dirichlet_partition(labels, 8, alpha, seed=seed)
        assert len(parts) == 8 and min(len(p) for p in parts) >= 1
        everything = np.concatenate(parts)
        np.testing.assert_array_equal(np.sort(everything), np.arange(len(labels)))


def test_the_partition_is_a_function_of_its_seed():
    labels = _labels()
    seed = int(np.random.default_rng().integers(1 << 30))
    a = dirichlet_partition(labels, 8, 0.1, seed=seed)
    b = dirichlet_partition(labels, 8, 0.1, seed=seed)
    c = dirichlet_partition(labels, 8, 0.1, seed=seed + 1)
    assert all(np.array_equal(x, y) for x, y in zip(a, b, strict=True))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c, strict=True))


def test_label_skew_follows_the_concentration():
    """Over seeds 0-299 on the digits (10 labels, 8 clients), α = 0.1 skewed at least 0.51,
    α = 1 between 0.25 and 0.43, α = 100 at most 0.047 (total variation to the whole)."""
    labels = _labels()
    seed = int(np.random.default_rng().integers(1 << 30))
    skew = {
        a: group_skew(dirichlet_partition(labels, 8, a, seed=seed), labels) for a in (0.1, 1, 100)
    }
    assert skew[0.1] > 0.45 > skew[1] > 0.2 > 0.08 > skew[100]
    # α = 0.1: most clients hold mostly one or two labels
    parts = dirichlet_partition(labels, 8, 0.1, seed=seed)
    top2 = [np.sort(np.bincount(labels[p], minlength=10))[-2:].sum() / len(p) for p in parts]
    assert np.median(top2) > 0.6
    # a partition into one client is the whole dataset: no skew
    assert group_skew(dirichlet_partition(labels, 1, 0.1, seed=seed), labels) == pytest.approx(0)


@pytest.mark.parametrize(
    ("kw", "needle"),
    [
        ({"clients": 0, "alpha": 1.0}, "clients=0: must be a positive integer"),
        ({"clients": 8, "alpha": 0.0}, "alpha=0.0: the Dirichlet concentration must be > 0"),
        ({"clients": 8, "alpha": 1.0, "min_examples": 300}, "min_examples=300: 8 clients need"),
        ({"clients": 64, "alpha": 0.001, "min_examples": 20}, "alpha=0.001: in 100 draws"),
    ],
)
def test_bad_arguments_are_one_line(kw, needle):
    with pytest.raises(ValueError, match="^" + needle.split(":")[0]) as e:
        dirichlet_partition(_labels(), seed=0, **kw)
    assert needle in str(e.value) and "\n" not in str(e.value)
