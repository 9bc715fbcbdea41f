"""Three-way teacher-forced agreement on one Qwen2 GGUF: edgerun, llama.cpp and a float64
reference (gguf-py's dequantized weights, float64 activations, no activation or KV
rounding), over the positions benchmarks/vs_llamacpp.py --agreement scores.

    python benchmarks/float_agreement.py -m GGUF [-n 300] [--prompt 16] [--save DIR]
                                         [--emulate q8k,f16kv]

Agreement with llama.cpp alone cannot say which engine a disagreement is wrong in; the
float reference can: an engine whose argmax agrees with it more often computes the file's
model more faithfully. --emulate adds a second reference that rounds as llama.cpp's CPU
backend does (q8k: activations of every quantized matrix to Q8_K, ggml-quants.c
quantize_row_q8_K; f16kv: keys, values, queries and attention weights through float16,
the default f16 cache without flash attention), to attribute the engines' differences.
--save keeps each text's logits (float32 npz) for further study.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).parent))
from vs_llamacpp import _hand_over, _texts  # noqa: E402

# ------------------------------------------------------------------ float reference


def q8k(x: np.ndarray) -> np.ndarray:
    """x [..., cols] through ggml's Q8_K (ggml-quants.c quantize_row_q8_K_ref): per 256
    values the one of largest magnitude `mx` gives iscale = -127 / mx, q = min(127,
    nearest(iscale x)), d = 1 / iscale; returns q * d (float64)."""
    sh = x.shape
    b = x.astype(np.float32).reshape(-1, 256)
    idx = np.abs(b).argmax(axis=1)
    mx = b[np.arange(b.shape[0]), idx]
    safe = np.where(mx == 0, np.float32(1), mx)
    iscale = (np.float32(-127.0) / safe).astype(np.float32)
    q = np.minimum(127, np.rint(iscale[:, None] * b))  # nearest_int rounds half to even
    d = (np.float32(1.0) / iscale).astype(np.float32)
    out = q.astype(np.float64) * d[:, None].astype(np.float64)
    out[mx == 0] = 0.0
    return out.reshape(sh)


class Reference:
    """Qwen2 forward in float64 on gguf-py's dequantization of a GGUF's tensors."""

    def __init__(self, path: str, emulate: frozenset = frozenset()):
        from gguf import GGUFReader

        self.r = GGUFReader(path)
        self.t = {t.name: t for t in self.r.tensors}
        f = self.r.fields

        def val(k):
            p = f[k].parts[f[k].data[0]]
            return p[0].item()

        self.n_layer = int(val("qwen2.block_count"))
        self.n_head = int(val("qwen2.attention.head_count"))
        self.n_kv = int(val("qwen2.attention.head_count_kv"))
        self.theta = float(val("qwen2.rope.freq_base"))
        self.eps = float(val("qwen2.attention.layer_norm_rms_epsilon"))
        self.emulate = emulate
        self.record: dict | None = None  # name -> the float64 input rows of each matrix

    def w(self, name: str) -> np.ndarray:
        from gguf.quants import dequantize

        t = self.t[name]
        return dequantize(t.data, t.tensor_type).astype(np.float64)

    def quantized(self, name: str) -> bool:
        return self.t[name].tensor_type.name not in ("F32", "F16", "BF16")

    def lin(self, x: np.ndarray, name: str) -> np.ndarray:
        if self.record is not None:
            self.record[name] = x.copy()
        xin = q8k(x) if "q8k" in self.emulate and self.quantized(name) else x
        return xin @ self.w(name).T

    def norm(self, x: np.ndarray, name: str) -> np.ndarray:
        r = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps)
        return r * self.w(name)

    def rope(self, x: np.ndarray) -> np.ndarray:
        """NEOX rotation (qwen2): pairs (i, i + d/2). x [n, heads, d]."""
        n, _, d = x.shape
        inv = self.theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        ang = np.arange(n, dtype=np.float64)[:, None] * inv[None, :]
        c, s = np.cos(ang)[:, None, :], np.sin(ang)[:, None, :]
        a, b = x[..., : d // 2], x[..., d // 2 :]
        return np.concatenate([a * c - b * s, a * s + b * c], axis=-1)

    def logits(self, ids: list[int]) -> np.ndarray:
        """float64 logits [len(ids), vocab] of a causal pass over ids."""
        f16 = "f16kv" in self.emulate

        def h16(a):
            return a.astype(np.float16).astype(np.float64) if f16 else a

        x = self.w("token_embd.weight")[np.asarray(ids)]
        n = len(ids)
        hd = x.shape[1] // self.n_head
        mask = np.triu(np.full((n, n), -np.inf), 1)
        for i in range(self.n_layer):
            p = f"blk.{i}."
            h = self.norm(x, p + "attn_norm.weight")
            q = self.lin(h, p + "attn_q.weight") + self.w(p + "attn_q.bias")
            k = self.lin(h, p + "attn_k.weight") + self.w(p + "attn_k.bias")
            v = self.lin(h, p + "attn_v.weight") + self.w(p + "attn_v.bias")
            q = self.rope(q.reshape(n, self.n_head, hd))
            k = h16(self.rope(k.reshape(n, self.n_kv, hd)))
            v = h16(v.reshape(n, self.n_kv, hd))
            g = self.n_head // self.n_kv
            att = np.empty((n, self.n_head, hd))
            for hh in range(self.n_head):
                s = h16(q[:, hh]) @ k[:, hh // g].T / np.sqrt(hd) + mask
                s = np.exp(s - s.max(axis=1, keepdims=True))
                s /= s.sum(axis=1, keepdims=True)
                att[:, hh] = h16(s) @ v[:, hh // g]
            x = x + self.lin(att.reshape(n, -1), p + "attn_output.weight")
            h = self.norm(x, p + "ffn_norm.weight")
            gt = self.lin(h, p + "ffn_gate.weight")
            up = self.lin(h, p + "ffn_up.weight")
            x = x + self.lin(gt / (1 + np.exp(-gt)) * up, p + "ffn_down.weight")
        h = self.norm(x, "output_norm.weight")
        head = "output.weight" if "output.weight" in self.t else "token_embd.weight"
        return self.lin(h, head)


def matrix_errors(path: str, ids: list[int]) -> None:
    """Per quantized matrix of the file, on its real inputs over `ids` (the float64
    reference's activations): the relative rms error against float64 (weights as gguf-py
    dequantizes them) of edgerun's decode matvec on this host's kernel path, of
    llama.cpp's arithmetic (Q8_K activations, exact integer sums), and for the grid types
    of int8.gridquants' kernel (quantize_x_sb8 activations); summed per type and role."""
    from edgerun.ops import qmatvec
    from edgerun.ops.int8 import gridquants as ig
    from edgerun.quant.formats import QuantTensor, QuantType

    ref = Reference(path)
    ref.record = {}
    ref.logits(ids)
    int8_grid = {
        "IQ2_XXS": ig.mv_iq2_xxs, "IQ2_XS": ig.mv_iq2_xs,
        "IQ3_XXS": ig.mv_iq3_xxs, "IQ3_S": ig.mv_iq3_s,
    }  # fmt: skip
    none2 = np.zeros((0, 1), np.uint8)
    none1 = np.zeros(0, np.float32)
    agg: dict = {}
    print(f"kernel path {qmatvec.kernel_path()}; {len(ids)} tokens; rel. rms error vs float64")
    for name, X in ref.record.items():
        t = ref.t[name]
        if not ref.quantized(name):
            continue
        W = ref.w(name)
        exact = X @ W.T
        qt = QuantType[t.tensor_type.name]
        w = QuantTensor(name, qt, W.shape, np.ascontiguousarray(t.data))
        Xf = X.astype(np.float32)
        er = np.stack([qmatvec.matvec(w, x) for x in Xf]).astype(np.float64)
        ll = q8k(X) @ W.T
        errs = {"edgerun": er, "llama.cpp": ll}
        if qt.name in int8_grid:
            o = np.empty(W.shape[0], np.float32)
            rows = []
            for x in Xf:
                int8_grid[qt.name](w.data, none2, none2, x, o, none1, none1)
                rows.append(o.astype(np.float64))
            errs["int8 sb8"] = np.stack(rows)
        den = np.sum(exact * exact)
        role = name.split(".")[-2]
        a = agg.setdefault((qt.name, role), {"n": 0})
        a["n"] += 1
        for k, y in errs.items():
            a[k] = a.get(k, 0.0) + np.sum((y - exact) ** 2) / den
    print(
        f"{'type':8} {'role':12} {'n':>3} "
        + " ".join(f"{k:>10}" for k in ("edgerun", "llama.cpp", "int8 sb8"))
    )
    for (qt, role), a in sorted(agg.items()):
        cells = " ".join(
            f"{np.sqrt(a[k] / a['n']):10.2e}" if k in a else f"{'':>10}"
            for k in ("edgerun", "llama.cpp", "int8 sb8")
        )
        print(f"{qt:8} {role:12} {a['n']:3d} {cells}")


# ------------------------------------------------------------------ the engines


def edgerun_logits(model, ids: list[int], prompt: int) -> np.ndarray:
    """edgerun's logits at positions prompt-1 .. len(ids)-3, as vs_llamacpp.agreement:
    a prefill of `prompt` tokens, then one decode step a token."""
    from edgerun.model.kvcache import KVCache

    cache = KVCache(model.spec, len(ids), "f32")
    tr = model.transformer
    rows = [np.array(tr.forward(ids[:prompt], cache), dtype=np.float32)]
    rows += [np.array(tr.forward([t], cache), dtype=np.float32) for t in ids[prompt:-2]]
    return np.stack(rows)


def llama_logits(path: str, ids: list[int], prompt: int) -> np.ndarray:
    from llama_cpp import Llama

    _hand_over()
    llm = Llama(
        path, n_ctx=len(ids) + 8, n_threads=1, n_threads_batch=1, n_batch=512,
        logits_all=True, verbose=False,
    )  # fmt: skip
    llm.eval(ids[:-1])
    out = np.asarray(llm.scores[prompt - 1 : len(ids) - 2], dtype=np.float32)
    del llm
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-m", "--model", required=True)
    ap.add_argument("-n", type=int, default=300)
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--save", type=Path, default=None)
    ap.add_argument("--emulate", default="", help="comma list of q8k, f16kv (a second reference)")
    ap.add_argument("--no-llama", action="store_true")
    ap.add_argument(
        "--matrices",
        type=int,
        default=0,
        metavar="T",
        help="only the per-matrix errors on T tokens of code",
    )
    args = ap.parse_args(argv)
    if args.matrices:
        import edgerun

        model = edgerun.load(args.model, n_ctx=64)
        matrix_errors(args.model, model.tokenize(_texts()["code"])[: args.matrices])
        return 0
    import edgerun
    from edgerun.runtime.cpu_share import set_threads

    set_threads(1)
    model = edgerun.load(args.model, n_ctx=args.n + args.prompt + 8)
    emulate = frozenset(e for e in args.emulate.split(",") if e)
    for name, text in _texts().items():
        ids = model.tokenize(text)[: args.n + args.prompt + 1]
        c0 = time.process_time()
        got = {"edgerun": edgerun_logits(model, ids, args.prompt)}
        if not args.no_llama:
            got["llama.cpp"] = llama_logits(str(model.path), ids, args.prompt)
        sl = slice(args.prompt - 1, len(ids) - 2)
        got["float64"] = Reference(args.model).logits(ids[:-2])[sl]
        if emulate:
            got["emulated"] = Reference(args.model, emulate).logits(ids[:-2])[sl]
        c1 = time.process_time()
        top = {k: v.argmax(axis=1) for k, v in got.items()}
        names = list(got)
        print(
            f"{Path(args.model).name} {name}: {len(top['edgerun'])} positions, {c1 - c0:.0f} s CPU"
        )
        for i, a in enumerate(names):
            for b in names[i + 1 :]:
                print(f"  {a} ~ {b}: {np.mean(top[a] == top[b]) * 100:.1f}%")
        ref = got["float64"]
        srt = np.sort(ref, axis=1)
        margin = srt[:, -1] - srt[:, -2]
        for k in names:
            if k == "float64":
                continue
            e = got[k] - ref
            e -= e.mean(axis=1, keepdims=True)  # logits are defined up to a constant
            rms = np.sqrt(np.mean(e * e))
            print(f"  {k}: rms logit error vs float64 {rms:.4f}")
        print(
            f"  float64 top-2 margin: median {np.median(margin):.3f}, "
            f"<0.1: {np.mean(margin < 0.1) * 100:.1f}%"
        )
        if args.save:
            args.save.mkdir(parents=True, exist_ok=True)
            stem = Path(args.model).stem
            np.savez(
                args.save / f"{stem}-{name}.npz",
                ids=np.asarray(ids),
                **{k.replace(".", ""): v.astype(np.float32) for k, v in got.items()},
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
