"""Sessions sent from threads at once, so the batching scheduler decodes them together."""

from __future__ import annotations

import threading
from typing import Any


def send_together(model: Any, prompts: list[str], **params: Any) -> tuple[list[str], int]:
    """Each prompt sent by its own new session, all at once: the answers, in prompt order,
    and the largest batch any of them was decoded in."""
    out: list = [None] * len(prompts)
    sizes = [0] * len(prompts)

    def run(i: int) -> None:
        s = model.session()
        out[i] = s.send(prompts[i], **params)
        sizes[i] = max(s.stats.batch_sizes)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out, max(sizes)
