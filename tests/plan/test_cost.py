"""The planner's queue: ties spread, FIFO waits, the largest load meeting the SLA."""

import numpy as np
import pytest

from kvstore.plan.cost import instance_links, max_load_at_sla, queue_ttft_s, spread_ties
from kvstore.plan.options import PlanOptions


def test_requests_logged_at_one_timestamp_spread_to_the_next():
    assert spread_ties(np.array([0.0, 0.0, 0.0, 3.0])).tolist() == [0.0, 1.0, 2.0, 3.0]


def test_a_fifo_queue_makes_the_second_of_two_requests_wait():
    assert queue_ttft_s(np.array([0.0, 0.0, 5.0]), np.array([1.0, 1.0, 1.0])).tolist() == [
        1.0,
        2.0,
        1.0,
    ]


def test_the_load_at_the_sla_is_the_largest_that_meets_it():
    arrivals = np.arange(100, dtype=float)  # one a second
    service = np.full(100, 0.5)
    speedup, ttft = max_load_at_sla(arrivals, service, sla_s=1.0, quantile=0.9)
    assert speedup == pytest.approx(2.0, rel=0.02)  # one every ~0.5 s: utilisation 1, no wait
    assert np.quantile(ttft, 0.9) <= 1.0
    assert max_load_at_sla(arrivals, service, sla_s=0.4, quantile=0.9) == (0.0, None)


def test_more_nodes_put_part_of_every_tier_behind_the_network():
    options = PlanOptions()
    one, four = instance_links(options, 1), instance_links(options, 4)
    assert one["host"].bandwidth_bytes_per_s == options.bandwidths["host"] * options.tp_size
    assert four["host"].bandwidth_bytes_per_s < one["host"].bandwidth_bytes_per_s
    assert one["disk"].bandwidth_bytes_per_s < one["host"].bandwidth_bytes_per_s
