"""The operator exports exactly the metric names in src/radixserve/contracts/constants.py.

The dashboard and the alerts use those names.
"""

from prometheus_client.parser import text_string_to_metric_families

from radixserve.contracts import constants
from radixserve.operator.metrics import OperatorMetrics


def test_operator_metric_names_are_the_contract() -> None:
    m = OperatorMetrics()
    m.reconciles.labels(kind="create", result="success").inc()
    m.reconcile_errors.labels(kind="timer", reason="http_500").inc()
    m.reconcile_duration.observe(0.1)
    m.managed.set(1)
    p = constants.OPERATOR_METRIC_PREFIX
    families = {  # the operator's own, not the process metrics (test_metrics_exposition.py)
        f.name: f.type for f in text_string_to_metric_families(m.render().decode()) if f.name.startswith(p)
    }
    expected = {p + n.removesuffix("_total"): "counter" for n in constants.OPERATOR_COUNTERS}
    expected |= {p + n: "gauge" for n in constants.OPERATOR_GAUGES}
    expected |= {p + n: "histogram" for n in constants.OPERATOR_HISTOGRAMS}
    assert families == expected
