"""The "prompt tokens saved" figure counts what the policies saved on prompts an upstream
took: a request that failed saved nothing, whatever the policies cut from it."""

from __future__ import annotations

import openai
import pytest

from gateway.telemetry.record import RequestRecord
from tests.support.clients import sdk_client
from tests.support.gateway import capture_events, openai_route, wait_for

PADDED = "Answer   briefly.   \n\n\n\n\n\n" * 40  # what `slim` shrinks


@pytest.mark.parametrize("failure", [400, 502])
def test_a_failed_request_saves_no_tokens(mock_upstream, make_gateway, failure):
    gw = make_gateway([openai_route(mock_upstream)], retry_attempts=1)
    events = capture_events(gw)
    client = sdk_client(gw)
    messages = [{"role": "system", "content": PADDED}, {"role": "user", "content": "hi"}]
    client.chat.completions.create(model="gpt-x", messages=messages)
    mock_upstream.mock.behaviour.fail_statuses = [failure]
    with pytest.raises(openai.APIStatusError):
        client.chat.completions.create(model="gpt-x", messages=messages)
    ok, failed = wait_for(events, 2)
    assert ok.status == "ok" and ok.prompt_tokens_saved > 0
    assert failed.status != "ok" and failed.prompt_tokens_saved == 0


def test_the_record_keeps_savings_only_where_the_prompt_was_taken():
    record = RequestRecord(tenant="acme", model="m", stream=True, prompt_tokens_saved=9)
    assert record.to_event().prompt_tokens_saved == 9
    record.status = "client_gone"  # left before any answer: the upstream may never have read it
    assert record.to_event().prompt_tokens_saved == 0
    record.upstream_first_content = record.arrival  # left mid-answer: the prompt was taken
    assert record.to_event().prompt_tokens_saved == 9
    for status in ("client_error", "upstream_error", "timeout"):
        record.status = status
        assert record.to_event().prompt_tokens_saved == 0
