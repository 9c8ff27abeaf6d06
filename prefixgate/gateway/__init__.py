"""Gateway: Chat gRPC service, tokenizer/template, worker pool, routing. Never imports torch."""
