"""Write pre_tokenizer_ids.json: llama.cpp's token ids for the inputs of
tests/reference/test_pre_tokenizers.py, so that test compares edgerun with llama.cpp where
llama-cpp-python is not installed (it is a reference, never a dependency).

Run by hand (not by the tests), from the repository root, with llama-cpp-python installed and
SmolLM2-135M (and, for the Qwen group, qwen2.5-coder-0.5b) pulled:

    PYTHONPATH=$PWD python tests/data/make_pre_tokenizer_ids.py

The JSON holds, per group of pre_tokenizer_cases.GROUPS (a missing model's group is left out,
with a note on stderr):

    <group>/digest    pre_tokenizer_cases.inputs_digest of the vocabulary, strings and settings
    <group>/variants  [[the distinct id lists llama.cpp gave] for each string]
    <group>/pick      {name: [[index into that string's variants for each parse_special
                      setting] for each string]}

(pre_tokenizer_cases.golden_ids reads a name's ids back.)

"chain" covers every name of PRE_TOKENIZERS, the model groups one name per kind.
"""

from __future__ import annotations

import json
import sys
import tempfile
from functools import partial
from pathlib import Path

import llama_cpp
from pre_tokenizer_cases import (
    CHAIN_VOCAB,
    GOLDEN_PATH,
    GROUPS,
    LLAMA_CPP_NAME,
    golden_ids,
    inputs_digest,
    kind_representatives,
    llama_cpp_ids,
    write_vocab_gguf,
)

from edgerun import registry
from edgerun.formats.gguf import read_gguf
from edgerun.tokenizer.bpe import PRE_TOKENIZERS


def _vocab(group: str) -> dict | None:
    if group == "chain":
        return CHAIN_VOCAB
    try:
        path = Path(registry.resolve_path(registry.find(group)))
    except Exception:  # not installed here
        return None
    return dict(read_gguf(path).metadata) if path.exists() else None


def _to_json(out: dict) -> str:
    """The goldens with each string's distinct id lists stored once per group ("variants",
    one string a line) and each name's choice among them ("pick", one name a line): kinds
    mostly agree, and parse_special changes only the strings that spell a control token."""
    lines = ["{", f'"llama_cpp_version": {json.dumps(out["llama_cpp_version"])}']
    for group, body in out.items():
        if group == "llama_cpp_version":
            continue
        names = sorted(body["ids"])
        variants: list[list] = []
        pick: dict[str, list] = {name: [] for name in names}
        for i in range(len(body["ids"][names[0]])):
            seen: list = []
            for name in names:
                row = []
                for ids in body["ids"][name][i]:
                    if ids not in seen:
                        seen.append(ids)
                    row.append(seen.index(ids))
                pick[name].append(row)
            variants.append(seen)
        compact = partial(json.dumps, separators=(",", ":"))
        lines[-1] += ","
        lines.append(f'"{group}": {{"digest": "{body["digest"]}", "variants": [')
        lines.append(",\n".join(map(compact, variants)))
        lines.append('], "pick": {')
        lines.append(",\n".join(f"{json.dumps(n)}: {compact(pick[n])}" for n in names))
        lines.append("}}")
    lines.append("}")
    return "\n".join(lines) + "\n"


def main() -> None:
    out: dict = {"llama_cpp_version": llama_cpp.__version__}
    with tempfile.TemporaryDirectory() as tmp:
        for group, (strings, specials) in GROUPS.items():
            meta = _vocab(group)
            if meta is None:
                print(f"{group}: not installed, left out", file=sys.stderr)
                continue
            names = sorted(PRE_TOKENIZERS if group == "chain" else kind_representatives())
            ids = {}
            for name in names:
                path = write_vocab_gguf(Path(tmp) / "v.gguf", meta, LLAMA_CPP_NAME.get(name, name))
                ids[name] = llama_cpp_ids(llama_cpp, path, strings, specials)
            out[group] = {"digest": inputs_digest(meta, strings, specials), "ids": ids}
            print(f"{group}: {len(names)} names x {len(strings)} strings", file=sys.stderr)
    GOLDEN_PATH.write_text(_to_json(out))
    for group, body in out.items():  # the compact form reads back as recorded
        if group != "llama_cpp_version":
            assert golden_ids(group) == body["ids"], group
    print(f"wrote {GOLDEN_PATH} ({GOLDEN_PATH.stat().st_size} bytes)", file=sys.stderr)


if __name__ == "__main__":
    main()
