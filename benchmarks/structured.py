"""Structured output (generate/constraint.py): schema adherence and speed.

    python benchmarks/structured.py adherence [--model PATH] [--schemas 50] [--free]
    python benchmarks/structured.py speed [--model PATH] [--rounds 3]
    python benchmarks/structured.py batch [--model PATH]

adherence: 50 JSON Schemas of increasing difficulty (flat objects, enums, nested
objects, arrays with minItems/maxItems, anyOf, string formats and patterns, $ref), each
asked for through the chat template, greedy and sampled (temperature 0.8, seed 1), with
response_format json_schema: every output must parse and validate (`jsonschema`,
draft 2020-12's format checker: its default FormatChecker refuses RFC 3339 times). With
--free the same prompts run without the constraint, and the failures are counted (code
fences stripped first, to be fair to the model).

speed: decode tok/s with a JSON schema vs unconstrained, the same prompt, alternating,
medians over --rounds (2 threads). batch: 4 constrained requests through the batching
scheduler at once vs one alone (aggregate decode tok/s, and end to end with prefill).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jsonschema  # noqa: E402

import edgerun  # noqa: E402
from edgerun.generate.constraint import Constraint  # noqa: E402

SMOLLM2 = "smollm2-135m"


def _name(i: int) -> dict:
    return {"type": "string", "minLength": 1, "maxLength": 12 + i % 8}


def schemas() -> list[dict]:
    """50 schemas, easiest first."""
    out: list[dict] = []
    simple = [
        {"type": "integer"},
        {"type": "number"},
        {"type": "boolean"},
        {"type": "string", "maxLength": 16},
    ]
    # 1-10: flat objects of 1-5 typed fields
    for i in range(10):
        n = 1 + i % 5
        props = {f"field_{k}": simple[(i + k) % 4] for k in range(n)}
        out.append(_obj(props))
    # 11-20: enums and nested objects
    for i in range(10):
        color = {"enum": ["red", "green", "blue", "black"][: 2 + i % 3]}
        inner = _obj({"city": _name(i), "zip": {"type": "integer", "minimum": 1000}})
        props = {"name": _name(i), "color": color}
        if i >= 4:
            props["address"] = inner
        if i >= 8:
            props["owner"] = _obj({"name": _name(i), "address": inner})
        out.append(_obj(props))
    # 21-30: arrays with bounds
    for i in range(10):
        lo, hi = i % 3, 2 + i % 3
        items = [simple[i % 4], _name(i), _obj({"id": {"type": "integer"}, "label": _name(i)})][
            i % 3
        ]
        arr = {"type": "array", "items": items, "minItems": lo, "maxItems": hi}
        props = {"items": arr}
        if i >= 5:
            props["matrix"] = {
                "type": "array",
                "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
                "minItems": 1,
                "maxItems": 2,
            }
        out.append(_obj(props))
    # 31-40: anyOf, string formats, patterns
    formats = ["date", "email", "uuid", "date-time", "time"]
    for i in range(10):
        props = {
            "id": {"anyOf": [{"type": "integer"}, {"type": "string", "format": "uuid"}]},
            "when": {"type": "string", "format": formats[i % 5]},
        }
        if i >= 3:
            props["code"] = {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{3}$"}
        if i >= 6:
            props["value"] = {
                "anyOf": [{"type": "null"}, {"type": "number"}, _obj({"unit": _name(i)})]
            }
        out.append(_obj(props))
    # 41-50: $ref
    for i in range(10):
        defs = {
            "person": _obj({"name": _name(i), "age": {"type": "integer", "minimum": 0}}),
            "team": _obj(
                {
                    "lead": {"$ref": "#/$defs/person"},
                    "members": {
                        "type": "array",
                        "items": {"$ref": "#/$defs/person"},
                        "maxItems": 1 + i % 3,
                    },
                }
            ),
        }
        props = {"team": {"$ref": "#/$defs/team"}}
        if i >= 5:
            props["backup"] = {"anyOf": [{"$ref": "#/$defs/person"}, {"type": "null"}]}
        s = _obj(props)
        s["$defs"] = defs
        out.append(s)
    return out


def _obj(props: dict) -> dict:
    return {
        "type": "object",
        "properties": props,
        "required": list(props),
        "additionalProperties": False,
    }


def _messages(schema: dict) -> list[dict]:
    return [
        {
            "role": "user",
            "content": "Reply with only a JSON object, no other text, that matches this JSON "
            f"Schema:\n{json.dumps(schema)}",
        }
    ]


def _valid(text: str, schema: dict) -> bool:
    t = text.strip()
    if t.startswith("```"):
        t = t.strip("`")
        t = t[t.find("\n") + 1 :] if t.startswith("json") else t
    try:
        jsonschema.validate(
            json.loads(t), schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER
        )
        return True
    except (ValueError, jsonschema.ValidationError):
        return False


def adherence(model, n: int, free: bool, max_tokens: int, only: list[int] | None = None) -> None:
    modes = [("greedy", 0.0, None), ("sampled", 0.8, 1)]
    picked = [(i, s) for i, s in enumerate(schemas()[:n]) if not only or i + 1 in only]
    n = len(picked)
    for label, temperature, seed in modes:
        ok = fails = 0
        free_fail = 0
        t0 = time.perf_counter()
        for i, schema in picked:
            fmt = {"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema}}
            out = model.chat(
                _messages(schema),
                response_format=fmt,
                temperature=temperature,
                seed=seed,
                max_tokens=max_tokens,
            )
            good = _valid(out, schema)
            ok += good
            if not good:
                fails += 1
                print(f"  schema {i + 1} {label}: INVALID ({model.stats.finish_reason}) {out!r}")
            if (i + 1) % 10 == 0 and not only:
                print(f"  {label}: {i + 1} schemas, {ok} valid", flush=True)
            if free:
                raw = model.chat(
                    _messages(schema), temperature=temperature, seed=seed, max_tokens=max_tokens
                )
                free_fail += not _valid(raw, schema)
        line = f"{label}: constrained {ok}/{n} valid"
        if free:
            line += f"; unconstrained {n - free_fail}/{n} valid ({free_fail} fail)"
        print(f"{line}  [{time.perf_counter() - t0:.0f} s]", flush=True)


SPEED_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": _obj({"name": {"type": "string"}, "qty": {"type": "integer"}}),
        }
    },
    "required": ["items"],
}
SPEED_PROMPT = [{"role": "user", "content": "Write a long shopping list as JSON."}]


def speed(model, rounds: int, max_tokens: int) -> None:
    """Unconstrained, JSON schema with the mask computed when the logits arrive, and
    with it overlapped on a worker thread: alternating, medians."""
    from edgerun.generate import constraint as cmod
    from edgerun.generate import sequence

    # Sequence.step's own time (mask + sampling + detokenizing): what the constraint adds
    # per token, apart from the forward pass and from other load on the machine.
    step, spent = sequence.Sequence.step, [0.0]

    def timed_step(self, logits):
        t0 = time.perf_counter()
        out = step(self, logits)
        spent[0] += time.perf_counter() - t0
        return out

    sequence.Sequence.step = timed_step
    steps: dict[str, list[float]] = {}
    ids = model.encode_chat(SPEED_PROMPT)
    c = Constraint.json_schema(model.tokenizer, SPEED_SCHEMA)
    kinds = ("free", "json", "json overlapped")
    tps: dict[str, list[float]] = {k: [] for k in kinds}
    mask: dict[str, list[float]] = {k: [] for k in kinds}
    wait: dict[str, list[float]] = {k: [] for k in kinds}
    for _ in range(rounds):
        for kind in kinds:
            cmod.OVERLAP_MASKS = kind == "json overlapped"
            params = model.settings.sampling(1, temperature=0.0)
            spent[0] = 0.0
            it = model.generator.stream(
                ids, params, max_tokens, constraint=None if kind == "free" else c
            )
            "".join(it)
            st = model.stats
            n = max(1, st.generated_tokens)
            tps[kind].append(st.generate_tps)
            mask[kind].append(st.mask_seconds / n * 1e6)
            wait[kind].append(st.mask_wait_seconds / n * 1e6)
            steps.setdefault(kind, []).append(spent[0] / n * 1e6)
    sequence.Sequence.step = step
    med = {k: statistics.median(v) for k, v in tps.items()}
    print(f"decode tok/s, median of {rounds} alternating rounds, {max_tokens} tokens:")
    for k in kinds:
        extra = ""
        if k != "free":
            extra = (
                f" -> {med[k] / med['free']:.2f}x; mask {statistics.median(mask[k]):.0f} us/token"
                f", waited {statistics.median(wait[k]):.0f} us/token"
            )
        extra += f"; Sequence.step {statistics.median(steps[k]):.0f} us/token"
        print(f"  {k:16s} {med[k]:6.1f}{extra}", flush=True)


def batch(model, max_tokens: int, rounds: int) -> None:
    """4 requests through the batching scheduler at once vs one alone, constrained and,
    for reference, unconstrained: alternating, medians. Decode tok/s counts the decode
    steps only (the scheduler's counters: tokens sampled / time in decode steps), as the
    issue's figure is a decode rate; end to end (prompt prefill included, each request
    prefilling its own copy of the prompt) is printed beside it."""
    ids = model.encode_chat(SPEED_PROMPT)
    c = Constraint.json_schema(model.tokenizer, SPEED_SCHEMA)
    counters = model.scheduler.counters

    def run(n: int, constraint) -> tuple[float, float]:
        params = model.settings.sampling(1, temperature=0.0)
        tokens0, seconds0 = counters.decode_tokens, counters.decode_seconds
        t0 = time.perf_counter()
        reqs = [
            model.scheduler.submit(ids, params, max_tokens, constraint=constraint) for _ in range(n)
        ]
        outs = [r.wait() for r in reqs]
        dt = time.perf_counter() - t0
        if constraint is not None:  # complete answers validate (max_tokens may cut one)
            for r, out in zip(reqs, outs):
                if r.stats.finish_reason == "stop":
                    jsonschema.validate(json.loads(out), SPEED_SCHEMA)
        decode = (counters.decode_tokens - tokens0) / (counters.decode_seconds - seconds0)
        return decode, sum(r.stats.generated_tokens for r in reqs) / dt

    run(1, None)  # warm the batch kernels
    got: dict[tuple[str, int], list[tuple[float, float]]] = {}
    for _ in range(rounds):
        for kind, con in (("json schema", c), ("unconstrained", None)):
            for n in (1, 4):
                got.setdefault((kind, n), []).append(run(n, con))
    print(
        f"batching scheduler, {len(ids)}-token prompt, {max_tokens} tokens, "
        f"median of {rounds} alternating rounds, tok/s:"
    )
    for kind in ("json schema", "unconstrained"):
        one, four = (
            [statistics.median(r[i] for r in got[kind, n]) for i in (0, 1)] for n in (1, 4)
        )
        print(
            f"  {kind:14s} decode: 4 batched {four[0]:6.1f} vs one {one[0]:6.1f} -> "
            f"{four[0] / one[0]:.2f}x;  end to end: {four[1]:6.1f} vs {one[1]:6.1f} -> "
            f"{four[1] / one[1]:.2f}x"
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["adherence", "speed", "batch"])
    ap.add_argument("--model", default=SMOLLM2)
    ap.add_argument("--schemas", type=int, default=50)
    ap.add_argument("--free", action="store_true", help="also run without the constraint")
    ap.add_argument("--only", default="", help="adherence: these schemas only (1-based: 32,37)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    path = a.model
    if not os.path.exists(path):
        from edgerun import registry

        path = registry.resolve_path(registry.find(path))
    model = edgerun.load(path, n_ctx=2048, threads=a.threads)
    model.warm_up()
    print(f"# {Path(path).name}, {a.threads} threads, llguidance", flush=True)
    if a.what == "adherence":
        only = [int(x) for x in a.only.split(",") if x.strip()]
        adherence(model, a.schemas, a.free, a.max_tokens, only)
    elif a.what == "speed":
        speed(model, a.rounds, a.max_tokens)
    else:
        batch(model, a.max_tokens, a.rounds)
    model.close()


if __name__ == "__main__":
    main()
