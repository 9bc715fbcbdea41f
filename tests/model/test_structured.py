"""Constrained decoding (generate/constraint.py): the mask's semantics on SmolLM2's real
tokenizer, a handful of JSON Schemas end to end (greedy, sampled, batched: every output
validates), hostile grammars refused in bounded time, and the server's response_format
through the official `openai` client (including its pydantic `parse`)."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

llguidance = pytest.importorskip("llguidance")
jsonschema = pytest.importorskip("jsonschema")

from edgerun.errors import InvalidArgumentError  # noqa: E402
from edgerun.generate.constraint import Constraint, response_format_constraint  # noqa: E402

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "London", "Rome"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}
SCHEMAS = [
    PERSON,
    {
        "type": "object",
        "properties": {
            "tags": {
                "type": "array",
                "items": {"type": "string", "maxLength": 12},
                "minItems": 2,
                "maxItems": 3,
            }
        },
        "required": ["tags"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "id": {"anyOf": [{"type": "integer"}, {"type": "string", "format": "uuid"}]},
            "home": {"$ref": "#/$defs/place"},
        },
        "required": ["id", "home"],
        "additionalProperties": False,
        "$defs": {
            "place": {
                "type": "object",
                "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["zip"],
                "additionalProperties": False,
            }
        },
    },
]


@pytest.fixture(scope="module")
def tok(smollm2):
    return smollm2.tokenizer


def _allowed(matcher, tok) -> set[int]:
    logits = matcher.mask_logits(np.zeros(tok.vocab_size, np.float32), tok.eos_ids)
    return set(np.flatnonzero(np.isfinite(logits)).tolist())


def test_mask_follows_the_grammar_and_allows_eos_only_at_the_end(tok):
    c = Constraint.regex(tok, "(yes|no)!")
    m = c.matcher()
    first = _allowed(m, tok)
    texts = {tok.token_bytes(i) for i in first}
    assert first and all(b"yes!".startswith(t) or b"no!".startswith(t) for t in texts)
    assert not first & tok.eos_ids  # nothing written yet: EOS is not allowed
    for t in tok.encode("yes", add_bos=False, parse_special=False):
        assert t in _allowed(m, tok)
        assert m.advance(t)
    assert not m.accepting and not m.finished
    bang = tok.encode("!", add_bos=False, parse_special=False)
    assert _allowed(m, tok) == set(bang)  # only "!" may follow
    assert m.advance(bang[0])
    assert m.accepting and m.finished


def test_eos_allowed_where_the_grammar_may_end_but_go_on(tok):
    m = Constraint.regex(tok, "[0-9]{1,3}").matcher()
    one = tok.encode("7", add_bos=False, parse_special=False)
    assert m.advance(one[0])
    allowed = _allowed(m, tok)
    assert tok.eos_ids <= allowed  # "7" is complete, "77" would be too
    assert tok.encode("8", add_bos=False, parse_special=False)[0] in allowed


def test_allows_counts_the_draft_prefix_the_grammar_accepts(tok):
    c = Constraint.json_schema(tok, PERSON)
    good = tok.encode('{"name": "Ann", "age": 3', add_bos=False, parse_special=False)
    bad = tok.encode('{"name": "Ann", "aeg": 3', add_bos=False, parse_special=False)
    assert c.allows(good) == len(good)
    cut = c.allows(bad)
    assert 0 < cut < len(bad)
    assert tok.decode(bad[:cut]).startswith('{"name": "Ann", "a')
    m = c.matcher()
    for t in good[:3]:
        m.advance(t)
    assert m.allows(good[3:]) == len(good) - 3  # from the matcher's own position
    assert m.allows(good[3:]) == len(good) - 3  # and it did not move


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda t: Constraint.json_schema(t, "{not json"), "not valid JSON"),
        (lambda t: Constraint.json_schema(t, {"type": "strin"}), "strin"),
        (lambda t: Constraint.json_schema(t, {"$ref": "#/$defs/nope"}), "nope"),
        (lambda t: Constraint.regex(t, "(unclosed"), "unclosed group"),
        (lambda t: Constraint.grammar(t, "start: undefined_rule"), "undefined_rule"),
        (
            lambda t: Constraint.json_schema(
                t,
                {
                    "$ref": "#/$defs/a",
                    "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}},
                },
            ),
            "cycle",
        ),
        (lambda t: Constraint.json_schema(t, {"enum": list(range(100_000))}), "too big"),
        (lambda t: Constraint.json_schema(t, _shared_nesting(300)), "nesting"),
        (lambda t: response_format_constraint(t, {"type": "xml"}), "response_format.type"),
    ],
)
def test_bad_and_exploding_grammars_are_refused_quickly(tok, make, message):
    t0 = time.perf_counter()
    with pytest.raises(InvalidArgumentError, match=message):
        make(tok)
    assert time.perf_counter() - t0 < 10


def _shared_nesting(depth: int) -> dict:
    """A dict whose sub-dicts are shared: its JSON text is 2^depth times larger."""
    node: dict = {"type": "string"}
    for _ in range(depth):
        node = {"anyOf": [node, {"type": "array", "items": node}]}
    return node


def test_gbnf_and_lark_grammars_constrain_generation(smollm2):
    for grammar in ('root ::= "yes" | "no"', 'start: "yes" | "no"'):
        out = "".join(
            smollm2.generate("Is water wet? Answer:", grammar=grammar, temperature=0.9, seed=3)
        )
        assert out in ("yes", "no")
        assert smollm2.stats.finish_reason == "stop"


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "array-bounds", "anyof-ref"])
def test_every_output_validates(smollm2, schema):
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
    msgs = [{"role": "user", "content": "Reply with an example JSON object."}]
    for temperature, seed in ((0.0, None), (1.0, 7)):
        out = smollm2.chat(
            msgs, response_format=fmt, temperature=temperature, seed=seed, max_tokens=120
        )
        assert smollm2.stats.finish_reason == "stop", out
        jsonschema.validate(json.loads(out), schema)


def test_overlapped_masks_are_computed_in_the_background_and_change_nothing(smollm2, monkeypatch):
    from edgerun.generate import constraint

    m = Constraint.json_schema(smollm2.tokenizer, PERSON).matcher(overlap=True)
    first = _allowed(m, smollm2.tokenizer)
    m.advance(smollm2.tokenizer.encode("{", add_bos=False, parse_special=False)[0])
    m._pending.result(timeout=5)  # computed with nobody asking for it
    assert m._pending.done() and first != _allowed(m, smollm2.tokenizer)
    outs = []
    for overlap in (False, True):
        monkeypatch.setattr(constraint, "OVERLAP_MASKS", overlap)
        outs.append("".join(smollm2.generate("A person:", json_schema=PERSON, temperature=0.0)))
        st = smollm2.stats
        assert st.generated_tokens > 5 and st.mask_seconds > 0
        assert (st.mask_wait_seconds > 0) == overlap  # only a worker's mask is waited for
    assert outs[0] == outs[1]
    jsonschema.validate(json.loads(outs[0]), PERSON)


def test_batched_requests_each_follow_their_own_schema(smollm2):
    c1 = Constraint.json_schema(smollm2.tokenizer, SCHEMAS[0])
    c2 = Constraint.json_schema(smollm2.tokenizer, SCHEMAS[1])
    params = smollm2.settings.sampling(5, temperature=0.8)
    ids = smollm2.encode_chat([{"role": "user", "content": "Some JSON please."}])
    reqs = [smollm2.scheduler.submit(ids, params, 120, constraint=c) for c in (c1, c2, c1, None)]
    outs = [r.wait() for r in reqs]
    for out, schema in zip(outs[:3], (SCHEMAS[0], SCHEMAS[1], SCHEMAS[0])):
        jsonschema.validate(json.loads(out), schema)
    assert max(max(r.stats.batch_sizes, default=1) for r in reqs) > 1  # they ran together


# -- the server, through the official openai client ---------------------------------------
openai = pytest.importorskip("openai")
uvicorn = pytest.importorskip("uvicorn")


@pytest.fixture(scope="module")
def server(smollm2):
    from local_server import running

    from edgerun.serve.app import create_app

    with running(create_app(smollm2, max_body_bytes=4 << 20)) as base:
        yield openai.OpenAI(base_url=f"{base}/v1", api_key="x", max_retries=0)


def test_openai_client_response_format_json_schema(server):
    r = server.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}},
        temperature=0.0,
        max_tokens=100,
    )
    jsonschema.validate(json.loads(r.choices[0].message.content), PERSON)
    assert r.choices[0].finish_reason == "stop"


def test_openai_client_parses_a_pydantic_model(server):
    from typing import Literal

    from pydantic import BaseModel, Field

    class City(BaseModel):
        name: str = Field(max_length=20)
        country: Literal["France", "Italy", "Spain"]
        population: int

    r = server.chat.completions.parse(
        model="x",
        messages=[{"role": "user", "content": "Tell me about Paris."}],
        response_format=City,
        temperature=0.0,
        max_tokens=80,
    )
    city = r.choices[0].message.parsed
    assert isinstance(city, City) and city.country in ("France", "Italy", "Spain")


def test_openai_client_streams_json_object_and_completions_take_a_schema(server):
    chunks = server.chat.completions.create(
        model="x",
        messages=[{"role": "user", "content": "Give JSON."}],
        response_format={"type": "json_object"},
        temperature=0.0,
        max_tokens=250,
        stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert isinstance(json.loads(text), dict)
    r = server.completions.create(
        model="x",
        prompt="A number:",
        extra_body={"json_schema": {"type": "integer", "minimum": 0, "maximum": 999}},
        temperature=0.0,
        max_tokens=10,
    )
    assert 0 <= json.loads(r.choices[0].text) <= 999


def test_server_refuses_bad_schemas_with_400(server):
    bad = [
        {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "strin"}}},
        {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"enum": list(range(10**5))}},
        },
        {"type": "xml"},
    ]
    for fmt in bad:
        t0 = time.perf_counter()
        with pytest.raises(openai.BadRequestError):
            server.chat.completions.create(
                model="x", messages=[{"role": "user", "content": "hi"}], response_format=fmt
            )
        assert time.perf_counter() - t0 < 10


def test_a_session_answers_in_its_response_format_and_keeps_the_history(smollm2):
    s = smollm2.session()
    fmt = {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}
    out = s.send("Describe someone as JSON.", response_format=fmt, temperature=0.0, max_tokens=100)
    jsonschema.validate(json.loads(out), PERSON)
    assert s.messages[-1] == {"role": "assistant", "content": out}
    with pytest.raises(InvalidArgumentError):
        s.send("again", response_format={"type": "yaml"})
    assert s.messages[-1]["role"] == "assistant"  # the refused turn left no trace


def test_a_sequence_cuts_a_draft_where_its_grammar_refuses(smollm2):
    from edgerun.generate.sampling import SamplingParams
    from edgerun.generate.sequence import Sequence

    tok = smollm2.tokenizer
    c = Constraint.json_schema(tok, PERSON)
    seq = Sequence(tok, SamplingParams(temperature=0.0), [1], 50, constraint=c)
    free = Sequence(tok, SamplingParams(temperature=0.0), [1], 50)
    draft = tok.encode('{"name": "Bo", "size": 1}', add_bos=False, parse_special=False)
    cut = seq.allowed_draft(draft)
    assert tok.decode(draft[:cut]).startswith('{"name": "Bo", "')
    assert cut < len(draft) and "size" not in tok.decode(draft[:cut])  # no such property
    assert free.allowed_draft(draft) == len(draft)
    # stepping the accepted prefix position by position (a speculative verify) follows it
    for t in draft[:cut]:
        logits = np.full(tok.vocab_size, -10.0, np.float32)
        logits[t] = 10.0
        seq.step(logits)
        assert seq.token == t and not seq.done


def test_without_llguidance_a_constraint_names_the_extra(tok, monkeypatch):
    import sys

    from edgerun.errors import EdgerunError

    monkeypatch.setitem(sys.modules, "llguidance", None)  # import fails as if not installed
    with pytest.raises(EdgerunError, match=r"pip install 'edgerun\[structured\]'"):
        Constraint.json_object(tok)


def test_speculative_drafts_keep_a_constrained_answer_token_for_token(smollm2):
    """n-gram drafts under a JSON schema: the drafted prefix the grammar refuses is cut
    before verification, and the answer equals the one decoded without drafts."""
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": PERSON}}
    first = smollm2.chat(
        [{"role": "user", "content": "Describe a person as JSON."}],
        response_format=fmt,
        temperature=0.0,
        max_tokens=80,
    )
    msgs = [{"role": "user", "content": f"Repeat this JSON exactly: {first}"}]
    outs = []
    for draft in ("none", "ngram"):
        outs.append(
            smollm2.chat(msgs, response_format=fmt, temperature=0.0, max_tokens=80, draft=draft)
        )
        assert smollm2.stats.finish_reason == "stop"
    assert smollm2.stats.draft_tokens > 0 and smollm2.stats.accepted_tokens > 0
    assert outs[0] == outs[1]
    jsonschema.validate(json.loads(outs[1]), PERSON)
