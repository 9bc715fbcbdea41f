"""No data loss: atomic writes survive a writer killed mid-write (SIGKILL), and one corrupt
conversation file is reported without hiding the others."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from edgerun.runtime.atomic import write_atomic, write_bytes_atomic
from edgerun.tui.store import Conversation, ConversationStore


def test_write_atomic_replaces_and_cleans_up(tmp_path):
    p = tmp_path / "f.bin"
    write_bytes_atomic(p, b"old")
    write_bytes_atomic(p, b"new")
    assert p.read_bytes() == b"new"

    def boom(tmp: Path) -> None:
        tmp.write_bytes(b"half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        write_atomic(p, boom)
    assert p.read_bytes() == b"new"
    assert sorted(x.name for x in tmp_path.iterdir()) == ["f.bin"]


@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_sigkill_mid_write_keeps_the_previous_version(tmp_path):
    target = tmp_path / "chat.json"
    write_bytes_atomic(target, b'{"v": 1}')
    script = textwrap.dedent(
        f"""
        import sys, time
        from edgerun.runtime.atomic import write_atomic
        def slow(tmp):
            with open(tmp, "wb") as f:
                for i in range(10_000):
                    f.write(b"x" * 4096)
                    f.flush()
                    if i == 10:
                        print("writing", flush=True)
                    time.sleep(0.001)
        write_atomic({str(target)!r}, slow)
        """
    )
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert p.stdout.readline().strip() == b"writing"
    time.sleep(0.05)
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert p.returncode == -signal.SIGKILL
    assert target.read_bytes() == b'{"v": 1}'  # the old version, whole
    leftovers = [x.name for x in tmp_path.iterdir() if x.name != "chat.json"]
    assert all(n.endswith(".tmp") and n.startswith(".") for n in leftovers)  # never a *.json


def test_sigkill_during_session_save_keeps_the_old_session(tmp_path, smollm2_path):
    """A session file being rewritten when the writer dies still loads as before."""
    script = textwrap.dedent(
        f"""
        import os, signal, sys
        import edgerun
        import edgerun.runtime.atomic as atomic
        m = edgerun.load({str(smollm2_path)!r}, n_ctx=256, threads=1)
        s = m.session()
        s.send("Hi", max_tokens=4, temperature=0.0)
        s.save({str(tmp_path / "s.safetensors")!r})
        print("saved", flush=True)
        s.send("More", max_tokens=4, temperature=0.0)
        real = atomic.os.replace
        def die(a, b):  # killed after the temp file is complete, before the rename
            os.kill(os.getpid(), signal.SIGKILL)
        atomic.os.replace = die
        s.save({str(tmp_path / "s.safetensors")!r})
        """
    )
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()[-2000:]
    import edgerun

    m = edgerun.load(smollm2_path, n_ctx=256, threads=1)
    s = edgerun.Session.load(m, tmp_path / "s.safetensors")
    assert [x["role"] for x in s.messages] == ["user", "assistant"]  # the first save
    m.close()


def test_corrupt_conversation_is_reported_not_hiding_others(tmp_path):
    store = ConversationStore(tmp_path)
    good = Conversation()
    good.messages.append({"role": "user", "content": "hello"})
    store.save(good)
    (tmp_path / "20990101-000000-dead.json").write_text('{"messages": [', "utf-8")
    (tmp_path / "20990101-000001-beef.json").write_bytes(b"\xff\xfe garbage")
    convs = store.list()
    assert [c.id for c in convs] == [good.id]
    bad = sorted(p.name for p, _ in store.broken)
    assert bad == ["20990101-000000-dead.json", "20990101-000001-beef.json"]
    assert all(why for _, why in store.broken)
    assert json.loads(store.path(good).read_text())["messages"][0]["content"] == "hello"
    assert not [p for p in os.listdir(tmp_path) if p.endswith(".tmp")]


def test_interrupted_conversion_keeps_the_previous_pack(tmp_path, smollm2_path):
    """Ctrl+C (KeyboardInterrupt) halfway through `convert` leaves the previous pack
    loadable and no half-written pack at the target."""
    from edgerun.formats.pack import read_pack
    from edgerun.tools import convert as tool
    from edgerun.tools.convert import convert

    out = tmp_path / "pack"
    convert(str(smollm2_path), out, "keep", progress=False)
    before = sorted(read_pack(out).tensor_names())
    real = tool.write_pack

    def interrupted(*a, **kw):
        seen = []

        def on_tensor(name):
            seen.append(name)
            if len(seen) == 20:
                raise KeyboardInterrupt

        a = list(a[:8])
        kw["on_tensor"] = on_tensor
        return real(*a, **kw)

    tool.write_pack = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            convert(str(smollm2_path), out, "keep", progress=False)
    finally:
        tool.write_pack = real
    assert sorted(read_pack(out).tensor_names()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pack"]  # no staging left


def test_pack_writer_refuses_a_foreign_directory(tmp_path):
    from edgerun.formats.pack import PackError, PackWriter
    from edgerun.quant.formats import QuantType

    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(PackError, match="not an edgerun pack"):
        PackWriter(tmp_path, [("t", QuantType.F32, (1, 4))])
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_full_disk_is_a_clear_error(tmp_path, monkeypatch):
    """Writers check free space first (named error, nothing written), and a disk that fills
    up during a write gives a DiskSpaceError naming the file, with the temp file removed."""
    import errno
    import shutil
    from collections import namedtuple

    from edgerun.errors import DiskSpaceError
    from edgerun.formats.pack import PackWriter
    from edgerun.quant.formats import QuantType

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage(10 << 20, 10 << 20, 1024))
    with pytest.raises(DiskSpaceError, match=r"pack p in .*: needs \d+ MiB, 0 MiB free"):
        PackWriter(tmp_path / "p", [("t", QuantType.F32, (1024, 1024))])
    assert not list(tmp_path.iterdir())

    def full(tmp: Path) -> None:
        tmp.write_bytes(b"x")
        raise OSError(errno.ENOSPC, "No space left on device")

    with pytest.raises(DiskSpaceError, match="disk is full writing chat.json"):
        write_atomic(tmp_path / "chat.json", full)
    assert not list(tmp_path.iterdir())
