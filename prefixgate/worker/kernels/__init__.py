"""The worker's kernels. Each has a torch reference path elsewhere; the kernels are
optional and imported only when used.

  csrc/                       the CPU kernel library's C: pg_kernels.h (its ABI, the one
                              place each signature is written), pool.c (thread pool),
                              quant.c, decode_attention.c, decode_layers.c
  cbuild.py                   builds (or finds prebuilt) that library, binds its ABI
  cpu_quant.py                Q4_1 / Q8_0 products and dequantization (csrc/quant.c)
  cpu_decode.py               paged decode attention on the CPU (csrc/decode_attention.c)
  cpu_llama.py                a whole q4_1 Llama decode step in one call (csrc/decode_layers.c)
  paged_attention_triton.py   paged attention for GPUs (Triton)
  reindex_triton.py           KV re-rotation for GPUs (Triton)
"""
