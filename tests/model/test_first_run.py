"""The first run, as a new user meets it: the README's command names Paris with the
default model's recommended settings, flags override them, and the stats are honest.

Real model, fixed seeds, through `edgerun.cli.main` (the code path of the command).
"""

from __future__ import annotations

import os

import pytest

from edgerun import cli, registry
from edgerun.errors import ModelFormatError
from edgerun.generate import engine
from edgerun.generate.settings import ModelSettings

README_PROMPT = "What is the capital of France?"


@pytest.fixture
def sampled(monkeypatch):
    """The SamplingParams each generation ran with."""
    seen = []
    real = engine.Generator.stream

    def spy(self, prompt_ids, params, *args, **kwargs):
        seen.append(params)
        return real(self, prompt_ids, params, *args, **kwargs)

    monkeypatch.setattr(engine.Generator, "stream", spy)
    return seen


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_readme_prompt_names_paris_with_default_settings(seed, capsys, sampled):
    assert cli.main(["generate", README_PROMPT, "--seed", str(seed)]) == 0
    out, err = capsys.readouterr()
    assert "Paris" in out, out
    rec = registry.default_manifest().parameters
    assert sampled[-1] == rec.sampling(seed)  # the manifest's settings, nothing else
    # the kernel warm-up has its own line, apart from the prompt's tok/s
    stats = [line for line in err.splitlines() if line.startswith("[")]
    assert stats[0].startswith("[warm-up: kernels ") and stats[1].startswith("[prompt: ")


def test_explicit_flag_overrides_the_manifest(capsys, sampled):
    rec = registry.default_manifest().parameters
    assert rec.temperature != 0.9
    args = ["generate", README_PROMPT, "--temp", "0.9", "--seed", "3", "-n", "4"]
    assert cli.main(args) == 0
    capsys.readouterr()
    p = sampled[-1]
    assert p.temperature == 0.9 and p.seed == 3
    assert (p.top_k, p.top_p, p.min_p, p.repeat_penalty) == (
        rec.top_k,
        rec.top_p,
        rec.min_p,
        rec.repeat_penalty,
    )


def test_api_uses_the_settings_of_a_registry_file_and_defaults_elsewhere(
    smollm2_path, tmp_path, sampled
):
    import edgerun

    rec = registry.find("smollm2-135m").parameters
    elsewhere = tmp_path / "renamed.gguf"  # same weights, but not a file the registry knows
    elsewhere.symlink_to(smollm2_path)
    same = tmp_path / smollm2_path.name  # the registry's file under its own name
    same.symlink_to(smollm2_path)
    assert edgerun.load(same, threads=1).settings == rec
    m = edgerun.load(smollm2_path, threads=1)
    assert m.settings == rec and m.n_ctx == rec.n_ctx
    "".join(m.generate("Hi", max_tokens=1))
    assert sampled[-1] == rec.sampling()
    "".join(m.generate("Hi", max_tokens=1, temperature=0.5, top_k=7))
    assert (sampled[-1].temperature, sampled[-1].top_k) == (0.5, 7)
    assert sampled[-1].repeat_penalty == rec.repeat_penalty
    other = edgerun.load(elsewhere, threads=1, n_ctx=64)
    assert other.settings == ModelSettings() and other.n_ctx == 64
    other.chat([{"role": "user", "content": "Hi"}], max_tokens=1)
    assert sampled[-1] == ModelSettings().sampling()


def test_every_manifest_parses_and_qwen_brings_its_system_prompt():
    for m in registry.manifests():
        m.parameters.sampling()  # valid values
    qwen = registry.find("qwen2.5-coder-0.5b").parameters
    assert qwen.system.startswith("You are Qwen") and qwen.temperature == 0.7
    assert registry.find("gemma3-270m").parameters.top_k == 64


def test_warm_up_is_reported_once_and_kept_out_of_prompt_time(smollm2_path):
    import edgerun

    m = edgerun.load(smollm2_path, threads=1, n_ctx=128)
    "".join(m.generate("The capital of France is", max_tokens=2))
    first = m.stats
    assert first.warmup is not None and first.warmup.seconds > 0
    assert "kernels" in str(first.warmup)
    "".join(m.generate("The capital of France is", max_tokens=2))
    assert m.stats.warmup is None and m.warm_up() is first.warmup


_GOOD = """
name = "x"
title = "X"
architecture = "llama"
quant = "Q4_0"
license = "MIT"
filename = "x.gguf"
size = 10
packages = ["x==1"]
parts = [{ module = "x", path = "x.gguf" }]
"""


@pytest.mark.parametrize(
    "extra, wants",
    [
        ('[parameters]\ntemperature = "hot"', ["temperature", "a number >= 0", "'hot'"]),
        ("[parameters]\ntop_p = 1.5", ["top_p", "(0, 1]", "1.5"]),
        ("[parameters]\ntop_k = 2.5", ["top_k", "an integer", "2.5"]),
        ("[parameters]\ntemprature = 0.2", ["unknown field 'temprature'", "temperature"]),
        ("[parameters]\nsystem = 3", ["system", "a string", "3"]),
        ("parameters = 3", ["[parameters] must be a table", "3"]),
    ],
)
def test_bad_parameters_name_file_field_expected_and_found(tmp_path, extra, wants):
    path = tmp_path / "x.toml"
    path.write_text(_GOOD + extra + "\n")
    with pytest.raises(ModelFormatError) as e:
        registry._parse(path)
    msg = str(e.value)
    assert str(path) in msg and all(w in msg for w in wants), msg


def test_bad_manifest_field_names_expected_and_found(tmp_path):
    path = tmp_path / "x.toml"
    path.write_text(_GOOD.replace("size = 10", 'size = "98MB"'))
    with pytest.raises(ModelFormatError) as e:
        registry._parse(path)
    msg = str(e.value)
    assert f"{path}: field 'size'" in msg and "positive integer" in msg and "'98MB'" in msg
    path.write_text(_GOOD + "[parameters]\ntemperature = 0.2\n")
    assert registry._parse(path).parameters.temperature == 0.2
    assert registry._parse(path).parameters.source == os.fspath(path)


_ANSWER_PARTS = """
import json, sys, edgerun
from numba.core.registry import CPUDispatcher

def signatures():
    n = 0
    for name, mod in list(sys.modules.items()):
        if name.startswith("edgerun"):
            n += sum(len(v.signatures) for v in vars(mod).values()
                     if isinstance(v, CPUDispatcher))
    return n

m = edgerun.load({path!r}, threads=1, n_ctx=512)
prompt = {prompt!r}
ids = m.encode_chat([dict(role="user", content=prompt)])
parts = m.engine.answer_parts(len(ids))
m.warm_up(parts)
warm = signatures()
"".join(m.chat([dict(role="user", content=prompt)], stream=True, max_tokens=2))
print(json.dumps(dict(parts=parts, n=len(ids), warm=warm, after=signatures())))
"""


@pytest.mark.parametrize("words", [6, 180])  # the README's prompt; one past the batched limits
def test_the_answer_parts_load_every_kernel_an_answer_runs(smollm2_path, words):
    """`edgerun generate` warms only Engine.answer_parts (not a server's batched decode nor
    the row kernels): those parts must still load every kernel its answer runs, or the
    serving process would compile one itself (LLVM's memory, beside the weights)."""
    import json
    import subprocess
    import sys

    prompt = README_PROMPT if words == 6 else " ".join(["word"] * words)
    code = _ANSWER_PARTS.format(path=str(smollm2_path), prompt=prompt)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    res = json.loads(r.stdout.strip().splitlines()[-1])
    assert res["parts"][:2] == ["tokenizer", "prompt"] and res["parts"][-1] == "decode"
    if words > 64:  # past every format's batched limit on each kernel path: its GEMMs
        assert "gemm" in res["parts"], res
    assert "batch" not in res["parts"] and "rows" not in res["parts"]
    assert res["after"] == res["warm"] > 0
