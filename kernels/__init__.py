"""speccal.kernels: paged attention, in-graph verify input updates and decode building blocks.

Public API lives in ``speccal.kernels.ops`` (validation + dispatch); pure-torch references in
``speccal.kernels.reference``; one Triton kernel per module (``paged_attention``,
``verify_tokens``, ``verify_metadata``, ``attention_tiling``, ``gemv``, ``rmsnorm``,
``rotary_kv``), imported only when a CUDA tensor needs them, so this package imports on a CPU
machine without triton.
"""
