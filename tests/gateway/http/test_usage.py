"""`kubellm usage`: the per-tenant table from a gateway's /metrics, its cost arithmetic, and
the command against a live gateway."""

from __future__ import annotations

import pytest
from kubellm.gateway.http.app import create_metrics_app

from kubellm import usage
from kubellm.cli import main
from tests.fixtures.servers import ServerThread
from tests.gateway.conftest import model
from tests.gateway.http.test_tenancy import _stream, chat, declared

TEXT = """\
# TYPE kubellm_gateway_tenant_requests_total counter
kubellm_gateway_tenant_requests_total{tenant="a",target="replica",code="200"} 8
kubellm_gateway_tenant_requests_total{tenant="a",target="fallback",code="200"} 2
kubellm_gateway_tenant_requests_total{tenant="b",target="none",code="429"} 3
# TYPE kubellm_gateway_tenant_tokens_total counter
kubellm_gateway_tenant_tokens_total{tenant="a",target="replica",kind="prompt"} 3000
kubellm_gateway_tenant_tokens_total{tenant="a",target="replica",kind="completion"} 1000
kubellm_gateway_tenant_tokens_total{tenant="a",target="fallback",kind="prompt"} 1500000
kubellm_gateway_tenant_tokens_total{tenant="a",target="fallback",kind="completion"} 500000
kubellm_gateway_tenant_tokens_total{tenant="b",target="replica",kind="prompt"} 12000
kubellm_gateway_tenant_tokens_total{tenant="b",target="replica",kind="completion"} 0
# TYPE kubellm_gateway_tenant_queue_seconds histogram
kubellm_gateway_tenant_queue_seconds_bucket{tenant="a",le="+Inf"} 10
kubellm_gateway_tenant_queue_seconds_sum{tenant="a"} 0.5
kubellm_gateway_tenant_queue_seconds_count{tenant="a"} 10
# TYPE kubellm_gateway_tenant_slo_met_requests_total counter
kubellm_gateway_tenant_slo_met_requests_total{tenant="a"} 9
# TYPE kubellm_gateway_tenant_throttled_total counter
kubellm_gateway_tenant_throttled_total{tenant="b",limit="tokens"} 3
# TYPE kubellm_gateway_tenant_time_to_first_token_seconds histogram
kubellm_gateway_tenant_time_to_first_token_seconds_bucket{tenant="a",le="0.1"} 90
kubellm_gateway_tenant_time_to_first_token_seconds_bucket{tenant="a",le="1.0"} 100
kubellm_gateway_tenant_time_to_first_token_seconds_bucket{tenant="a",le="+Inf"} 100
kubellm_gateway_tenant_time_to_first_token_seconds_sum{tenant="a"} 12
kubellm_gateway_tenant_time_to_first_token_seconds_count{tenant="a"} 100
# TYPE kubellm_gateway_requests_total counter
kubellm_gateway_requests_total{model="m",target="replica",code="200"} 8
"""


def test_rows_and_cost():
    prices = usage.Prices(gpu_hour=2.0, gpus=4, hours=10, api_per_million=0.5)
    a, b = usage.rows(TEXT, prices)
    assert (a.tenant, a.answered, b.refused, b.throttled) == ("a", 10, 3, 3)
    assert a.attainment == pytest.approx(0.9)
    assert a.queue_sum / a.queue_count == pytest.approx(0.05)
    # GPU spend 2 x 4 x 10 = 80, shared by replica tokens 4,000 : 12,000; fallback 2 M x 0.5
    assert a.cost == pytest.approx(80 * 0.25 + 1.0)
    assert b.cost == pytest.approx(80 * 0.75)
    assert usage.rows(TEXT)[0].cost is None  # no prices: no cost
    table = usage.render([a, b])
    assert table.splitlines()[0].split()[:3] == ["tenant", "answered", "refused"]
    assert "90.0%" in table and "21.00" in table
    # TTFT p99 as histogram_quantile reads the buckets: 0.1 + 0.9 x 9/10; b has none
    assert a.ttft_p99 == pytest.approx(0.91) and b.ttft_p99 is None
    header, row_a, row_b = table.splitlines()
    assert header.split()[-3:] == ["ttft", "p99", "s"]
    assert row_a.split()[-1] == "0.910" and row_b.split()[-1] == "-"


def test_kubellm_usage_against_a_gateway(engines, gateway, capsys):
    """Read from the gateway's metrics port; its API port (keys asked) refuses /metrics,
    and the command says where to look."""
    ((engine, server),) = engines(1)
    engine.behaviour.tokens = 5
    gw = gateway({"tiny": model("tiny", [server])}, tenancy=declared())
    metrics_port = ServerThread(create_metrics_app(gw.gateway)).start()
    try:
        assert chat(gw, "chat-app").status_code == 200
        assert _stream(gw, "resident", "x") == 200
        prices = ["--gpu-hour-price", "1", "--hours", "1"]
        assert main(["usage", "--gateway", metrics_port.url, *prices]) == 0
        lines = {line.split()[0]: line.split() for line in capsys.readouterr().out.splitlines()}
        assert set(lines) == {"tenant", "chat-app", "nightly-eval", "resident", "meter"}
        assert lines["chat-app"][1:5] == ["1", "0", "3", "5"]  # answered, refused, in, out
        assert lines["nightly-eval"][1] == "0"
        assert main(["usage", "--gateway", gw.url]) == 1
        assert "--metrics-port" in capsys.readouterr().err
    finally:
        metrics_port.stop()


def test_kubellm_usage_names_a_bad_flag_and_an_unreachable_gateway(capsys):
    assert main(["usage", "--gateway", "http://127.0.0.1:1", "--hours", "0"]) == 2
    assert "--hours" in capsys.readouterr().err
    assert main(["usage", "--gateway", "http://127.0.0.1:1", "--timeout", "2"]) == 1
    assert "127.0.0.1:1/metrics" in capsys.readouterr().err
