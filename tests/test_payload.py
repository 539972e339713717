"""forkq.payload: building, checking and parsing Sidekiq job payloads (no Redis needed)."""

import json
import math
import re

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import forkq
from forkq import payload
from forkq.errors import MalformedPayload

JID = re.compile(r"\A[0-9a-f]{24}\Z")


def test_new_jid_is_24_lowercase_hex_and_unique():
    jids = {payload.new_jid() for _ in range(2000)}
    assert len(jids) == 2000
    assert all(JID.match(j) for j in jids)


def test_build_has_sidekiq_fields_in_order():
    job = payload.build("Hard", [1, "a"], "mail", 3, now=1700000000.25, backtrace=2)
    assert list(job) == ["class", "args", "jid", "queue", "retry", "created_at", "backtrace"]
    assert job["class"] == "Hard" and job["args"] == [1, "a"]
    assert job["queue"] == "mail" and job["retry"] == 3 and job["backtrace"] == 2
    assert job["created_at"] == 1700000000.25 and type(job["created_at"]) is float
    assert JID.match(job["jid"])


def test_build_defaults():
    job = payload.build("X", [])
    assert job["queue"] == "default"
    assert job["retry"] is True
    assert isinstance(job["created_at"], float)
    assert "enqueued_at" not in job


def test_dumps_is_compact_and_keeps_non_ascii():
    text = payload.dumps({"class": "X", "args": ["żółw", "日本"]})
    assert text == '{"class":"X","args":["żółw","日本"]}'


@pytest.mark.parametrize("args", [
    [], [None, True, False, 0, -1, 2**70, 1.5, "", "s"],
    [[1, [2, [3]]], {"a": {"b": [None]}}],
    ("tuple", "at", "top", "level"),
])
def test_check_args_accepts_json_native(args):
    assert payload.check_args(args) == list(args)


@pytest.mark.parametrize("bad, shown", [
    ({1, 2}, "{1, 2}"),
    (b"bytes", "b'bytes'"),
    (float("nan"), "nan"),
    (float("inf"), "inf"),
    ((1, 2), "(1, 2)"),
    (object, "<class 'object'>"),
    (object(), "<object object at 0x"),
])
def test_check_args_rejects_non_json_values_naming_them(bad, shown):
    with pytest.raises(TypeError) as info:
        payload.check_args(["ok", bad])
    message = str(info.value)
    assert "args[1]" in message
    assert shown in message


def test_check_args_names_the_nested_path():
    with pytest.raises(TypeError, match=r"args\[0\]\['k'\]\[1\] is \(1, 2\)"):
        payload.check_args([{"k": ["fine", (1, 2)]}])


def test_check_args_rejects_non_string_dict_keys():
    with pytest.raises(TypeError, match=r"args\[0\] key 7 is 7"):
        payload.check_args([{"a": 1, 7: "seven"}])


def test_check_args_rejects_bool_like_subclasses_and_non_list_args():
    import enum

    class Color(enum.IntEnum):
        RED = 1

    with pytest.raises(TypeError, match="Color"):
        payload.check_args([Color.RED])
    with pytest.raises(TypeError, match="must be a list or tuple, not dict"):
        payload.check_args({"a": 1})


def test_parse_accepts_a_sidekiq_payload_and_keeps_unknown_fields():
    raw = ('{"retry":2,"queue":"default","backtrace":3,"args":["a"],"class":"FailJob",'
           '"jid":"e3920e13d173f3c9fe3d59b9","created_at":1795347542.1738508,'
           '"enqueued_at":1795347542.1738744,"custom":{"x":[1]}}').encode()
    job = payload.parse(raw)
    assert job["class"] == "FailJob" and job["args"] == ["a"]
    assert job["custom"] == {"x": [1]}


@pytest.mark.parametrize("raw, reason", [
    (b"not json at all", "not JSON"),
    (b'["class", "args"]', "JSON list, not an object"),
    (b'"just a string"', "JSON str, not an object"),
    (b'{"args": []}', "no 'class' string"),
    (b'{"class": "", "args": []}', "no 'class' string"),
    (b'{"class": 5, "args": []}', "no 'class' string"),
    (b'{"class": "X"}', "'args' is missing or not a list"),
    (b'{"class": "X", "args": {"a": 1}}', "'args' is missing or not a list"),
    (b'{"class": "X", "args": ["\xff\xfe"]}', "not valid UTF-8"),
])
def test_parse_rejects_malformed_payloads_with_a_reason(raw, reason):
    with pytest.raises(MalformedPayload, match=re.escape(reason)):
        payload.parse(raw)


def test_malformed_payload_is_a_value_error():
    assert issubclass(MalformedPayload, ValueError)


def test_display_name_uses_wrapped():
    assert payload.display_name({"class": "Wrapper", "wrapped": "RealJob"}) == "RealJob"
    assert payload.display_name({"class": "Plain"}) == "Plain"


def test_seconds_accepts_float_seconds_and_integer_milliseconds():
    assert payload.seconds(1795347542.25) == 1795347542.25
    assert payload.seconds(1795347542250) == 1795347542.25  # Sidekiq 8: integer ms
    assert payload.seconds(1795347542) == 1795347542.0  # whole seconds from a non-Ruby client
    assert payload.seconds("1795347542") is None
    assert payload.seconds(None) is None


def test_backtrace_round_trip_is_base64_zlib_json():
    import base64
    import zlib

    lines = ["a.py:1:in `x'", "b.py:2:in `y'", "ünïcode"]
    blob = payload.encode_backtrace(lines)
    assert json.loads(zlib.decompress(base64.b64decode(blob))) == lines
    assert payload.decode_backtrace(blob) == lines


def test_decode_backtrace_reads_what_ruby_sidekiq_writes():
    # Sidekiq: Base64.encode64(Zlib::Deflate.deflate(Sidekiq.dump_json(lines))), with newlines
    import base64
    import zlib

    lines = ["/app/fail_job.rb:5:in `perform'"] * 20
    ruby_style = base64.encodebytes(zlib.compress(json.dumps(lines).encode())).decode()
    assert "\n" in ruby_style
    assert payload.decode_backtrace(ruby_style) == lines


json_values = st.recursive(
    st.none() | st.booleans() | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(), inner, max_size=4),
    max_leaves=20,
)


@settings(max_examples=100, deadline=None)
@given(st.lists(json_values, max_size=5))
def test_any_json_native_args_survive_build_dumps_parse(args):
    job = payload.build("P", payload.check_args(args))
    back = payload.parse(payload.dumps(job).encode())
    assert back == job


@settings(max_examples=200, deadline=None)
@given(st.lists(json_values, max_size=5))
def test_the_fast_encoder_and_decoder_agree_with_json(args):
    """dumps_new (orjson, json fallback) writes what json.loads reads back equal, and
    _decode reads anything json writes exactly as json.loads does (long integers too)."""
    job = payload.build("P", payload.check_args(args))
    fast = payload.dumps_new(job)
    assert json.loads(fast) == job
    assert payload.parse(fast) == job
    slow = payload.dumps(job)
    assert payload._decode(slow) == json.loads(slow) == job


@pytest.mark.parametrize("raw", [
    b'[123456789012345678901234567890]', b'[-18446744073709551617]', '[9999999999999999999]',
    b'[NaN, Infinity]', b'["\\ud800"]', '{"a":1,"a":2}', "[1]".encode("utf-16"),
])
def test_decode_keeps_json_semantics_where_orjson_differs(raw):
    first = payload._decode(raw)
    expected = json.loads(raw)
    assert repr(first) == repr(expected)  # repr: NaN != NaN, and int vs float matters


@pytest.mark.parametrize("raw", [b'{"a":', b'\xff', b"[" * 5000])
def test_decode_errors_are_json_errors(raw):
    with pytest.raises((ValueError, RecursionError)) as fast:
        payload._decode(raw)
    with pytest.raises((ValueError, RecursionError)) as slow:
        json.loads(raw)
    assert type(fast.value) is type(slow.value)


def test_dumps_new_takes_json_for_what_orjson_refuses():
    assert json.loads(payload.dumps_new({"args": [2**70]})) == {"args": [2**70]}
    with pytest.raises(ValueError):
        payload.dumps({"args": [math.nan]})  # a re-encoded payload must not turn NaN into null


@settings(max_examples=50, deadline=None)
@given(st.lists(json_values, max_size=3), st.sampled_from([
    set(), frozenset(), b"", bytearray(), (), complex(1, 1), math.nan, -math.inf,
]))
def test_a_non_native_value_anywhere_is_refused(args, bad):
    nested = [{"k": [bad]}]
    with pytest.raises(TypeError):
        payload.check_args(args + nested)


@pytest.mark.parametrize("make", ["self", "deep"])
def test_an_argument_that_holds_itself_or_nests_too_deep_is_a_type_error(make, redis_url, r):
    value: list = []
    if make == "self":
        value.append(value)
    else:
        for _ in range(5000):
            value = [value]
    client = forkq.Client(redis_url)
    with pytest.raises(TypeError, match=r"args\[1\] is nested too deeply, or holds itself"):
        client.push("app.Deep", [1, value])
    with pytest.raises(TypeError, match=r"kwargs\['x'\] is nested too deeply"):
        client.push("app.Deep", [], kwargs={"x": value})
    assert r.llen("queue:default") == 0
