"""Every all-reduce cost formula against a hand calculation, and auto's choice.

Links are round numbers (1 GB/s = 1e9 B/s, latencies in us) so each expected value can be checked
on paper; see docs/performance-model.md for the formulas.
"""

import math
from dataclasses import replace

import pytest

from dpscale.lab.predict.cluster import (
    INTER,
    INTRA,
    NVLS_EFFICIENCY,
    Cluster,
    Link,
    MeasuredAllReduce,
    preset_cluster,
)
from dpscale.lab.predict.costs import ALGORITHMS, TREE_BANDWIDTH_FACTOR, all_reduce_cost
from dpscale.lab.predict.nccl_tests import busbw_GBps

A_I, B_I = 2e-6, 100e9  # intra: 2 us per step, 100 GB/s
A_E, B_E = 10e-6, 10e9  # inter: 10 us per step, 10 GB/s
OVH = 5e-6  # per call
N_BYTES = 100e6


def cluster(per_node: int = 8, **kw) -> Cluster:
    return Cluster(
        workers_per_node=per_node,
        intra=Link(name=INTRA, bandwidth_GBps=B_I / 1e9, latency_us=A_I * 1e6),
        inter=Link(name=INTER, bandwidth_GBps=B_E / 1e9, latency_us=A_E * 1e6),
        per_message_overhead_us=OVH * 1e6,
        **kw,
    )


def cost(algorithm: str, p: int, c: Cluster | None = None, n: float = N_BYTES) -> float:
    return all_reduce_cost(n, p, c or cluster(), algorithm).seconds


def test_ring_one_node_is_2_p_minus_1_steps_and_2_p_minus_1_over_p_bytes():
    p = 4
    assert cost("ring", p) == pytest.approx(2 * (p - 1) * A_I + 2 * (p - 1) / p * N_BYTES / B_I + OVH)


def test_ring_across_nodes_pays_inter_latency_per_node_hop_and_the_slowest_bandwidth():
    p, nodes = 16, 2  # 8 per node: 2(N-1) = 2 of the 30 steps cross nodes
    expected = (2 * (p - 1) - 2 * (nodes - 1)) * A_I + 2 * (nodes - 1) * A_E
    expected += 2 * (p - 1) / p * N_BYTES / B_E + OVH
    assert cost("ring", p) == pytest.approx(expected)


def test_tree_is_pipelined_chain_within_and_binary_trees_between_nodes():
    # NCCL's tuning model gives the tree 0.92 of the link's bandwidth (an achieved-bandwidth term)
    t = TREE_BANDWIDTH_FACTOR
    assert cost("tree", 8) == pytest.approx(2 * 7 * A_I + 2 * N_BYTES / B_I / t + OVH)
    # 64 workers on 8 nodes: depth 2((g-1) + log2 N) steps, 2n through the slowest port
    expected = 2 * 7 * A_I + 2 * 3 * A_E + 2 * N_BYTES / B_E / t + OVH
    assert cost("tree", 64) == pytest.approx(expected)
    # two workers: each sends n once
    assert cost("tree", 2) == pytest.approx(2 * A_I + N_BYTES / B_I / t + OVH)
    nominal = cluster(achieved_bandwidth=False)
    assert cost("tree", 2, nominal) == pytest.approx(2 * A_I + N_BYTES / B_I + OVH)


def test_achieved_bandwidth_and_congestion_are_terms_of_their_own():
    c = cluster()
    c = replace(
        c,
        intra=replace(c.intra, efficiency=0.5),
        inter=replace(c.inter, efficiency=0.8, congestion=1.25),
    )
    p, nodes = 16, 2
    cost_ = all_reduce_cost(N_BYTES, p, c, "ring")
    terms = {t.label: t.seconds for t in cost_.terms}
    # the slowest link is the one with the lowest achieved rate: inter at 10 x 0.8 / 1.25 = 6.4 GB/s
    volume = 2 * (p - 1) / p * N_BYTES
    assert terms["inter-node bandwidth"] == pytest.approx(volume / B_E)
    assert terms["inter-node achieved-bandwidth shortfall"] == pytest.approx(
        volume / (0.8 * B_E) - volume / B_E
    )
    assert terms["inter-node congestion"] == pytest.approx(volume / (0.8 * B_E) * 0.25)
    assert cost_.seconds == pytest.approx(
        (2 * (p - 1) - 2 * (nodes - 1)) * A_I + 2 * (nodes - 1) * A_E + volume / (6.4e9) + OVH
    )
    off = all_reduce_cost(N_BYTES, p, replace(c, achieved_bandwidth=False), "ring")
    assert "inter-node achieved-bandwidth shortfall" not in {t.label for t in off.terms}


def test_halving_doubling_power_of_two_and_not():
    p = 8
    assert cost("halving-doubling", p) == pytest.approx(2 * 3 * A_I + 2 * 7 / 8 * N_BYTES / B_I + OVH)
    # p = 6: the 4-worker algorithm plus two full-vector steps for the 2 extra workers
    expected = 2 * 2 * A_I + 2 * 3 / 4 * N_BYTES / B_I + 2 * A_I + 2 * N_BYTES / B_I + OVH
    assert cost("halving-doubling", 6) == pytest.approx(expected)


def test_halving_doubling_across_nodes_sends_n_times_N_minus_1_over_N_through_each_node_port():
    p, g, nodes = 32, 8, 4  # rounds at distance 1, 2, 4 stay inside a node; 8 and 16 cross
    intra = 2 * 3 * A_I + 2 * N_BYTES * (1 / 2 + 1 / 4 + 1 / 8) / B_I
    inter = 2 * 2 * A_E + 2 * g * N_BYTES * (1 / 16 + 1 / 32) / B_E
    assert cost("halving-doubling", p) == pytest.approx(intra + inter + OVH)
    assert 2 * g * N_BYTES * (1 / 16 + 1 / 32) == pytest.approx(2 * N_BYTES * (nodes - 1) / nodes)


def test_hierarchical_is_intra_reduce_scatter_inter_allreduce_intra_allgather():
    p, g, nodes = 32, 8, 4
    expected = 2 * (g - 1) * A_I + 2 * (g - 1) / g * N_BYTES / B_I
    expected += 2 * (nodes - 1) * A_E + 2 * (nodes - 1) / nodes * N_BYTES / B_E + OVH
    assert cost("hierarchical", p) == pytest.approx(expected)


def test_ring_and_halving_doubling_move_the_same_bytes_so_only_latency_differs_on_one_node():
    ring, hd = (
        all_reduce_cost(N_BYTES, 8, cluster(), "ring"),
        all_reduce_cost(N_BYTES, 8, cluster(), "halving-doubling"),
    )
    bw = {c.algorithm: sum(t.seconds for t in c.terms if t.kind == "bandwidth") for c in (ring, hd)}
    assert bw["ring"] == pytest.approx(bw["halving-doubling"])


def test_auto_picks_the_fastest_per_size():
    for n in (8, 1e3, 1e6, 1e9):
        for p in (2, 8, 64, 1024):
            auto = all_reduce_cost(n, p, cluster(), "auto")
            # nvls runs only where the switch reduces (this cluster's does not)
            plain = [a for a in ALGORITHMS if a != "nvls"]
            assert auto.seconds == pytest.approx(min(cost(a, p, n=n) for a in plain))
            assert auto.algorithm in ALGORITHMS
    # small messages at scale: latency decides, a logarithmic algorithm wins; large ones: bandwidth
    assert all_reduce_cost(8, 1024, cluster(), "auto").algorithm in ("tree", "halving-doubling")
    assert cost("ring", 1024, n=8) > 10 * all_reduce_cost(8, 1024, cluster(), "auto").seconds


def test_world_size_one_costs_nothing_and_bad_input_names_the_flag():
    assert all_reduce_cost(N_BYTES, 1, cluster(), "ring").seconds == 0
    with pytest.raises(ValueError, match="--algorithm"):
        all_reduce_cost(N_BYTES, 2, cluster(), "butterfly")
    with pytest.raises(ValueError, match="--world-sizes"):
        all_reduce_cost(N_BYTES, 12, cluster(), "ring")  # 12 does not fill nodes of 8


def test_dominant_term_names_the_bottleneck():
    big = all_reduce_cost(1e9, 64, cluster(), "ring").dominant()
    assert big.label == "inter-node bandwidth"
    tiny = all_reduce_cost(8, 64, cluster(), "ring").dominant()
    assert tiny.label == "latency of 2(n-1) ring steps"


def test_measured_times_replace_the_link_model_and_interpolate_log_log():
    m = MeasuredAllReduce("gloo", 2, (1000, 100_000), (100.0, 1000.0), alpha_us=90.0, beta_GBps=0.1)
    c = cluster(per_node=2, measured={2: m})
    at = lambda n: all_reduce_cost(n, 2, c, "ring")  # noqa: E731
    assert at(1000).seconds == pytest.approx(100e-6)
    assert at(10_000).seconds == pytest.approx(math.sqrt(100 * 1000) * 1e-6)  # geometric midpoint
    assert at(500).seconds == pytest.approx(100e-6)  # below the range: the smallest time
    assert at(200_000).seconds == pytest.approx((1000 + 100_000 / (0.1 * 1e3)) * 1e-6)  # + bytes/beta
    assert at(10_000).algorithm == "measured gloo"
    assert {t.label for t in at(100_000).terms} == {
        "measured gloo all-reduce latency",
        "measured gloo all-reduce bandwidth",
    }


def test_nvls_moves_n_per_port_at_its_achieved_fraction_in_two_steps():
    c = cluster(nvls=True)
    bw = N_BYTES / (B_I * NVLS_EFFICIENCY)
    assert cost("nvls", 8, c) == pytest.approx(2 * A_I + bw + OVH)
    # at nominal rates (--no-achieved-bandwidth) the switch moves n at the line rate
    assert cost("nvls", 8, replace(c, achieved_bandwidth=False)) == pytest.approx(
        2 * A_I + N_BYTES / B_I + OVH
    )


def test_nvls_across_nodes_is_pipelined_with_the_ring_of_nodes_the_slower_phase_counts():
    c = cluster(nvls=True)
    p, nodes = 32, 4
    between = 2 * (nodes - 1) / nodes * N_BYTES / B_E  # slower than the switch's n / (B_I x 0.61)
    assert cost("nvls", p, c) == pytest.approx(2 * A_I + 2 * (nodes - 1) * A_E + between + OVH)


def test_sharp_moves_n_once_per_node_port_in_two_steps():
    p, nodes, g = 32, 4, 8
    plain, sharp = cost("hierarchical", p), cost("hierarchical", p, cluster(sharp=True))
    inside = 2 * (g - 1) * A_I + 2 * (g - 1) / g * N_BYTES / B_I
    assert sharp == pytest.approx(inside + 2 * A_E + N_BYTES / B_E + OVH)
    assert plain == pytest.approx(
        inside + 2 * (nodes - 1) * A_E + 2 * (nodes - 1) / nodes * N_BYTES / B_E + OVH
    )


def test_nvls_is_refused_where_the_switch_does_not_reduce():
    with pytest.raises(ValueError, match="--algorithm nvls"):
        cost("nvls", 8)


def test_h100_and_h200_presets_reach_the_published_nvls_busbw_on_8_gpus():
    # nccl-tests issue #212 (~480 GB/s on 8 x H100) and #272 (475 GB/s on 8 x H200); ring alone ~310
    for name in ("dgx-h100", "dgx-h200"):
        c = preset_cluster(name)
        n = 8 << 30
        auto = all_reduce_cost(n, 8, c)
        assert auto.algorithm == "nvls"
        assert busbw_GBps(n, auto.seconds * 1e6, 8) == pytest.approx(478, abs=10)
        ring = all_reduce_cost(n, 8, replace(c, nvls=False))
        assert busbw_GBps(n, ring.seconds * 1e6, 8) == pytest.approx(310, abs=5)
