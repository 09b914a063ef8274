"""Why a sequence axis (`distribution.sequence`) does not run on PyTorch:
what torch's own context parallelism,
`torch.distributed.tensor.experimental.context_parallel`, would need to take
Keras' attention, said for the installed torch.

That context manager replaces `torch.nn.functional.scaled_dot_product_attention`
(SDPA) with a wrapper that makes the query, key and value DTensors split along
their third dimension, and runs ring attention for three SDPA kernels only:
`_scaled_dot_product_flash_attention`, `_scaled_dot_product_efficient_attention`
and `_scaled_dot_product_cudnn_attention`, which are CUDA kernels. On CPU, SDPA
runs `_scaled_dot_product_flash_attention_for_cpu`, which DTensor has no sharding
strategy for (`NotImplementedError`), or, under
`sdpa_kernel(SDPBackend.MATH)`, its math kernel, whose causal mask is a plain
tensor added to a DTensor (`RuntimeError`). The ring kernels refuse an
attention mask (`attn_bias is not supported yet`). Keras' `MultiHeadAttention`
calls SDPA (looked up when it is called, so the replacement is seen) only
without dropout and without returned scores; it passes `is_causal=True` and no
mask only for `use_causal_mask=True` with no other mask.
"""

from __future__ import annotations

import torch


def why_not() -> str:
    """The sentences of `distribution.sequence`'s `NotImplementedError` that
    say what torch's `context_parallel` lacks for Keras' attention, naming the
    installed torch and whether it sees CUDA."""
    cuda = "with" if torch.cuda.is_available() else "without"
    return (
        "PyTorch's own `context_parallel` "
        f"(torch.distributed.tensor.experimental; torch {torch.__version__} "
        f"here, {cuda} CUDA) replaces "
        "`torch.nn.functional.scaled_dot_product_attention` and has ring "
        "attention only for its CUDA kernels (flash, memory-efficient, "
        "cuDNN). On CPU that function runs "
        "`_scaled_dot_product_flash_attention_for_cpu`, which DTensor has no "
        "sharding strategy for, or its math kernel, which fails with "
        "`is_causal=True`; on CUDA the ring kernels refuse `attn_mask`, so they "
        "would take only Keras' MultiHeadAttention called with "
        "`use_causal_mask=True`, no other mask, no dropout and no returned "
        "scores, and keras_dist does not hand those calls to it. "
    )
