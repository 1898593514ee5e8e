"""MXFP8 quantize kernels: the general 32-row-set kernel and its host dispatch (``quantize``),
the bf16-words kernel for a columnwise direction (``words``) and their tile configs
(``configs``)."""
