"""The α-β cost model equals its closed forms, and the algorithms order as the surveys say."""

import math

import numpy as np
import pytest

from meshtrain.costmodel import (
    ALGORITHMS,
    PROFILES,
    CommItem,
    Link,
    collective_time,
    flat_cost,
    hierarchical_all_reduce,
    placement,
    profile,
    step_time,
)

SIZES = {"pipe": 1, "data": 8, "fsdp": 8, "expert": 1, "seq": 1, "tensor": 1}


@pytest.mark.parametrize("p", [2, 8, 64])
def test_all_reduce_costs_equal_their_closed_forms(p):
    rng = np.random.default_rng(p)
    m, alpha, bw = float(rng.uniform(1e3, 1e9)), float(rng.uniform(1e-6, 1e-5)), 1e11
    link, beta, lg = Link(alpha, bw), 1 / bw, math.log2(p)
    assert flat_cost("all-reduce", p, m, link, "ring") == pytest.approx(
        2 * (p - 1) * alpha + 2 * (p - 1) / p * m * beta
    )
    assert flat_cost("all-reduce", p, m, link, "tree") == pytest.approx(2 * lg * (alpha + m * beta))
    assert flat_cost("all-reduce", p, m, link, "recursive-doubling") == pytest.approx(
        lg * (alpha + m * beta)
    )
    assert flat_cost("all-reduce", p, m, link, "rabenseifner") == pytest.approx(
        2 * lg * alpha + 2 * (p - 1) / p * m * beta
    )
    assert flat_cost("all-gather", p, m, link, "ring") == pytest.approx(
        (p - 1) * alpha + (p - 1) / p * m * beta
    )
    assert flat_cost("reduce-scatter", p, m, link, "recursive-doubling") == pytest.approx(
        lg * alpha + (p - 1) / p * m * beta
    )
    assert flat_cost("all-to-all", p, m, link, "ring") == pytest.approx(
        (p - 1) * alpha + (p - 1) / p * m * beta
    )
    assert flat_cost("collective-permute", p, m, link) == pytest.approx(alpha + m * beta)


def test_a_hand_computed_case():
    # 4 devices, 1 MB, α = 10 µs, 1 GB/s: ring = 6·10 µs + 1.5 MB / (1 GB/s) = 1.56 ms;
    # tree = 2·2·(10 µs + 1 ms) = 4.04 ms.
    link = Link(1e-5, 1e9)
    assert flat_cost("all-reduce", 4, 1e6, link, "ring") == pytest.approx(1.56e-3)
    assert flat_cost("all-reduce", 4, 1e6, link, "tree") == pytest.approx(4.04e-3)


def test_ring_beats_tree_for_large_messages_and_tree_beats_ring_for_small_ones():
    link = PROFILES["h100"].intra
    for p in (8, 64):
        assert flat_cost("all-reduce", p, 1e9, link, "ring") < flat_cost(
            "all-reduce", p, 1e9, link, "tree"
        )
        assert flat_cost("all-reduce", p, 1e3, link, "tree") < flat_cost(
            "all-reduce", p, 1e3, link, "ring"
        )


def test_hierarchical_beats_a_flat_ring_across_slow_links():
    h = profile("h100")
    m, g, k = 1e9, 8, 8
    flat = flat_cost("all-reduce", g * k, m, h.inter, "ring")
    two_level = hierarchical_all_reduce(g, k, m, h.intra, h.inter)
    assert two_level < flat
    # its closed form
    want = 2 * ((g - 1) * h.intra.alpha + (g - 1) / g * m * h.intra.beta) + (
        2 * (k - 1) * h.inter.alpha + 2 * (k - 1) / k * (m / g) * h.inter.beta
    )
    assert two_level == pytest.approx(want)
    t, algo = collective_time("all-reduce", ("data", "fsdp"), m, SIZES, h)
    assert algo == "hierarchical" and t == pytest.approx(two_level)


def test_placement_puts_inner_axes_inside_a_node():
    assert placement(("fsdp",), SIZES, 8) == (8, 1)  # fsdp is innermost: one node
    assert placement(("data",), SIZES, 8) == (1, 8)  # data strides across nodes
    assert placement(("data", "fsdp"), SIZES, 8) == (8, 8)


def test_step_time_hides_gathers_behind_compute_but_not_tensor_all_reduces():
    h = profile("h100")
    base = dict(flops=h.peak_flops * 0.1, hbm_bytes=0.0, sizes=SIZES, device=h)
    quiet = step_time(comm=[], **base)
    hidden = step_time(comm=[CommItem("parameter gathers", "all-gather", ("fsdp",), 1e8)], **base)
    exposed = step_time(comm=[CommItem("tensor activations", "all-reduce", ("fsdp",), 1e8)], **base)
    assert hidden.total_s == pytest.approx(quiet.total_s)  # 1e8 B in well under 0.1 s
    assert exposed.total_s > quiet.total_s
    assert exposed.total_s == pytest.approx(quiet.total_s + exposed.comm_s["tensor activations"])
    bubbled = step_time(comm=[], bubble=0.25, **base)
    assert bubbled.total_s == pytest.approx(quiet.total_s / 0.75)


def test_unknown_profile_and_algorithm_are_refused_by_name():
    with pytest.raises(ValueError, match="device='b200'.*h100"):
        profile("b200")
    with pytest.raises(ValueError, match="algorithm='butterfly2'"):
        flat_cost("all-reduce", 8, 1e6, Link(1e-6, 1e9), "butterfly2")
    assert set(ALGORITHMS) == {"ring", "tree", "recursive-doubling", "rabenseifner"}
