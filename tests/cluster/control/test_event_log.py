"""The controller's and the autoscaler's event logs stay bounded however long the service runs:
the newest EVENT_LOG_SIZE entries are kept, in order, and readers still slice them."""

from __future__ import annotations

import pytest

from splitserve.cluster.bounded_log import BoundedLog
from splitserve.cluster.config import ServeConfig
from splitserve.cluster.control.controller import EVENT_LOG_SIZE, Controller
from splitserve.cluster.control.replica_health import PoolEvent
from splitserve.cluster.routing.replica_pools import DECODE
from splitserve.cluster.scaling import autoscaler
from tests.cluster.scaling.test_cluster_view import FakeCluster


def test_the_controller_keeps_only_its_newest_events():
    controller = Controller(ServeConfig(), "/no/model/needed", "event-log-test", autoscale=False)  # no Ray here
    total = 3 * EVENT_LOG_SIZE + 7
    for i in range(total):
        controller.events.append(PoolEvent(float(i), DECODE, f"decode-{i}", "started"))
    assert len(controller.events) == EVENT_LOG_SIZE
    assert [e.at for e in controller.events] == [float(i) for i in range(total - EVENT_LOG_SIZE, total)]
    controller.events.append(PoolEvent(float(total), DECODE, "decode-new", "lost"))
    # at the bound the oldest entry goes: the newest is last, the length stays
    assert len(controller.events) == EVENT_LOG_SIZE and controller.events[-1].replica_id == "decode-new"
    assert controller.events[0].at == float(total + 1 - EVENT_LOG_SIZE)


def test_the_autoscaler_keeps_only_its_newest_actions():
    scaler = autoscaler.Autoscaler(FakeCluster(), ServeConfig())
    assert isinstance(scaler.events, BoundedLog) and scaler.events.maxlen == autoscaler.EVENT_LOG_SIZE


def test_a_bounded_log_drops_the_oldest_and_refuses_no_bound():
    log: BoundedLog[int] = BoundedLog(3)
    for i in range(5):
        log.append(i)
    assert log == [2, 3, 4] and log[1:] == [3, 4] and list(reversed(log)) == [4, 3, 2]
    with pytest.raises(ValueError, match="maxlen"):
        BoundedLog(0)
