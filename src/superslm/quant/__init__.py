"""Runtime weight formats for linears (bf16, int8, int4, GGUF int4 blocks as they are) and the block
Hadamard rotation that makes int4 lose less. See docs/quantization.md."""

from superslm.quant.base import FORMATS, LinearFormat, format_class, load_linear, register_format
from superslm.quant.dense import Bf16Linear, Int8Linear
from superslm.quant.hadamard import Rotation, fwht, rotate_activation, rotate_weight, unrotate_weight
from superslm.quant.int4 import GGUFInt4Linear, Int4Linear

__all__ = [
    "FORMATS", "Bf16Linear", "GGUFInt4Linear", "Int4Linear", "Int8Linear", "LinearFormat", "Rotation",
    "format_class", "fwht", "load_linear", "register_format", "rotate_activation", "rotate_weight",
    "unrotate_weight",
]
