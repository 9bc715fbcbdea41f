"""A chat prompt starts with exactly one BOS, and tool/think markup stays single tokens.

Llama 3, Gemma 2/3, Mistral and Cohere templates write ``{{ bos_token }}`` themselves while
their vocabularies also say "add BOS": :func:`encode_chat` must not put a second one in front
(llama.cpp drops the template's when its tokenizer adds one). Checked with those templates
(tests/data/chat_templates.py) on vocabularies holding each family's markup as control tokens,
on Gemma 3's real SentencePiece vocabulary, and on the registry models' own templates.
"""

from __future__ import annotations

import pytest
from chat_templates import LLAMA31_TOOLS, MISTRAL_TOOLS, WRITES_BOS

from edgerun import registry
from edgerun.formats.gguf import read_gguf
from edgerun.generate.chat_template import encode_chat, render_chat
from edgerun.tokenizer import Tokenizer, tokenizer_from_gguf_metadata
from edgerun.tokenizer.bpe import _byte_decoder

USER_DEFINED = ["<think>", "</think>", "<tool_call>", "</tool_call>"]

# family -> (pre-tokenizer, BOS text, EOS text, the family's other control tokens)
FAMILY_VOCAB = {
    "llama3": (
        "llama-bpe",
        "<|begin_of_text|>",
        "<|end_of_text|>",
        ["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"],
    ),
    "mistral": ("tekken", "<s>", "</s>", ["[INST]", "[/INST]", "[TOOL_CALLS]"]),
    "cohere": (
        "command-r",
        "<BOS_TOKEN>",
        "<|END_OF_TURN_TOKEN|>",
        ["<|START_OF_TURN_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "<|SYSTEM_TOKEN|>"],
    ),
}

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "  And 3+3?  "},
    ],
]


def family_tokenizer(family: str) -> Tokenizer:
    """A byte-level vocabulary with the family's control tokens and the think/tool markup as
    user-defined tokens; the file says add BOS."""
    pre, bos, eos, controls = FAMILY_VOCAB[family]
    byte_chars = sorted(_byte_decoder(), key=lambda c: _byte_decoder()[c])
    specials = [bos, eos, *controls]
    tokens = specials + USER_DEFINED + byte_chars + ["he", "hel", "hell", "hello"]
    types = [3] * len(specials) + [4] * len(USER_DEFINED) + [1] * (len(byte_chars) + 4)
    return tokenizer_from_gguf_metadata(
        {
            "tokenizer.ggml.model": "gpt2",
            "tokenizer.ggml.pre": pre,
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.merges": ["h e", "he l", "hel l", "hell o"],
            "tokenizer.ggml.bos_token_id": 0,
            "tokenizer.ggml.eos_token_id": 1,
            "tokenizer.ggml.add_bos_token": True,
        }
    )


def _registry_tokenizer(name: str) -> Tokenizer:
    path = registry.resolve_path(registry.find(name))
    return tokenizer_from_gguf_metadata(read_gguf(path).metadata)


@pytest.fixture(scope="module")
def gemma() -> Tokenizer:
    return _registry_tokenizer("gemma3-270m")


def _check_one_bos(tok: Tokenizer, template: str, messages: list[dict]) -> list[int]:
    ids = encode_chat(tok, messages, template)
    assert tok.add_bos and ids[0] == tok.bos_id, ids[:4]
    assert ids.count(tok.bos_id) == 1, ids[:6]
    # exactly the template's text, its own BOS included, and nothing added
    text = render_chat(template, messages, True, tok.bos_token, tok.eos_token)
    assert ids == tok.encode(text, add_bos=False)
    assert encode_chat(tok, messages, template, add_bos=True) == ids
    assert encode_chat(tok, messages, template, add_bos=False) == ids
    return ids


@pytest.mark.parametrize("family", ["llama3", "mistral", "cohere"])
@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
def test_template_bos_is_not_doubled(family, case):
    tok = family_tokenizer(family)
    _check_one_bos(tok, WRITES_BOS[family], CONVERSATIONS[case])


@pytest.mark.parametrize("template", ["gemma2", "gemma3"])
@pytest.mark.parametrize("case", range(len(CONVERSATIONS)))
def test_gemma_templates_on_gemma_vocabulary(gemma, template, case):
    ids = _check_one_bos(gemma, WRITES_BOS[template], CONVERSATIONS[case])
    assert ids[1] == gemma.special_texts()["<start_of_turn>"]


def test_bos_is_added_once_when_the_template_has_none(gemma):
    """A template without {{ bos_token }} (ChatML) on a vocabulary that adds BOS: one, first."""
    chatml = (
        "{% for m in messages %}{{ '<start_of_turn>' + m['role'] + '\n' + m['content'] + "
        "'<end_of_turn>\n' }}{% endfor %}"
    )
    ids = encode_chat(gemma, CONVERSATIONS[1], chatml)
    assert ids[0] == gemma.bos_id and ids.count(gemma.bos_id) == 1
    assert encode_chat(gemma, CONVERSATIONS[1], chatml, add_bos=False)[0] != gemma.bos_id


@pytest.mark.parametrize("family", ["llama3", "mistral", "cohere"])
def test_bos_typed_by_the_user_stays_text(family):
    """A user message that starts with the BOS string does not count as the template's BOS:
    the template's BOS is still there, once, and the user's is text."""
    tok = family_tokenizer(family)
    bos_text = tok.bos_token
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # writes no BOS
    ids = encode_chat(tok, [{"role": "user", "content": bos_text + "hi"}], template)
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1
    assert tok.decode(ids[1:]) == bos_text + "hi"


@pytest.mark.parametrize("name", ["smollm2-135m", "qwen2.5-coder-0.5b"])
def test_registry_models_keep_their_bos_rule(name):
    """SmolLM2 and Qwen2.5 add no BOS: their own templates' text is encoded with nothing
    added (SmolLM2's BOS is <|im_start|>, which its template writes first), and a template
    that writes BOS gets exactly that one."""
    try:
        tok = _registry_tokenizer(name)
    except Exception:
        if name == "smollm2-135m":
            raise
        pytest.skip(f"{name} not installed (python -m edgerun pull {name})")
    assert not tok.add_bos and tok.bos_id is not None
    ids = encode_chat(tok, CONVERSATIONS[1])
    text = render_chat(tok.chat_template, CONVERSATIONS[1], True, tok.bos_token, tok.eos_token)
    assert ids == tok.encode(text, add_bos=False)
    ids = encode_chat(tok, CONVERSATIONS[1], WRITES_BOS["llama3"])
    assert ids[0] == tok.bos_id and ids.count(tok.bos_id) == 1


# ------------------------------------------------------------------ tool and think markup


def test_tool_markup_written_by_the_template_is_one_token():
    """[TOOL_CALLS] (Mistral) and <|python_tag|> (Llama 3.1) written by the template from
    ``tool_calls`` are single control tokens; the same strings typed by a user are text."""
    call = {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}
    convo = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    for family, template, marker in (
        ("mistral", MISTRAL_TOOLS, "[TOOL_CALLS]"),
        ("llama3", LLAMA31_TOOLS, "<|python_tag|>"),
    ):
        tok = family_tokenizer(family)
        marker_id = tok.special_texts()[marker]
        ids = encode_chat(tok, convo, template)
        assert ids.count(marker_id) == 1, (family, ids)
        assert ids.count(tok.bos_id) == 1 and ids[0] == tok.bos_id
        typed = encode_chat(tok, [{"role": "user", "content": marker + " x"}], template)
        assert marker_id not in typed
        assert marker in tok.decode(typed)


@pytest.mark.parametrize("family", ["llama3", "mistral", "cohere"])
def test_think_and_tool_call_tags_are_single_tokens(family):
    """<think>, </think>, <tool_call>, </tool_call> (user-defined tokens, as Qwen3 and
    Hermes-style vocabularies have them) are one token each in a conversation's text."""
    tok = family_tokenizer(family)
    ids_of = {t: tok.encode(t, add_bos=False) for t in USER_DEFINED}
    assert all(len(v) == 1 for v in ids_of.values()), ids_of
    answer = '<think>plan</think>ok<tool_call>{"name": "f"}</tool_call>'
    convo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": answer}]
    ids = encode_chat(tok, convo, WRITES_BOS[family])
    for t, (i,) in ids_of.items():
        assert ids.count(i) == 1, (t, ids)


def test_qwen_tool_call_tags_from_its_template():
    """Qwen2.5's own template writes <tool_call> ... </tool_call> for an assistant's
    tool_calls: one token each (user-defined in its vocabulary)."""
    try:
        tok = _registry_tokenizer("qwen2.5-coder-0.5b")
    except Exception:
        pytest.skip("qwen2.5-coder-0.5b not installed")
    open_id = tok.encode("<tool_call>", add_bos=False)
    close_id = tok.encode("</tool_call>", add_bos=False)
    assert len(open_id) == 1 and len(close_id) == 1
    call = {"type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    convo = [
        {"role": "user", "content": "call f"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
    ]
    ids = encode_chat(tok, convo)
    assert ids.count(open_id[0]) == 1 and ids.count(close_id[0]) == 1
