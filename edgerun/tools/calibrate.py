"""Calibration for importance-weighted quantization (llama.cpp's "imatrix").

`collect_imatrix` runs the model on calibration text and records, for every weight
matrix W (y = W @ x), the mean of x_j^2 over all tokens for each input column j. Columns
that carry large activations matter more: the quantizers (edgerun.quant.quantize) use
these as weights in their scale search, so rounding error is pushed onto the columns
the model barely uses.

The activations are captured by wrapping the kernel entry points (`matmul`, `matvec`,
`matvec_many`) for the duration of the run; model code is unchanged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import numpy as np

__all__ = ["ImatrixCollector", "collect_imatrix", "save_imatrix", "load_imatrix"]


class ImatrixCollector:
    """Accumulates sum(x^2) per input column, per weight name."""

    def __init__(self) -> None:
        self.sums: dict[str, np.ndarray] = {}
        self.counts: dict[str, int] = {}

    def add(self, name: str, x: np.ndarray) -> None:
        x = np.asarray(x, dtype=np.float32)
        x2 = x.reshape(-1, x.shape[-1])
        s = np.einsum("ij,ij->j", x2, x2, dtype=np.float64)
        if name in self.sums:
            self.sums[name] += s
            self.counts[name] += x2.shape[0]
        else:
            self.sums[name] = s
            self.counts[name] = x2.shape[0]

    def result(self, min_count: int = 64) -> dict[str, np.ndarray]:
        """Mean squares per weight name; weights seen on fewer than min_count rows (the
        output head, which sees one row per forward call) are left out."""
        return {
            k: (v / self.counts[k]).astype(np.float32)
            for k, v in self.sums.items()
            if self.counts[k] >= min_count
        }

    @contextlib.contextmanager
    def hooked(self) -> Iterator[None]:
        """Record the inputs of every projection made while the block runs.

        Wraps the kernel entry points in ops.qmatvec, which `project` and
        `project_many` look up at call time, so every executor is seen.
        """
        from edgerun.ops import qmatvec as kernels

        entries = ("matmul", "matvec", "matvec_many", "matvec_batch", "matvec_batch_many")
        saved = {k: getattr(kernels, k) for k in entries}
        mm, mv, mvm = saved["matmul"], saved["matvec"], saved["matvec_many"]
        mvb, mvbm = saved["matvec_batch"], saved["matvec_batch_many"]

        def matmul(w, x, out=None):
            self.add(w.name, x)
            return mm(w, x, out)

        def matvec(w, x, out=None):
            self.add(w.name, x)
            return mv(w, x, out)

        def matvec_many(ws, x, outs=None):
            for w in ws:
                self.add(w.name, x)
            return mvm(ws, x, outs)

        # short prompts take the batched decode kernels (qmatvec.project_many), whose
        # many-matrix entry may call the one-matrix one: count each input once
        inside_many = [False]

        def matvec_batch(w, x, out=None):
            if not inside_many[0]:
                self.add(w.name, x)
            return mvb(w, x, out)

        def matvec_batch_many(ws, x):
            for w in ws:
                self.add(w.name, x)
            inside_many[0] = True
            try:
                return mvbm(ws, x)
            finally:
                inside_many[0] = False

        kernels.matmul, kernels.matvec, kernels.matvec_many = matmul, matvec, matvec_many
        kernels.matvec_batch, kernels.matvec_batch_many = matvec_batch, matvec_batch_many
        try:
            yield
        finally:
            for k, v in saved.items():
                setattr(kernels, k, v)


def collect_imatrix(
    transformer,
    tokens: list[int],
    n_ctx: int = 512,
    chunk: int = 128,
    on_progress: Callable[[int, int], None] | None = None,
) -> dict[str, np.ndarray]:
    """Mean squared input activation per column for every matrix, over `tokens`.

    The tokens are run in independent windows of n_ctx (a fresh KV cache each), fed
    `chunk` tokens per forward call.
    """
    col = ImatrixCollector()
    total = len(tokens)
    done = 0
    with col.hooked():
        for w0 in range(0, total, n_ctx):
            ids = tokens[w0 : w0 + n_ctx]
            cache = transformer.new_cache(len(ids))
            for c0 in range(0, len(ids), chunk):
                transformer.forward(ids[c0 : c0 + chunk], cache, all_logits=False)
                done += len(ids[c0 : c0 + chunk])
                if on_progress:
                    on_progress(done, total)
    return col.result()


def save_imatrix(path, imatrix: dict[str, np.ndarray]) -> None:
    np.savez(path, **imatrix)


def load_imatrix(path) -> dict[str, np.ndarray]:
    from edgerun.errors import InvalidArgumentError

    try:
        with np.load(path, allow_pickle=False) as z:
            return {k: np.asarray(z[k], dtype=np.float32) for k in z.files}
    except (OSError, ValueError) as e:
        raise InvalidArgumentError(f"cannot read imatrix file {str(path)!r}: {e}") from None
