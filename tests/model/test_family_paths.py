"""Every family beyond llama/qwen2/gemma3 through the paths a model takes: generate and
chat templates, sessions saved and resumed, the batching scheduler, the bound decode
step against the general path, and FFN offloading under a RAM budget (tiny random
models: tiny_families.py; agreement with transformers is tests/reference's)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading

import numpy as np
import pytest
from tiny_families import FAMILIES, family_gguf
from together import send_together

import edgerun
from edgerun.model.kvcache import KVCache
from edgerun.serving.session import Session

GREEDY = dict(temperature=0.0, repeat_penalty=1.0)
PROMPTS = ["the theme of the day", "hello world, this is the test", "x", "thethethe"]


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    d = tmp_path_factory.mktemp("families")
    return {f: family_gguf(d / f"{f}.gguf", f) for f in FAMILIES}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_generate_sessions_and_batches(paths, family, tmp_path):
    m = edgerun.load(paths[family], n_ctx=256, threads=1, kv_type="f16")
    try:
        assert m.spec.arch == family
        # the bound decode step's greedy tokens are the prompt pass's argmaxes
        tr, prompt = m.transformer, m.tokenize(PROMPTS[1])
        cache = KVCache(m.spec, 64, "f32")
        seq = [int(tr.forward(prompt, cache).argmax())]
        for _ in range(5):
            seq.append(int(tr.forward([seq[-1]], cache).argmax()))
        full = tr.forward(prompt + seq[:-1], KVCache(m.spec, 64, "f32"), all_logits=True)
        assert full[len(prompt) - 1 :].argmax(-1).tolist() == seq
        assert "".join(m.generate(prompt, max_tokens=6, **GREEDY)) == m.detokenize(seq)
        # a session saved and resumed continues as the uninterrupted one
        s = m.session()
        s.send("Name three fruits.", max_tokens=10, **GREEDY)
        resumed = Session.load(m, s.save(tmp_path / "chat.safetensors"))
        assert resumed.cache.tokens == s.cache.tokens
        a = s.send("Which one is red?", max_tokens=10, **GREEDY)
        assert resumed.send("Which one is red?", max_tokens=10, **GREEDY) == a
        # sessions decoded together by the scheduler give the sequential answers
        seq = [m.session().send(p, max_tokens=10, **GREEDY) for p in PROMPTS]
        out, most = send_together(m, PROMPTS, max_tokens=10, **GREEDY)
        assert out == seq
        assert most > 1  # they really were decoded together
    finally:
        m.close()


def test_every_family_loads_with_its_switches(paths):
    """The switches each family's metadata sets reach the spec and the layers."""
    specs = {f: edgerun.load(p, n_ctx=64, threads=1).spec for f, p in paths.items()}
    assert specs["llama"].layer_windows == (24,) * 4
    assert specs["smollm3"].layer_nope == (False, False, False, True)
    assert specs["exaone4"].layer_windows == (12, 12, 12, 0)
    assert specs["exaone4"].layer_nope == (False, False, False, True)
    assert not specs["olmo2"].pre_norms and specs["olmo2"].qk_norm_full
    g = specs["granite"]
    assert (g.embed_scale, g.attention_scale, g.residual_scale, g.logit_scale) == (
        12.0,
        np.float32(0.1),
        0.25,
        4.0,
    )
    m = edgerun.load(paths["llama"], n_ctx=64, threads=1)
    assert m.transformer.rope_freq_factors is not None
    assert all(layer.o_bias is not None and layer.q_bias is not None for layer in
               m.transformer.layers)  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_offloaded_under_a_budget_gives_the_resident_tokens(family, tmp_path):
    """Dense offloading under a RAM budget below what holding every FFN row needs: the
    rows are streamed from flash each token, and greedy decoding gives the resident
    model's text (row kernels on both sides: bit for bit). In a fresh process, as the
    budget is the whole process's."""
    path = family_gguf(tmp_path / f"{family}.gguf", family, d_ff=16384)
    prompt = "hello world, this is the test"
    res = edgerun.load(path, n_ctx=128, threads=1, interleave=False)
    want = "".join(res.generate(prompt, max_tokens=12, **GREEDY))
    res.close()
    code = f"""
import json, re, edgerun
from edgerun.api import minimum_ram_budget
from edgerun.errors import BudgetError
path, opts = {str(path)!r}, dict(hold_after_warm_up=False, kv_loan_tiers=0)
need = minimum_ram_budget(path, n_ctx=128)
try:
    m = edgerun.load(path, n_ctx=128, threads=1, offload="dense", ram_budget=int(need * 1.03),
                     offload_options=opts)
except BudgetError as e:  # the floor grew while loading: 3% over the one it names
    need = int(re.search(r"--ram-budget ([0-9]+)M", str(e)).group(1)) << 20
    m = edgerun.load(path, n_ctx=128, threads=1, offload="dense", ram_budget=int(need * 1.03),
                     offload_options=opts)
m.loader.reset_offload_stats()
got = "".join(m.generate({prompt!r}, max_tokens=12, temperature=0.0, repeat_penalty=1.0))
print(json.dumps(dict(got=got, read=m.loader.offload_stats()["bytes_read"],
                      held=m.plan.cache_neurons, d_ff=m.spec.d_ff, file=path)))
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["held"] < out["d_ff"] and out["read"] > 0  # rows really streamed
    assert out["got"] == want


def test_info_shows_each_familys_switches(paths, capsys):
    from edgerun.cli import main

    want = {
        "llama": ["windows:       [24] on layers 0, 1, 2, 3", "rope factors:  rope_freqs (8",
                  "biases:        q/k/v, output", "tied output:   True"],
        "smollm3": ["no RoPE:       layers 3"],
        "granite": ["residual_scale:0.25", "logit_scale:   4.0", "embed_scale:   12.0"],
        "olmo2": ["pre_norms:     False", "qk_norm_full:  True"],
        "exaone4": ["windows:       [12] on layers 0, 1, 2", "no RoPE:       layers 3"],
        "qwen3": ["qk_norm:       True", "rope_style:    neox"],
        "gemma2": ["attn_softcap:  2.0", "windows:       [12] on layers 0, 2",
                   "post_norms:    True"],
        "phi3": ["rope_dim:      8", "fused_tensors: ('attn_qkv', 'ffn_gate_up')",
                 "LongRoPE short / long (long past 16 positions), attention factor 1.2"],
        "glm4": ["fused_tensors: ('attn_qkv', 'ffn_gate_up')", "biases:        q/k/v"],
        "cohere2": ["norm_kind:     layer", "parallel_blocks:True", "no RoPE:       layers 3",
                    "logit_scale:   2.0"],
        "lfm2": ["recurrent:     shortconv on layers 0, 2; state", "qk_norm:       True"],
        "granitehybrid": ["recurrent:     mamba2 on layers 0, 2; state",
                          "no RoPE:       layers 1, 3", "attention_scale:0.125"],
    }  # fmt: skip
    for family, lines in want.items():
        assert main(["info", str(paths[family])]) == 0
        out = capsys.readouterr().out
        assert f"architecture:  {family}" in out
        for line in lines:
            assert line in out, (family, line, out)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_a_pack_of_each_family_gives_the_gguf_logits(paths, family, tmp_path):
    """`edgerun convert` keeps every switch and optional tensor (rope_freqs, biases): the
    pack's spec is the GGUF's and its logits are equal bit for bit (row kernels both)."""
    from edgerun.tools.convert import convert

    out = convert(paths[family], tmp_path / "pack", "keep", progress=False)
    pack = edgerun.load(out, n_ctx=64, threads=1, interleave=False)
    gguf = edgerun.load(paths[family], n_ctx=64, threads=1, interleave=False)
    assert pack.spec == gguf.spec
    ids = gguf.tokenize(PROMPTS[0])
    assert np.array_equal(pack.logits(ids), gguf.logits(ids))


@pytest.mark.parametrize("family", ["llama", "exaone4", "granite"])
def test_the_server_answers_as_the_library(paths, family):
    """The OpenAI-compatible server over HTTP gives the library's chat answer."""
    httpx = pytest.importorskip("httpx")
    uvicorn = pytest.importorskip("uvicorn")
    import socket
    import time

    from edgerun.serve.app import create_app

    model = edgerun.load(paths[family], n_ctx=256, threads=1)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    srv = uvicorn.Server(
        uvicorn.Config(create_app(model), host="127.0.0.1", port=port, log_level="warning")
    )
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    try:
        for _ in range(200):
            if srv.started:
                break
            time.sleep(0.05)
        msgs = [{"role": "user", "content": "the theme of the day"}]
        want = model.chat(msgs, max_tokens=12, **GREEDY)
        body = dict(model="x", messages=msgs, max_tokens=12, **GREEDY)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == want
    finally:
        srv.should_exit = True
        t.join(timeout=10)
        model.close()


@pytest.mark.parametrize(
    "name, values, match",
    [
        ("rope_freqs.weight", np.ones(5), "rope_freqs.weight' should hold 8 RoPE frequency"),
        ("rope_freqs.weight", np.array([1, 2, 0, 4, 5, 6, 7, 8.0]), "rope_freqs.weight"),
        ("rope_freqs.weight", np.array([1, 2, -3, 4, 5, 6, 7, 8.0]), "rope_freqs.weight"),
        ("blk.1.attn_output.bias", np.ones(7), "blk.1.attn_output.bias' should have 64"),
        ("blk.2.attn_k.bias", np.ones(64), "blk.2.attn_k.bias' should have 32"),
    ],
)
def test_hostile_optional_tensors_are_refused_by_name(tmp_path, name, values, match):
    """The optional tensors any family reads (rope_freqs, biases) size kernel loops and
    divide the RoPE frequencies: a wrong length or a divisor <= 0 is a clear error."""
    from edgerun.errors import ModelFormatError

    path = family_gguf(tmp_path / "bad.gguf", "llama", vectors={name: values})
    with pytest.raises(ModelFormatError, match=match):
        edgerun.load(path, n_ctx=64, threads=1)
