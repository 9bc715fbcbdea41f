"""Per-sequence recurrent states: the cache a recurrent token mixer keeps beside the KV cache.

Hybrid families replace attention in some layers by a mixer that carries a fixed-size
state from token to token (LFM2's short convolution: the last L - 1 inputs; gated
DeltaNet: a conv window and a [heads, dk, dv] matrix; Mamba-2). A sequence's states live
in its KVCache as `cache.state` (a StateCache), so everything that already passes a
sequence's cache around (the engine, sessions, the scheduler, speculative decoding)
carries its states too, and the KV cache itself holds rows only for attention layers
(ModelSpec.kv_slot).

A state cannot be cut back as KV rows can: a StateCache keeps copies of its states at
chosen positions (snapshots: the end of every prompt pass, and every row of a
verification pass), and KVCache.truncate(n) goes back only to a position it holds a state
for (0, its length, or a snapshot); KVCache.reusable(n) says which.

The protocol a recurrent mixer implements (model/layer.py's Recurrent step calls it):

- its states: STATE_SHAPES[kind](spec) names the float32 arrays one layer keeps per
  sequence and their shapes (a new mixer adds its row here); StateCache allocates them
  zeroed (the state before any token) and copies, saves and restores them by name.
- `prompt(x, state) -> a`: x [n, d_model] the normed inputs of n consecutive tokens of
  one sequence; reads the layer's state (a dict name -> array), updates it in place to
  the state after the n tokens, returns the mixer output a [n, d_model] (before the
  residual add). Rows.states(layer) gives ([state], [state]) in a prompt pass.
- `decode(x, ins, outs) -> a`: x [n, d_model], one token per row; row b reads the state
  ins[b] and writes the state after it to outs[b] (ins[b] is outs[b] for a plain decode
  step: update in place). Rows are taken in order: in a verification pass one sequence
  comes back at consecutive positions and ins[b] is outs[b - 1], so the state after
  every row is kept and a rejected draft rolls back without recompute. Row b must equal
  what `prompt(x[b:b+1], state)` would give on the same state (batched == alone).
- `matrices() -> list[QuantTensor]`: its weight matrices (footprints, plans).
- `bindable() -> bool` and `bind(rows) -> (before, on_states, after)`: the optional
  bound decode form (decode_step.py): kernel calls on the BoundRows' buffers before
  and after the state's part, and on_states(states) -> the calls on the sequences'
  states (states[b]: row b's sequence's, updated in place), bound to each set of
  caches. A mixer without one returns False and the model decodes on the general path.
  (A verification pass, one sequence at consecutive rows, always takes the general
  path: its rows chain the states.)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np

from edgerun.arch.spec import ModelSpec
from edgerun.errors import InvalidArgumentError, ModelFormatError
from edgerun.quant.formats import QuantTensor

__all__ = [
    "STATE_SHAPES",
    "MAX_SNAPSHOTS",
    "SNAPSHOT_BYTES",
    "VERIFY_STATE_BYTES",
    "LayerState",
    "StateCache",
    "RecurrentMixer",
    "PassStates",
    "snapshot_count",
    "state_shapes",
    "verify_rows",
]

LayerState = dict[str, np.ndarray]

# Each recurrent mixer's per-sequence arrays (float32), by name and shape, from the spec.
STATE_SHAPES: dict[str, Callable[[ModelSpec], dict[str, tuple[int, ...]]]] = {
    # the last L - 1 gated inputs B*x, oldest first, [L - 1, d_model]
    "shortconv": lambda s: {"conv": (s.shortconv_l_cache - 1, s.d_model)},
    # gated DeltaNet: the last L - 1 projected q, k, v inputs of its conv [L - 1, channels]
    # and each value head's matrix [v_heads, dk, dv]
    "deltanet": lambda s: {
        "conv": (s.ssm_conv_kernel - 1, (2 * s.ssm_k_heads + s.ssm_v_heads) * s.ssm_head_dim),
        "ssm": (s.ssm_v_heads, s.ssm_head_dim, s.ssm_head_dim),
    },
    # Mamba-2: the last L - 1 inputs of its conv over x, B, C [L - 1, d_inner + 2 groups N]
    # and each head's matrix [heads, head_dim, N]
    "mamba2": lambda s: {
        "conv": (
            s.ssm_conv_kernel - 1,
            s.mamba_heads * s.mamba_head_dim + 2 * s.mamba_groups * s.mamba_state,
        ),
        "ssm": (s.mamba_heads, s.mamba_head_dim, s.mamba_state),
    },
}

# States kept at the ends of a sequence's latest prompt passes (the oldest goes first),
# counted in the RAM budget (StateCache.bytes_for): at most MAX_SNAPSHOTS, and no more
# than SNAPSHOT_BYTES hold beyond the first (a Mamba-2 model's states reach ~74 MiB a
# sequence: one snapshot, not four). A verification pass keeps the state after each of its
# rows besides, until the next one, so its rows are capped by VERIFY_STATE_BYTES (at least
# 2 rows: one drafted token) where the states are large.
MAX_SNAPSHOTS = 4
SNAPSHOT_BYTES = 64 << 20
VERIFY_STATE_BYTES = 256 << 20


def snapshot_count(state_bytes: int) -> int:
    """How many snapshots a sequence whose live states take `state_bytes` keeps."""
    if state_bytes <= 0:
        return MAX_SNAPSHOTS
    return max(1, min(MAX_SNAPSHOTS, 1 + SNAPSHOT_BYTES // state_bytes))


def verify_rows(state_bytes: int) -> int | None:
    """The most rows a verification pass of one sequence may run when its live states
    take `state_bytes` (each row keeps a copy); None: no cap (no states)."""
    if state_bytes <= 0:
        return None
    return max(2, VERIFY_STATE_BYTES // state_bytes)


class RecurrentMixer(Protocol):
    """A token mixer with a per-sequence state in place of attention (protocol above)."""

    kind: str

    def prompt(self, x: np.ndarray, state: LayerState) -> np.ndarray: ...

    def decode(
        self, x: np.ndarray, ins: Sequence[LayerState], outs: Sequence[LayerState]
    ) -> np.ndarray: ...

    def matrices(self) -> list[QuantTensor]: ...

    def bindable(self) -> bool: ...


def state_shapes(spec: ModelSpec) -> dict[int, dict[str, tuple[int, ...]]]:
    """Each recurrent layer's state arrays: layer index -> name -> shape."""
    out = {}
    for i in spec.recurrent_layers:
        shapes = STATE_SHAPES.get(spec.mixer(i))
        if shapes is None:
            raise ModelFormatError(
                f"{spec.name}: layer {i}'s mixer '{spec.mixer(i)}' has no state layout "
                f"(known: {', '.join(STATE_SHAPES)})"
            )
        out[i] = shapes(spec)
    return out


def _copy(layers: dict[int, LayerState]) -> dict[int, LayerState]:
    return {i: {k: a.copy() for k, a in st.items()} for i, st in layers.items()}


class StateCache:
    """One sequence's recurrent states: per recurrent layer, named float32 arrays (the
    state after every token the sequence's KVCache holds), and snapshots of them at
    earlier positions. Empty (no layers) for a model that only attends."""

    def __init__(self, spec: ModelSpec) -> None:
        self.shapes = state_shapes(spec)
        self.layers: dict[int, LayerState] = {
            i: {name: np.zeros(shape, np.float32) for name, shape in named.items()}
            for i, named in self.shapes.items()
        }
        self.snapshots: dict[int, dict[int, LayerState]] = {}  # position -> states
        self._verified: set[int] = set()  # positions the last verification pass kept
        one = self.state_bytes(spec)
        self.max_snapshots = snapshot_count(one)
        self.max_verify_rows = verify_rows(one)

    @staticmethod
    def state_bytes(spec: ModelSpec) -> int:
        """Bytes one sequence's live states take (0: a model that only attends)."""
        shapes = [shape for named in state_shapes(spec).values() for shape in named.values()]
        return sum(4 * math.prod(shape) for shape in shapes)

    @staticmethod
    def bytes_for(spec: ModelSpec, snapshots: int | None = None) -> int:
        """Bytes one sequence's states take, with room for `snapshots` copies (None: as
        many as a StateCache of this spec keeps)."""
        one = StateCache.state_bytes(spec)
        return one * (1 + (snapshot_count(one) if snapshots is None else snapshots))

    @property
    def recurrent(self) -> bool:
        """Whether there is any state (a hybrid model)."""
        return bool(self.layers)

    @property
    def nbytes(self) -> int:
        """Bytes the live states and the snapshots hold now."""
        one = sum(a.nbytes for st in self.layers.values() for a in st.values())
        return one * (1 + len(self.snapshots))

    def reset(self) -> None:
        """The state before any token (zeros), with no snapshots."""
        for st in self.layers.values():
            for a in st.values():
                a.fill(0.0)
        self.snapshots.clear()
        self._verified.clear()

    def snapshot(self, position: int) -> None:
        """Keep a copy of the live states as the state at `position` (the oldest snapshot
        goes past MAX_SNAPSHOTS)."""
        if self.recurrent:
            self.keep(position, _copy(self.layers))

    def keep(self, position: int, layers: dict[int, LayerState]) -> None:
        """Keep `layers` (owned from here on) as the states at `position`, and at most
        max_snapshots such (the oldest goes first; a verification pass's are apart)."""
        self.snapshots.pop(position, None)
        self._verified.discard(position)
        self.snapshots[position] = layers
        kept = [p for p in self.snapshots if p not in self._verified]
        for p in kept[: max(0, len(kept) - self.max_snapshots)]:
            del self.snapshots[p]

    def keep_verified(self, states: dict[int, dict[int, LayerState]]) -> None:
        """Keep the states after each row of a verification pass (position -> states,
        owned from here on) in place of the previous pass's."""
        for p in self._verified:
            self.snapshots.pop(p, None)
        self.snapshots.update(states)
        self._verified = set(states)

    def positions(self) -> list[int]:
        """Positions with a snapshot, ascending."""
        return sorted(self.snapshots)

    def restore(self, position: int) -> None:
        """Make the snapshot at `position` the live states; snapshots past it go (they
        belong to tokens now forgotten)."""
        snap = self.snapshots.get(position)
        if snap is None:
            raise InvalidArgumentError(
                f"no recurrent state kept at position {position} (kept: {self.positions()}); "
                "KVCache.reusable says how far a hybrid model's cache can go back"
            )
        for i, st in snap.items():
            for name, a in st.items():
                self.layers[i][name][...] = a
        self.drop_after(position)

    def set_layers(self, layers: dict[int, LayerState]) -> None:
        """Make a copy of `layers` (StateCache.layers' layout) the live states; no
        snapshots (they belonged to other tokens)."""
        for i, named in layers.items():
            for name, a in named.items():
                self.layers[i][name][...] = a
        self.snapshots.clear()
        self._verified.clear()

    def copy_at(self, position: int, length: int) -> dict[int, LayerState] | None:
        """A copy of the states after `position` tokens of a sequence of `length`: the
        live ones (position == length) or a snapshot; None where none is kept."""
        if position == length:
            return _copy(self.layers)
        snap = self.snapshots.get(position)
        return None if snap is None else _copy(snap)

    def drop_after(self, position: int) -> None:
        """Forget snapshots of positions past `position`."""
        for p in [p for p in self.snapshots if p > position]:
            del self.snapshots[p]
            self._verified.discard(p)

    def arrays(self) -> dict[str, np.ndarray]:
        """The live states by flat name ("<layer>.<name>"), for saving."""
        return {f"{i}.{name}": a for i, st in self.layers.items() for name, a in st.items()}

    def load(self, arrays: dict[str, np.ndarray], source: str = "state") -> None:
        """Set the live states from `arrays()`'s names (shapes checked); no snapshots."""
        want = self.arrays()
        if set(arrays) != set(want):
            raise ModelFormatError(
                f"{source}: recurrent states {sorted(arrays)} do not match the model's "
                f"{sorted(want)}"
            )
        for key, a in arrays.items():
            if a.shape != want[key].shape:
                raise ModelFormatError(
                    f"{source}: recurrent state '{key}' has shape {a.shape}, expected "
                    f"{want[key].shape}"
                )
        for key, a in arrays.items():
            want[key][...] = a
        self.snapshots.clear()
        self._verified.clear()


class PassStates:
    """The states a pass of rows reads and writes (Rows.states): for a prompt pass, the
    one sequence's live states; for decode rows, row b's sequence's, each sequence's rows
    in order. A sequence with several rows (a verification pass at consecutive positions)
    gets a chain of fresh states: row b writes its own, the next row reads it, and
    `finish` makes the last one live and keeps each as a snapshot at its position."""

    def __init__(self, states: Sequence[StateCache], starts: Sequence[int], decode: bool) -> None:
        self.states, self.starts, self.decode = list(states), list(starts), decode
        self._chains: dict[int, tuple[StateCache, list[int]]] = {}  # id -> rows
        if decode:
            for b, st in enumerate(self.states):
                self._chains.setdefault(id(st), (st, []))[1].append(b)
        # per chained sequence: the states after each of its rows, by row
        self._outs: dict[int, dict[int, LayerState]] = {}
        if decode:
            for st, rows in self._chains.values():
                if len(rows) > 1:
                    for b in rows:
                        self._outs[b] = _copy(st.layers)

    def __call__(self, layer: int) -> tuple[list[LayerState], list[LayerState]]:
        """(ins, outs) of `layer`: one pair for a prompt pass, else one per row."""
        if not self.decode:
            live = self.states[0].layers[layer]
            return [live], [live]
        ins, outs = [], []
        for b, st in enumerate(self.states):
            out = self._outs.get(b)
            if out is None:
                ins.append(st.layers[layer])
                outs.append(st.layers[layer])
                continue
            rows = self._chains[id(st)][1]
            k = rows.index(b)
            ins.append(st.layers[layer] if k == 0 else self._outs[rows[k - 1]][layer])
            outs.append(out[layer])
        return ins, outs

    def finish(self) -> None:
        """After the pass: each chained sequence's last row's states become live, and the
        state after each row is kept at its position (for a rollback)."""
        for st, rows in self._chains.values():
            if len(rows) < 2:
                continue
            st.keep_verified({self.starts[b] + 1: self._outs[b] for b in rows})
            last = self._outs[rows[-1]]
            for i, named in last.items():
                for name, a in named.items():
                    st.layers[i][name][...] = a
