"""Runtime weight formats for linears (bf16, int8, int4, GGUF int4, Q5_0, IQ4, Q6_K and Q8_0 blocks as they are), the
block Hadamard rotation that makes int4 lose less, and the module swap that puts them in a model.

    from superslm.quant import quantize_linears
    quantize_linears(model.net, body="int4", head="int8", group=128, rotate=True, seed=0)

See docs/quantization.md.
"""

from superslm.kernels.hadamard import Rotation, fwht, random_signs, rotate_activation, rotate_weight, unrotate_weight
from superslm.quant.base import FORMATS, LinearFormat, dequantize_gguf, format_class, load_linear, register_format
from superslm.quant.dense import Bf16Linear, Int8Linear
from superslm.quant.gguf_map import NEAREST, ConcatLinear, linear_from_gguf, nearest_format
from superslm.quant.int4 import GGUFInt4Linear, Int4Linear
from superslm.quant.int5 import GGUFInt5Linear
from superslm.quant.iq4 import GGUFIQ4Linear
from superslm.quant.q6k import GGUFQ6KLinear
from superslm.quant.q80 import GGUFQ80Linear
from superslm.quant.swap import linear_summary, quantize_from_source, quantize_linears, row_permutation

__all__ = [
    "FORMATS", "NEAREST", "Bf16Linear", "ConcatLinear", "GGUFInt4Linear", "GGUFInt5Linear", "GGUFIQ4Linear",
    "GGUFQ6KLinear", "GGUFQ80Linear",
    "Int4Linear", "Int8Linear", "LinearFormat", "Rotation", "dequantize_gguf", "format_class", "fwht",
    "linear_from_gguf", "linear_summary", "load_linear", "nearest_format", "quantize_from_source", "quantize_linears",
    "random_signs", "register_format", "rotate_activation", "rotate_weight", "row_permutation", "unrotate_weight",
]  # fmt: skip
