"""NVFP4 quantize kernels: the host dispatch and the amax pass (``quantize``), the general
tile kernel (``tiles``), the bf16-words kernel for 1×16 blocks (``words``, with the helpers
``_e2m1``, ``_lane_quad``, ``_rht_words``) and their tile configs (``configs``)."""
