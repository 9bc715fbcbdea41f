"""Block quantization formats: layouts, reference dequantizers, quantizers."""

from edgerun.quant.formats import BLOCK_LAYOUT, QuantTensor, QuantType

__all__ = ["BLOCK_LAYOUT", "QuantTensor", "QuantType"]
