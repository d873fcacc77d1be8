"""`/metrics`: Prometheus exposition of request, turn, token, latency and state metrics;
structured JSON logs with request and rollout ids."""

from __future__ import annotations

import io
import json
import logging
import re
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from starlette.testclient import TestClient

from tests.fakes_backend import Reply
from tests.unit.conftest import MakeApp
from turnstile.server.logs import JSONFormatter, make_formatter, redact, request_id_var
from turnstile.server.metrics import route_class

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8}


def scrape(client: TestClient) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    resp = client.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(resp.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_turns_tokens_latency_and_requests_are_counted(make_app: MakeApp) -> None:
    def script(body: dict[str, Any]) -> Reply:
        if body["messages"][0]["content"] == "fail":
            return Reply(status=400)
        return Reply(text="hello")

    h = make_app(script)
    with TestClient(h.app) as client:
        rid = client.post("/rollouts", json={}).json()["rollout_id"]
        assert client.post(f"/rollouts/{rid}/v1/chat/completions", json=CHAT).status_code == 200
        stream = {**CHAT, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=stream) as resp:
            assert resp.status_code == 200
            resp.read()
        bad = {**CHAT, "messages": [{"role": "user", "content": "fail"}]}
        assert client.post("/v1/chat/completions", json=bad).status_code == 400
        assert client.post(f"/rollouts/{rid}/finish").status_code == 200
        m = scrape(client)

    ep = "chat.completions"
    assert value(m, "turnstile_turns_total", endpoint=ep, status="ok") == 2
    assert value(m, "turnstile_turns_total", endpoint=ep, status="error") == 1
    assert value(m, "turnstile_calls_total", endpoint=ep, http_status="400") == 1
    # "hello" + the fake's end-of-text token, twice; the prompt is the rendered messages.
    assert value(m, "turnstile_completion_tokens_total", endpoint=ep) == 12
    assert value(m, "turnstile_prompt_tokens_total", endpoint=ep) >= 2 * len("user\nhi")
    assert value(m, "turnstile_call_duration_seconds_count", endpoint=ep, stream="false") == 2
    assert value(m, "turnstile_call_duration_seconds_count", endpoint=ep, stream="true") == 1
    assert value(m, "turnstile_time_to_first_token_seconds_count", endpoint=ep) == 1
    assert value(m, "turnstile_http_requests_total", route="chat_completions", status="200") == 2
    assert value(m, "turnstile_http_requests_total", route="chat_completions", status="400") == 1
    assert value(m, "turnstile_http_requests_total", route="finish", status="200") == 1
    assert value(m, "turnstile_backend_up") == 1
    assert value(m, "turnstile_turns_received_total") == 3
    assert value(m, "turnstile_journal_healthy") == 1
    assert value(m, "turnstile_recorder_healthy") == 1
    assert ("turnstile_open_rollouts", ()) in m and ("turnstile_recorder_queue_depth", ()) in m
    assert ("turnstile_journal_lag_frames", ()) in m and ("turnstile_writer_lag_turns", ()) in m


def test_open_rollouts_and_breaks_by_kind(make_app: MakeApp) -> None:
    h = make_app()
    with TestClient(h.app) as client:
        rid = client.post("/rollouts", json={}).json()["rollout_id"]
        url = f"/rollouts/{rid}/v1/chat/completions"
        client.post(url, json=CHAT)
        assert value(scrape(client), "turnstile_open_rollouts") == 1
        # A second turn whose history does not extend the first: a stitching break.
        rewritten = {**CHAT, "messages": [{"role": "user", "content": "something else"}]}
        client.post(url, json=rewritten)
        client.post(f"/rollouts/{rid}/finish")
        h.app.state.proxy.recorder.stop(10)  # the seal is stitched on the writer thread
        m = scrape(client)
    assert value(m, "turnstile_open_rollouts") == 0
    assert value(m, "turnstile_stitch_breaks_total", kind="history_rewritten") == 1


def test_backend_down_is_reported(make_app: MakeApp) -> None:
    h = make_app()

    async def refuse(*args: Any, **kwargs: Any) -> Any:
        from turnstile.errors import BackendUnreachable

        raise BackendUnreachable("refused")

    with TestClient(h.app) as client:
        h.backend.request = refuse  # type: ignore[method-assign]
        assert value(scrape(client), "turnstile_backend_up") == 0


def test_route_classes_are_bounded() -> None:
    assert route_class("/rollouts/abc/v1/chat/completions") == "chat_completions"
    assert route_class("/v1/completions") == "completions"
    assert route_class("/rollouts/abc/rewards") == "rewards"
    assert route_class("/rollouts/abc") == "rollouts"
    assert route_class("/v1/models") == "passthrough"
    assert route_class("/admin/policy_version") == "admin"
    assert route_class("/some/random/thing") == "other"


def test_json_logs_carry_request_and_rollout_ids(make_app: MakeApp) -> None:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    handler.setFormatter(JSONFormatter())
    logger = logging.getLogger("turnstile")
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    h = make_app(lambda body: Reply(die_after_events=1))
    try:
        with TestClient(h.app) as client:
            headers = {"X-Request-Id": "req-42", "Authorization": "Bearer sekrit-key"}
            stream_body = {**CHAT, "stream": True}
            with client.stream(
                "POST", "/rollouts/ro-7/v1/chat/completions", json=stream_body, headers=headers
            ) as resp:
                assert resp.headers["x-request-id"] == "req-42"
                resp.read()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    cut = [r for r in lines if "stream of rollout" in r["msg"]]
    assert cut, lines
    assert cut[0]["request_id"] == "req-42" and cut[0]["rollout_id"] == "ro-7"
    assert cut[0]["level"] == "warning" and cut[0]["logger"] == "turnstile.proxy"
    assert "sekrit" not in stream.getvalue()
    assert request_id_var.get() is None  # reset after the request


def test_bad_request_ids_are_replaced_and_bearer_tokens_redacted(make_app: MakeApp) -> None:
    h = make_app()
    with TestClient(h.app) as client:
        resp = client.get("/health", headers={"X-Request-Id": "x\ninjected"})
    assert resp.headers["x-request-id"] != "x\ninjected"
    assert len(resp.headers["x-request-id"]) == 32
    assert redact("got Authorization: Bearer abc.def-123 back") == (
        "got Authorization: Bearer [redacted] back"
    )
    record = logging.LogRecord("t", logging.ERROR, "", 0, "key Bearer s3cr3t", None, None)
    assert "s3cr3t" not in make_formatter("text").format(record)
    assert json.loads(make_formatter("json").format(record))["msg"] == "key Bearer [redacted]"


def test_grafana_dashboard_uses_only_exposed_metrics(make_app: MakeApp) -> None:
    dashboard = Path(__file__).resolve().parents[2] / "configs" / "grafana-dashboard.json"
    panels = json.loads(dashboard.read_text(encoding="utf-8"))["panels"]
    used = {
        name
        for p in panels
        for t in p["targets"]
        for name in re.findall(r"turnstile_\w+", t["expr"])
    }
    h = make_app()
    with TestClient(h.app) as client:
        client.post("/v1/chat/completions", json={**CHAT, "stream": True})
        exposed = {name for name, _ in scrape(client)}
    assert used and used <= exposed, used - exposed
