import pytest

from policies import (
    DEFAULT_POLICIES,
    POLICY_NAMES,
    PolicyConfigError,
    build_chain,
    parse_options,
    parse_policy_list,
)


def test_policy_list_parsing():
    assert parse_policy_list(None) == DEFAULT_POLICIES
    assert parse_policy_list("slim, canonicalize") == ("slim", "canonicalize")
    assert parse_policy_list("cache_hints,slim") == ("cache_hints", "slim")
    assert parse_policy_list("none") == ()
    assert parse_policy_list("") == ()
    assert parse_policy_list(" NONE ") == ()


@pytest.mark.parametrize("value", ["slim,bogus", "slim,slim", "none,slim"])
def test_policy_list_rejects(value):
    with pytest.raises(PolicyConfigError) as error:
        parse_policy_list(value, source="x-firsttoken-policies")
    assert str(error.value).startswith("x-firsttoken-policies:")


def test_options_parse_and_validate():
    options = parse_options(
        {
            "SLIM_MINIFY_JSON": "true",
            "SLIM_MAX_PROMPT_TOKENS": "8000",
            "CANONICALIZE_SORT_TOOLS": "0",
            "CACHE_HINTS_HEAD_TTL": "1h",
            "LOG_LEVEL": "debug",  # not a policy option: ignored
        }
    )
    assert options.slim.minify_json is True
    assert options.slim.max_prompt_tokens == 8000
    assert options.canonicalize.sort_tools is False
    assert options.cache_hints.head_ttl == "1h"
    assert parse_options({"SLIM_MAX_PROMPT_TOKENS": ""}).slim.max_prompt_tokens is None


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "SLIM_MAX_PROMPT_TOKENS",
            "abc",
            "FIRSTTOKEN_SLIM_MAX_PROMPT_TOKENS: expected a positive integer, got 'abc'",
        ),
        (
            "SLIM_MAX_PROMPT_TOKENS",
            "-5",
            "FIRSTTOKEN_SLIM_MAX_PROMPT_TOKENS: expected a positive integer",
        ),
        (
            "SLIM_MINIFY_JSON",
            "maybe",
            "FIRSTTOKEN_SLIM_MINIFY_JSON: expected true or false, got 'maybe'",
        ),
        (
            "CANONICALIZE_SORT_TOOL",
            "true",
            "FIRSTTOKEN_CANONICALIZE_SORT_TOOL: unknown policy option",
        ),
        ("CACHE_HINTS_HEAD_TTL", "2h", "FIRSTTOKEN_CACHE_HINTS_HEAD_TTL: expected one of 5m, 1h"),
    ],
)
def test_bad_options_name_the_variable(key, value, message):
    with pytest.raises(PolicyConfigError) as error:
        build_chain(DEFAULT_POLICIES, {key: value})
    assert str(error.value).startswith(message)


def test_build_chain_names_and_order():
    chain = build_chain(("cache_hints", "slim"), {})
    assert chain.names == ("cache_hints", "slim")
    assert build_chain((), {}).names == ()
    assert set(POLICY_NAMES) == set(DEFAULT_POLICIES)
    with pytest.raises(PolicyConfigError):
        build_chain(("slim", "nope"), {})
