"""Serving engines that are not prefixgate's own, behind the Worker API.

  vllm.py          a vLLM server as a prefixgate worker (`prefixgate worker --engine vllm`,
                   or held in the gateway's process with `--vllm-worker`)
  vllm_http.py     its OpenAI-compatible HTTP API (completions, tokenizer, metrics)
  vllm_events.py   its KV cache events mapped onto prefixgate's block hashes (no I/O)
  vllm_stream.py   following its ZMQ event publisher

Held in the gateway's process, an engine's Worker API service is called directly
(workerapi/client.py `InProcessWorkerClient`).
"""
