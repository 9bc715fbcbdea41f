"""Bad user input on the command line: a clear message, a non-zero exit, no traceback
(unless --debug), and Ctrl+C in `generate` stops cleanly with the stats so far (exit 130)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from edgerun.cli import main


@pytest.mark.parametrize(
    "argv, message",
    [
        (["generate", "-n", "0", "hi"], "max-tokens must be > 0"),
        (["generate", "-n", "-3", "hi"], "max-tokens must be > 0"),
        (["generate", "--temp", "-1", "hi"], "temperature must be >= 0"),
        (["generate", "--top-p", "2", "hi"], "top_p must be in (0, 1]"),
        (["generate", "-c", "-5", "hi"], "--ctx must be >= 0"),
        (["generate", "-t", "0", "hi"], "--threads must be >= 1"),
        (["generate", "-m", "smolm2", "hi"], "did you mean 'smollm2-135m'"),
        (["generate", "-m", "/nonexistent/x.gguf", "hi"], "model file not found"),
        (["generate", "--ram-budget", "1M", "hi"], "minimum"),
    ],
)
def test_bad_input_is_a_clear_error(argv, message, capsys):
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_unreadable_model_file(tmp_path, capsys):
    p = tmp_path / "locked.gguf"
    p.write_bytes(b"GGUF" + b"\0" * 64)
    p.chmod(0)
    try:
        code = main(["generate", "-m", str(p), "hi"])
    finally:
        p.chmod(0o600)
    err = capsys.readouterr().err
    assert code == 1 and "locked.gguf" in err and "Traceback" not in err


def test_debug_shows_the_traceback(capsys):
    assert main(["--debug", "generate", "-m", "smolm2", "hi"]) == 1
    assert "Traceback" in capsys.readouterr().err


def test_ctrl_c_stops_generate_with_stats_and_130():
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # seed 1 samples 400+ tokens before an end of text (others stopped at 51 tokens, within
    # 0.2 s at this machine's decode rate, before the interrupt arrived)
    cmd = [sys.executable, "-m", "edgerun", "generate", "--raw", "-n", "2000", "--temp", "0.7"]
    cmd += ["--seed", "1"]
    # A shell that starts a job in the background without job control ignores SIGINT in
    # it, and Python then installs no KeyboardInterrupt handler: give the child the
    # default disposition a terminal's process has.
    p = subprocess.Popen(
        [*cmd, "Once upon a time"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    # wait for the first generated text, then interrupt
    first = p.stdout.read(1)
    assert first
    time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    out, err = p.communicate(timeout=60)
    err = err.decode()
    assert p.returncode == 130, err
    assert "generated:" in err and "(cancelled)" in err and "Traceback" not in err
