"""Sessions sent from threads at once, so the batching scheduler decodes them together."""

from __future__ import annotations

import threading
import time
from typing import Any


def send_together(model: Any, prompts: list[str], **params: Any) -> tuple[list[str], int]:
    """Each prompt sent by its own new session, all at once: the answers, in prompt order,
    and the largest batch any of them was decoded in. The engine's lock is held until every
    request is submitted (or 10 s pass), so the scheduler cannot finish a short answer
    before the others arrive when the host is busy (another test worker compiling)."""
    out: list = [None] * len(prompts)
    sizes = [0] * len(prompts)
    sessions = [model.session() for _ in prompts]

    def run(i: int) -> None:
        s = sessions[i]
        out[i] = s.send(prompts[i], **params)
        sizes[i] = max(s.stats.batch_sizes)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    with model.engine.lock:  # the scheduler steps under it
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10.0
        while any(s.last is None for s in sessions) and time.monotonic() < deadline:
            time.sleep(0.005)
    for t in threads:
        t.join()
    return out, max(sizes)
