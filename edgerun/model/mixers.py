"""The recurrent token mixers by kind (ModelSpec.layer_mixers), built for one layer."""

from __future__ import annotations

from collections.abc import Callable

from edgerun.arch.spec import ModelSpec
from edgerun.errors import UnsupportedError
from edgerun.model.deltanet import DeltaNet
from edgerun.model.mamba2 import Mamba2
from edgerun.model.shortconv import ShortConv
from edgerun.model.state_cache import RecurrentMixer
from edgerun.model.weights import WeightStore

# kind -> constructor(spec, store, layer, source); its state layout: state_cache.STATE_SHAPES
MIXER_KINDS: dict[str, Callable[[ModelSpec, WeightStore, int, str], RecurrentMixer]] = {
    "shortconv": ShortConv,
    "deltanet": DeltaNet,
    "mamba2": Mamba2,
}


def build_mixer(spec: ModelSpec, store: WeightStore, i: int, source: str) -> RecurrentMixer:
    """Layer i's recurrent mixer."""
    kind = spec.mixer(i)
    make = MIXER_KINDS.get(kind)
    if make is None:
        raise UnsupportedError(f"{source}: layer {i}'s token mixer '{kind}' is not supported")
    return make(spec, store, i, source)
