"""attention_node/body_scan.py: a body read as json.loads reads it, except that a bounded list stops the read one
entry past its bound (json.loads of a 10^6-entry logit_bias took 0.73 s before anything could count
it)."""

from __future__ import annotations

import json

import pytest

from attention_node.body_scan import Over, bounded_loads, first_over

BOUNDS = {"logit_bias": 4, "stop_token_ids": 4, "stop": 3, "messages": 5}

SAME = [
    {},
    {"prompt": "hi", "max_tokens": 1},
    {"prompt": [[1, 2], [3]], "logit_bias": {"1": 1.5, "2": -100}, "stop": ["a", "b"], "stop_token_ids": []},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}] * 2}, {"role": "system"}], "n": 2},
    {"messages": [{}, "not a message", {"content": []}], "x": {"logit_bias": list(range(100))}},  # nested: no bound
    {"prompt": 'quotes " and \\\\ and \\u00e9 and "logit_bias": [1,2,3,4,5,6]', "stop": []},
    {"logit_bias": {"1": 1, "1": 2, "2": 3, "3": 4, "4": 5}},  # noqa: F601 (json.dumps keeps one: 4 distinct)
    [1, 2, 3],
    "a string",
]


@pytest.mark.parametrize("doc", SAME, ids=range(len(SAME)))
def test_within_the_bounds_the_read_is_json_loads(doc):
    for text in (json.dumps(doc), json.dumps(doc, indent=2), json.dumps(doc, separators=(",", ":"))):
        assert bounded_loads(text, BOUNDS, 3) == json.loads(text)


def test_duplicate_keys_keep_the_last_as_json_loads_does():
    text = '{"logit_bias": {"1": 1}, "logit_bias": {"1": 0}, "a": 1, "a": 2}'
    assert bounded_loads(text, BOUNDS, 3) == json.loads(text) == {"logit_bias": {"1": 0}, "a": 2}
    # an object's entries count as its distinct keys, as len() of json.loads' dict does
    same_key = '{"logit_bias": {"7": 1, "7": 2, "7": 3, "7": 4, "7": 5, "7": 6}}'
    assert bounded_loads(same_key, BOUNDS, 3) == {"logit_bias": {"7": 6}}


@pytest.mark.parametrize(
    "text",
    [
        '{"stop": ["a", "b", "c", "d", "e"], "stop": []}',
        '{"stop": ["a", "b", "c", "d", "e"], "st\\u006fp": []}',
        '{"stop": [], "stop": ["a", "b", "c", "d", "e"]}',
    ],
)
def test_a_bounded_key_is_held_to_its_bound_wherever_it_occurs(text):
    """Even where json.loads keeps a later, shorter occurrence: the body carries the long list, and its start is
    judged before the rest arrives."""
    with pytest.raises(Over) as e:
        bounded_loads(text, BOUNDS, 3)
    assert e.value.key == "stop"


def test_first_over_judges_the_start_of_a_body():
    """The Over that bounded_loads raises on the whole body, from any start that reaches it; None from a start
    that does not (a number cut short is still an entry)."""
    text = '{"prompt": "x", "stop_token_ids": [1, 2, 3, 4, 5, 6, 7], "n": 1}'
    with pytest.raises(Over):
        bounded_loads(text, BOUNDS, 3)
    reached = text.index("5,") + 1
    for end in range(len(text) + 1):
        over = first_over(text[:end], BOUNDS, 3)
        assert (over is None) == (end < reached), end
        assert over is None or over.key == "stop_token_ids"
    assert first_over('{"stop_token_ids": [1, 2], "n": 1}', BOUNDS, 3) is None


@pytest.mark.parametrize(
    "text, key",
    [
        ('{"stop_token_ids": [1, 2, 3, 4, 5, ', "stop_token_ids"),
        ('{"prompt": "x", "logit_bias": {"1": 0, "2": 0, "3": 0, "4": 0, "5": 0, ', "logit_bias"),
        ('{"stop": ["a", "b", "c", "d", ', "stop"),
        ('{"messages": [{}, {}, {}, {}, {}, {}, ', "messages"),
        ('{"messages": [{"content": [1, 2]}, {"role": "user", "content": [3, 4, ', "content parts"),
    ],
)
def test_a_list_past_its_bound_stops_the_read_at_the_next_entry(text, key):
    """Each text is cut short after the entry past the bound: the read never got further."""
    with pytest.raises(Over) as e:
        bounded_loads(text, BOUNDS, 3)
    assert e.value.key == key


@pytest.mark.parametrize("text", ['{"a": 1,}', '{"a" 1}', '{"a": [1, 2,]}', "{", '{"a": 1} x', ""])
def test_what_json_loads_refuses_is_a_value_error(text):
    with pytest.raises(ValueError):
        json.loads(text)
    with pytest.raises(ValueError):
        bounded_loads(text, BOUNDS, 3)
