"""prefixgate: a conversational prefix-cache gateway for LLM serving.

Packages, one job each (see docs/architecture in ARCHITECTURE.md):
  radix/    block hashing and the radix tree; pure Python, no torch, no I/O
  gateway/  Chat gRPC service, tokenizer/template, routing; never imports torch
  worker/   model runner and Worker gRPC service (torch)
  bench/    `prefixgate bench ...` commands
  v1/       generated gRPC stubs of proto/prefixgate/v1 (do not edit)
"""

__version__ = "0.1.0"
