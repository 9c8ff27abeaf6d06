"""The torch engine: a paged KV engine with exact prefix reuse, implementing the Worker
API's `Engine` contract (`prefixgate.workerapi`, which serves it over gRPC). Nothing
outside the worker's own command line and benchmarks imports this package: engines/ and
emulate/ build on `prefixgate.workerapi` (tests/test_layering.py).

  engine.py           the engine loop: continuous batching over the paged pool
  scheduler.py        which sequences run and how many tokens each computes per step
  reuse.py            prefix hits, tails and shifted reuse (what is already computed)
  blocks.py           KV block acquisition: evict, allocate, preempt
  sequence.py         one sequence's state; prefix_cache.py the radix tree of its blocks
  kv_pool.py          the paged KV pool; paged_attention.py attention over it
  model_loader.py     weights and formats (float32, bfloat16, int8, q4_1)
  model_runner.py     one flat batch per step through the model
  reindex.py          RoPE re-rotation of cached K/V (context overflow)
  kv_transfer.py      the paged side of block transfer (workerapi/transfer.py)
  sampling.py         sampling and logprobs (detokenizing: model/detokenizer.py)
  kernels/            CPU kernels (C in kernels/csrc/) and GPU kernels (Triton)

scheduler.py, blocks.py, prefix_cache.py and sequence.py live here, not in the Worker
API, because they are this engine's parts: only the engine imports them, and each holds
the paged pool or a sampler (torch), directly or through another.
"""
