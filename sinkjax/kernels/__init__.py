"""Attention kernels with a differentiable log-sum-exp, and the dense layers' dot (`dense`).

Know nothing of models."""
from sinkjax.kernels.blocks import BlockSizes
from sinkjax.kernels.flash import IMPLS, default_impl, flash_attention
from sinkjax.kernels.reference import attention_mask, attention_weights

__all__ = ["IMPLS", "BlockSizes", "default_impl", "flash_attention", "attention_mask", "attention_weights"]
