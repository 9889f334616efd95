"""The wire codec: every field checked on decode, errors naming the field."""
from __future__ import annotations

import dataclasses

import msgpack
import pytest

from pdd.api import SamplingParams, StepSample
from pdd.protocol import messages as m
from pdd.protocol.codec import ProtocolError, decode, encode


def test_typed_messages_round_trip():
    batch = m.TokenBatch("w", [m.TokenItem("r", 2, 5, [7, 8], True, "length", [[-0.5, [[7, -0.5]]]] * 2, 16)])
    admit = m.Admit("r", 3, [1, 2, 3], SamplingParams(max_tokens=4, seed=2**63 - 1), 1, [2**64 - 1])
    hb = m.Heartbeat("w", 1, 0, 10, 20, faults={"transfer.fail_rate": 0.5},
                     steps=[StepSample(0.5, 40, 2, [38], 741), StepSample(0.01, 3, 3)])
    register = m.Register("w", "prefill", "h", 1, "cuda:0", {}, 10, 8, 4096, step=m.StepLimits(8192, 512, True, 2048))
    for msg in (batch, admit, hb, register):
        assert decode(encode(msg)) == msg


def raw(kind: str, **fields) -> bytes:
    return msgpack.packb({"t": kind, "v": m.PROTOCOL_VERSION, **fields})


ITEM = ["r", 1, 0, [1]]     # request_id, epoch, position, token_ids: a nested dataclass is an array


def item(**changes) -> list:
    fields = dict(zip(("request_id", "epoch", "position", "token_ids"), ITEM)) | changes
    return list(fields.values())


@pytest.mark.parametrize("data,error", [
    (raw("tokens", worker_id="w", items=[ITEM, item(token_ids=[1, "x"])]),
     "tokens.items[1].token_ids: expected list[int], got list"),
    (raw("tokens", worker_id="w", items=[item(epoch=True)]), "tokens.items[0].epoch: expected int, got bool"),
    (raw("tokens", worker_id="w", items=[["r"]]),
     "tokens.items[0]: missing field(s) ['epoch', 'position', 'token_ids']"),
    (raw("tokens", worker_id="w", items=[ITEM + [False, None, None, 0, None, "extra"]]),
     "tokens.items[0]: 10 fields, a TokenItem has 9"),
    (raw("tokens", worker_id="w", items=[3]), "tokens.items[0]: expected a TokenItem array of fields, got int"),
    (raw("tokens", worker_id="w", items=[{"request_id": "r"}]),
     "tokens.items[0]: expected a TokenItem array of fields, got dict"),
    (raw("tokens", worker_id="w", items=5), "tokens.items: expected a list, got int"),
    (raw("tokens", worker_id="w", items=[], extra=1), "tokens: unknown field(s) ['extra']"),
    (raw("heartbeat", worker_id="w", running=1, waiting=0, free_blocks=1, total_blocks=1, faults={"a": "b"}),
     "heartbeat.faults: expected dict[str, float], got dict"),
    (raw("nope"), "unknown message type 'nope'"),
    (b"\xc1", "not a msgpack message"),
])
def test_bad_messages_name_what_is_wrong(data, error):
    with pytest.raises(ProtocolError) as e:
        decode(data)
    assert str(e.value).startswith(error)


@pytest.mark.parametrize("payload,error", [
    ({"t": [1], "v": m.PROTOCOL_VERSION}, "unknown message type [1]"),
    ({"t": {"a": 1}, "v": m.PROTOCOL_VERSION}, "unknown message type {'a': 1}"),
    ({"t": "x" * 10**6, "v": m.PROTOCOL_VERSION}, "unknown message type 'xxxx"),
    ({"t": "goodbye", "v": [m.PROTOCOL_VERSION]}, "protocol version ["),
    ({"t": "goodbye", "v": m.PROTOCOL_VERSION, "worker_id": "w", 1: 2, None: 3}, "goodbye: unknown field(s) [1, None]"),
    ({"t": "goodbye", "v": m.PROTOCOL_VERSION, "worker_id": "w", **{f"f{i}": 0 for i in range(10**5)}},
     "goodbye: unknown field(s) ['f0', 'f1', "),
])
def test_whatever_a_peer_sends_is_one_short_protocol_error(payload, error):
    """A value no message could hold (unhashable, huge, of mixed key types) is
    still a ProtocolError, whose text is a log line, not a copy of the message."""
    with pytest.raises(ProtocolError) as e:
        decode(msgpack.packb(payload))
    assert str(e.value).startswith(error) and len(str(e.value)) < 300, str(e.value)[:300]


def test_generated_and_field_by_field_builders_agree():
    """Each type's generated fast path builds what the checked path builds, and
    leaves a bad map untouched for the checked path's error."""
    from pdd.protocol import codec

    full = ITEM + [True, "stop", [[-0.1, []]], 3]
    fast, checked = codec._builder(m.TokenItem, True), codec._checked_builder(m.TokenItem, True)
    assert fast(list(full)) == checked(list(full)) == m.TokenItem("r", 1, 0, [1], True, "stop", [[-0.1, []]], 3)
    assert fast(list(ITEM)) == m.TokenItem("r", 1, 0, [1])     # a shorter array: the defaults
    sampling = list(codec._as_fields(SamplingParams(max_tokens=3)))   # as msgpack unpacks it
    admit = {"request_id": "r", "epoch": 1, "prompt_token_ids": [1, 2], "sampling": sampling}
    built = codec._builder(m.Admit, False)(dict(admit))
    assert built.sampling == SamplingParams(max_tokens=3)
    bad = {**admit, "prompt_token_ids": [1, None]}
    with pytest.raises(codec._Mismatch) as e:
        codec._builder(m.Admit, False)(bad)
    assert e.value.path == [".prompt_token_ids"] and bad["sampling"] is sampling
    for value in (None, 1.5, True):     # ints only, never a bool
        with pytest.raises(codec._Mismatch):
            fast(item(position=value))


def test_trailing_defaults_stay_off_the_wire_and_come_back():
    """A decode step's item is a token and nothing else: its array stops at the
    last field that is not its default, and every length reads back as sent."""
    from pdd.protocol import codec

    plain = m.TokenItem("r", 1, 4, [9])
    cached = m.TokenItem("r", 1, 0, [9], num_cached_tokens=32)
    zero_not_false = m.TokenItem("r", 1, 0, [9], finished=True, finish_reason="length")
    assert codec._field_values(m.TokenItem)(plain) == ("r", 1, 4, [9])
    assert len(codec._field_values(m.TokenItem)(cached)) == 8
    assert len(codec._field_values(m.TokenItem)(zero_not_false)) == 6
    batch = m.TokenBatch("w", [plain, cached, zero_not_false])
    assert decode(encode(batch)) == batch
    fast, checked = codec._builder(m.TokenItem, True), codec._checked_builder(m.TokenItem, True)
    full = list(codec._field_values(m.TokenItem)(m.TokenItem("r", 1, 0, [9], True, "stop", [[-0.1, []]], 3, [])))
    for length in range(4, len(full) + 1):
        assert fast(full[:length]) == checked(full[:length])
    for short in (full[:3], full + [None], ["r", 1, 0, [None]]):   # too short, too long, a bad token: named
        with pytest.raises(codec._Mismatch):
            fast(list(short))


def test_a_structured_output_travels_inside_sampling_params():
    """SamplingParams.structured_output: None or an array [kind, spec], built
    into a StructuredOutput by the fast path and the checked one alike."""
    from pdd.api import StructuredOutput

    so = StructuredOutput("json_schema", '{"type": "object"}')
    for msg in (m.Admit("r", 1, [1, 2], SamplingParams(structured_output=so, logit_bias={7: -100.0, 3: 2.5})),
                m.Reserve("r", 1, [1, 2], SamplingParams(structured_output=so), 5.0),
                m.Prefill("r", 1, [1, 2], SamplingParams(structured_output=so)),
                m.Admit("r", 1, [1, 2], SamplingParams())):
        assert decode(encode(msg)) == msg
    sampling = msgpack.unpackb(encode(m.Admit("r", 1, [1], SamplingParams(structured_output=so))))["sampling"]
    at = [f.name for f in dataclasses.fields(SamplingParams)].index("structured_output")
    for bad, error in ((["json_schema", 3], "admit.sampling.structured_output.spec: expected str, got int"),
                       ("json", "admit.sampling.structured_output: expected a StructuredOutput array of fields"),
                       ([], "admit.sampling.structured_output: missing field(s) ['kind']")):
        with pytest.raises(ProtocolError) as e:
            decode(raw("admit", request_id="r", epoch=1, prompt_token_ids=[1], sampling=sampling[:at] + [bad] + sampling[at + 1:]))
        assert str(e.value).startswith(error)


def test_an_older_workers_register_and_heartbeat_read_as_first_come_first_served():
    """Fields added later are left out by a worker that predates them: its
    StepLimits array of four fields and a heartbeat without the long prompts'
    counts decode with the defaults, which the router reads as a queue in
    arrival order (long threshold 0)."""
    register = decode(raw("register", worker_id="w", role="prefill", host="h", pid=1, device="cpu", layout={},
                          num_blocks=10, max_num_seqs=8, max_model_len=4096, step=[8192, 512, True, 0]))
    assert register.step == m.StepLimits(8192, 512, True, 0) and register.step.long_threshold == 0
    hb = decode(raw("heartbeat", worker_id="w", running=1, waiting=0, free_blocks=1, total_blocks=1,
                    prefill_tokens_pending=500))
    assert (hb.prefill_tokens_pending, hb.long_prefill_tokens_pending, hb.long_prefills_pending) == (500, 0, 0)


def test_a_worker_registers_its_schedulers_long_prompt_settings():
    from pdd.config import EngineConfig
    limits = m.StepLimits.of(EngineConfig(max_num_batched_tokens=8192, long_prefill_token_threshold=8192,
                                          max_long_partial_prefills=2, long_prefill_min_share=0.5))
    assert (limits.long_threshold, limits.long_partial, limits.long_share) == (8192, 2, 0.5)
    fcfs = EngineConfig(max_num_batched_tokens=8192, long_prefill_token_threshold=None)
    assert m.StepLimits.of(fcfs).long_threshold == 0
    register = m.Register("w", "prefill", "h", 1, "cpu", {}, 10, 8, 4096, step=limits)
    hb = m.Heartbeat("w", 1, 0, 1, 1, prefill_tokens_pending=9000, long_prefill_tokens_pending=8500,
                     long_prefills_pending=1)
    assert decode(encode(register)) == register and decode(encode(hb)) == hb
    bad = raw("heartbeat", worker_id="w", running=1, waiting=0, free_blocks=1, total_blocks=1,
              long_prefills_pending="2")
    with pytest.raises(ProtocolError, match=r"heartbeat.long_prefills_pending: expected int, got str"):
        decode(bad)
