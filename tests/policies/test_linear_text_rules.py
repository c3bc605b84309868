"""The text rules are linear and run in bounded pieces, with the old rules' exact results.

Each rewritten rule is compared with its old whole-text regex (``reference_text_rules``) on
small inputs built from the characters that matter to it. The piecewise path that long texts
take is forced with tiny pieces (``textscan.PIECE_CHARS`` and ``WHOLE_MAX`` patched), so that
every kind of cut, and every window that lies inside one long run, is exercised.
"""

from __future__ import annotations

import contextlib
import json
import os

from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from policies import cache_hints, fences, passages, prose, slim, textscan, tokens, volatile
from tests.policies import reference_text_rules as ref

# POLICY_PROPERTY_EXAMPLES=5000 searches harder; the default keeps the suite fast.
EXAMPLES = max(int(os.environ.get("POLICY_PROPERTY_EXAMPLES", "400")), 400)
SETTINGS = settings(
    max_examples=EXAMPLES, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
SIZES = st.sampled_from([4, 5, 7, 16])


def spans(matches) -> list[tuple[int, int, str | None]]:
    return [(match.start(), match.end(), match.lastgroup) for match in matches]


@contextlib.contextmanager
def tiny_pieces(size: int):
    saved = textscan.PIECE_CHARS, textscan.WHOLE_MAX
    textscan.PIECE_CHARS, textscan.WHOLE_MAX = size, 0
    try:
        yield
    finally:
        textscan.PIECE_CHARS, textscan.WHOLE_MAX = saved


def built_from(fragments: list[str], max_size: int = 40) -> st.SearchStrategy[str]:
    return st.lists(st.sampled_from(fragments), max_size=max_size).map("".join)


PROSE = built_from(
    [
        " ",
        "\t",
        "\n",
        "\r",
        "\u200b",
        "a",
        "`",
        " " * 11,
        "\t \t",
        "\n" * 9,
        "\r\n" * 6,
        "\r" * 5,
        "\u200b" * 9,
        " \n" * 4,
        " \r\n",
        "\r\r\n",
        "\n\u200b\n",
    ]
)
FENCED = built_from(
    [
        "```",
        "~~~",
        "````",
        "``",
        "`",
        " ",
        "   ",
        "\t",
        "\n",
        "\r",
        "\r\n",
        "\x0b",
        "\x0c",
        "\x85",
        "\u2028",
        "\u200b",
        "json",
        "py",
        "a",
        "\n" * 6,
        "\n\u200b```",
        "\n \u200b ~~~\n",
        "\n    ```\n",
        "\n   ````  \n",
        "\n\t```\n",
    ]
)
VOLATILE = built_from(
    [
        "1",
        "12",
        "2024",
        "-",
        ":",
        ".",
        "+",
        " ",
        ",",
        "T",
        "Z",
        "a",
        "f",
        "g",
        "deadbeef",
        "Jan",
        "Sept",
        "May",
        "\n",
        "_",
        "\u0663",
        "\u00e9",  # a word character outside ASCII: no boundary before a value after it
        "2024-01-05",
        "10:00:01",
        "-05:00",
        "3f2a8c1e-77b4-4c1d-9a0e-5b6c7d8e9f00",
        "x1 ",
        "Jan 5, 2024",
        "cafe12345678",
        "-12 1",
        ", 2",
        "2024-01-05 10:00:00",
        "1999-12-31 23:59",
        "Sept. 12, 2023",
        "Mar 3, 2020",
        "aaaa",
        "1111",
        "10:00:00.5-05:00",
        "23:59:59.123+0100",
        "T10:00",
        "Z1",
        "T",
        "Z",
        "1.",
        ".1",
        "a.",
        "+1",
        "-1",
        "1:",
        ":1",
    ],
    max_size=30,
)
PASSAGES = built_from(
    [
        "<passage",
        "<passage>",
        "<passagex",
        ' id="1"',
        ">",
        "</passage>",
        "</passage",
        "alpha",
        "beta",
        " ",
        "\n",
        "(same as above)",
    ],
    max_size=25,
)
TOKENS = built_from(
    [
        "a",
        "b",
        "Z",
        " ",
        "  ",
        "\n",
        "\n\n",
        " \n",
        "\t",
        "1",
        "23",
        "456",
        "'s",
        "'ll",
        "!",
        "?!",
        "\u4e2d",
        "\u00e9",
        "\r\n",
        "x y",
        "\u00a0",
        "_",
    ],
    max_size=40,
)


@SETTINGS
@given(text=st.text(alphabet=" \t\n\r\u200ba`", max_size=40))
def test_line_rules_match_the_old_regexes(text):
    assert prose._TRAILING_SPACE.sub("", text) == ref.TRAILING_SPACE.sub("", text)
    assert prose._BLANK_RUN.sub(prose._collapse, text) == ref.BLANK_RUN.sub(prose._collapse, text)


@SETTINGS
@given(text=PROSE, size=SIZES)
def test_slim_prose_whole_and_in_pieces_matches_the_old_rules(text, size):
    expected = ref.slim_prose(text)
    assert prose.slim_prose(text) == expected
    with tiny_pieces(size):
        assert prose.slim_prose(text) == expected


@SETTINGS
@given(text=FENCED, size=SIZES)
def test_fence_split_in_line_chunks_matches_the_old_split(text, size):
    expected = [tuple(segment) for segment in ref.split_fences(text)]
    assert [tuple(segment) for segment in fences.split_fences(text)] == expected
    assert fences.outer_lines(text) == ref.outer_lines(text)
    with tiny_pieces(size):
        assert [tuple(segment) for segment in fences.split_fences(text)] == expected
        assert fences.outer_lines(text) == ref.outer_lines(text)


@SETTINGS
@example(text="2024-01-05 10:00:00 x", size=4).via("a timestamp's space")
@example(text="Sept. 12, 2023 x", size=4).via("a written date's spaces")
@given(text=VOLATILE, size=SIZES)
def test_volatile_values_whole_and_in_pieces_match_the_old_regex(text, size):
    expected = ref.volatile_matches(text)
    assert spans(volatile._VOLATILE.finditer(text)) == expected
    assert spans(volatile._matches(text)) == expected  # the ASCII pattern where text is ASCII
    with tiny_pieces(size):
        assert spans(volatile._matches(text)) == expected


@SETTINGS
@given(texts=st.lists(PASSAGES, min_size=1, max_size=3))
def test_passages_are_found_sorted_and_deduplicated_as_before(texts):
    for text in texts:
        found = [tuple(passage) for passage in passages.find_passages(text)]
        assert found == [(m.start(), m.end(), *m.groups()) for m in ref.PASSAGE.finditer(text)]
        assert passages.sort_passage_runs(text) == ref.sort_passage_runs(text)
        assert cache_hints._without_passage_bodies(text) == ref.without_passage_bodies(text)
    dedupe = passages.passage_deduper()
    assert [dedupe(text) for text in texts] == ref.dedupe_passages(texts)


json_values = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False),
        st.text(alphabet='a "\\\t\n\u00e9{}[],:', max_size=6),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=4),
        st.dictionaries(st.text(alphabet='ab "\\', max_size=3), inner, max_size=4),
    ),
    max_leaves=12,
)


@SETTINGS
@given(
    value=json_values,
    indent=st.sampled_from([None, 0, 2, "\t", " \n "]),
    noise=st.text(alphabet='"\\ \t\n\ra{', max_size=20),
)
def test_json_whitespace_rule_matches_the_old_regex(value, indent, noise):
    document = json.dumps(value, indent=indent, ensure_ascii=False)
    for text in (document, noise):
        minified = slim._JSON_WHITESPACE.sub(lambda m: m.group(1) or "", text)
        assert minified == ref.minify_json_body(text)


@SETTINGS
@given(text=TOKENS, size=SIZES)
def test_token_pieces_are_cut_where_the_count_stays_exact(text, size):
    whole = len(tokens._get_encoding().encode_ordinary(text))
    with tiny_pieces(size):
        exact = textscan.pieces(text, tokens._TOKEN_CUT)
        forced = tokens.token_pieces(text)
    assert "".join(exact) == text and "".join(forced) == text
    assert sum(len(tokens._get_encoding().encode_ordinary(piece)) for piece in exact) == whole


def test_long_texts_take_the_piecewise_path_with_the_same_result():
    words = "Refunds take 5 days.  \n\n\n\n\nSee 2024-01-05T10:00:00Z \u200bor 12:30:45. " * 3000
    assert textscan.is_long(words)
    assert prose.slim_prose(words) == ref.slim_prose(words)
    assert spans(volatile._matches(words)) == ref.volatile_matches(words)
    assert tokens.count_text(words) == len(tokens._get_encoding().encode_ordinary(words))


def test_minify_leaves_json_nested_past_the_parser_limit_alone():
    deep = "[" * 100_000 + "]" * 100_000
    assert slim.minify_json_text(deep) == deep


def test_a_word_character_outside_ascii_still_hides_a_value_behind_it():
    """An ASCII text is scanned with the ASCII pattern; any other keeps Unicode's word
    boundaries, where "é" is a letter: no value starts right after it."""
    assert [m.group(0) for m in volatile._matches("at 2024-01-05 x")] == ["2024-01-05"]
    assert list(volatile._matches("\u00e92024-01-05 x")) == []
    assert [m.group(0) for m in volatile._matches("\u20142024-01-05 x")] == ["2024-01-05"]
