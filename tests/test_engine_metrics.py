"""EngineMetrics sets one attribute per contract metric name; its class annotations (what the type checker trusts)
must name exactly those attributes, with the right metric kind."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

from radixserve.contracts import constants
from radixserve.engine.metrics import EngineMetrics


def test_engine_metrics_annotations_match_the_contract_names() -> None:
    expected = (
        {name: "Gauge" for name in constants.ENGINE_GAUGES}
        | {name: "Counter" for name in constants.ENGINE_COUNTERS}
        | {name: "Histogram" for name in constants.ENGINE_HISTOGRAMS}
    )
    assert EngineMetrics.__annotations__ == expected


def test_engine_metrics_attributes_have_the_annotated_kind() -> None:
    m = EngineMetrics("m")
    kinds = {"Gauge": Gauge, "Counter": Counter, "Histogram": Histogram}
    for name, kind in EngineMetrics.__annotations__.items():
        assert isinstance(getattr(m, name), kinds[kind]), name
