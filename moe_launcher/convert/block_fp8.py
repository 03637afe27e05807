"""Block-wise FP8 checkpoints (DeepSeek-V3's and Kimi K2's releases: config.json's
`quantization_config` {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]}),
read as the full-precision weights they stand for.

Such a checkpoint keeps each quantized weight `W` as float8_e4m3 next to `W_scale_inv`, one
float per block of weight_block_size (rows x columns) of `W`, the last block of a row or
column cut short where the block size does not divide it (DeepSeek-V3's
kv_a_proj_with_mqa: 576 rows, 4.5 blocks of 128). The weight is `W` times its block's scale
(DeepSeek-V3's README_WEIGHTS.md; its fp8_cast_bf16.py and transformers' FineGrainedFP8
dequantize so), cast to config.json's dtype. Tensors without a scale (embedding, output head,
norms, routers) are stored in that dtype already.

export-hf --fp8-weight-block-size writes such a checkpoint: the weights DeepSeek-V3's release
stores as FP8 (`stored_as_fp8`), quantized block by block as transformers' FP8 quantizer does
(each block's largest magnitude becomes FP8's largest, 448), the rest in full precision.
"""

from __future__ import annotations

import dataclasses
import math
import re

import torch

from .errors import ConvertError
from .hf_files import SAFETENSORS_DTYPES

FP8 = SAFETENSORS_DTYPES[torch.float8_e4m3fn]  # safetensors' name of it, "F8_E4M3"
SCALE_SUFFIX = "_scale_inv"
_SCALE_DTYPES = ("F32", "BF16")
_FP8_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448

# The megatron parameters whose HF tensors a block-wise FP8 release stores as FP8: the
# projections of each decoder layer's attention and MLP (its experts and shared experts too,
# an MTP layer's decoder layer too). Not the embedding, output head, norms, routers, Qwen's
# shared-expert gate or an MTP layer's eh_proj: DeepSeek-V3's release keeps those in bf16.
_FP8_PARAMETER = re.compile(r".*\.(self_attention|mlp)\.(.+\.)?linear_\w+\.weight")


def stored_as_fp8(megatron_name: str) -> bool:
    return _FP8_PARAMETER.fullmatch(megatron_name) is not None


@dataclasses.dataclass(frozen=True)
class BlockFP8:
    block: tuple[int, int]  # weight_block_size: rows, columns

    @staticmethod
    def scale_of(name: str) -> str:
        return name + SCALE_SUFFIX

    def scale_shape(self, shape: tuple[int, ...]) -> tuple[int, int]:
        return tuple(math.ceil(size / block) for size, block in zip(shape, self.block))

    def check(self, name: str, found: tuple[tuple[int, ...], str],
              scale: tuple[tuple[int, ...], str] | None) -> None:
        """A weight stored as FP8 has its scales, one per block, in a float dtype."""
        if scale is None:
            raise ConvertError(f"{name} is {FP8} without {self.scale_of(name)}: its block scales "
                               "are missing; fix: download the model again")
        shape = self.scale_shape(found[0])
        if len(found[0]) != 2 or scale[0] != shape or scale[1] not in _SCALE_DTYPES:
            raise ConvertError(f"{self.scale_of(name)} is {scale[1]} {scale[0]}, but a "
                               f"{found[0]} weight in blocks of {list(self.block)} (config.json's "
                               f"weight_block_size) has {shape} float scales")

    def dequantize(self, weight: torch.Tensor, scale: torch.Tensor,
                   dtype: torch.dtype) -> torch.Tensor:
        rows, columns = weight.shape
        per_element = scale.float().repeat_interleave(self.block[0], dim=0)[:rows] \
            .repeat_interleave(self.block[1], dim=1)[:, :columns]
        return (weight.float() * per_element).to(dtype)

    def quantize(self, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`weight` as float8_e4m3fn and its fp32 scales, one a block: each block multiplied by
        448 over its largest magnitude (an all-zero block by 1), the scale stored as the
        inverse of that factor, the way transformers' FP8 quantizer computes them (its
        Fp8Quantize). Blocks cut short at the last rows or columns are quantized as they are
        (transformers leaves such a weight unquantized; DeepSeek-V3's release has them)."""
        rows, columns = weight.shape
        grid = self.scale_shape(weight.shape)
        full = weight.new_zeros(grid[0] * self.block[0], grid[1] * self.block[1],
                                dtype=torch.float32)
        full[:rows, :columns] = weight  # zeros do not change a block's largest magnitude
        blocks = full.view(grid[0], self.block[0], grid[1], self.block[1])
        largest = blocks.abs().amax(dim=(1, 3))
        factor = torch.where(largest > 0, _FP8_MAX / torch.where(largest > 0, largest, 1.0), 1.0)
        quantized = (blocks * factor[:, None, :, None]).clamp(-_FP8_MAX, _FP8_MAX) \
            .to(torch.float8_e4m3fn).view(full.shape)[:rows, :columns].contiguous()
        return quantized, 1.0 / factor

    def quantization_config(self, not_fp8: list[str]) -> dict:
        """config.json's quantization_config for a checkpoint whose modules `not_fp8` keep
        their full-precision weights (transformers would otherwise load them as FP8 layers)."""
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                "weight_block_size": list(self.block), "modules_to_not_convert": not_fp8}


def block_fp8_of(quantization) -> BlockFP8 | None:
    """The block-wise FP8 scheme of a checkpoint whose config.json has this
    quantization_config, None for none; any other quantization is refused (its weights are not
    what the model computes with)."""
    if not quantization:
        return None
    if not isinstance(quantization, dict):
        quantization = quantization.to_dict()
    method, fmt = quantization.get("quant_method"), quantization.get("fmt", "e4m3")
    block = quantization.get("weight_block_size")
    if method != "fp8" or fmt != "e4m3" or not block or len(block) != 2:
        raise ConvertError(f"config.json's quantization_config (quant_method {method!r}, fmt "
                           f"{fmt!r}, weight_block_size {block!r}) is not read here: import-hf "
                           "dequantizes block-wise FP8 (quant_method 'fp8', fmt 'e4m3', two "
                           "block sizes: DeepSeek-V3's, Kimi K2's); fix: a full-precision "
                           "(bf16) copy of the model")
    return BlockFP8((int(block[0]), int(block[1])))
