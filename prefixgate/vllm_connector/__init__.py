"""prefixgate's KV connector for vLLM: vLLM servers pull a cached prefix from another worker
(a vLLM server with this connector, or a prefixgate worker) over prefixgate's block
transfer (WorkerService.ExportBlocks), and keep what they compute exportable.

vLLM loads it through its public KV connector API (`KVConnectorBase_V1`), never patched:

  vllm serve MODEL ... --kv-transfer-config '{"kv_connector": "PrefixgateConnector",
      "kv_connector_module_path": "prefixgate.vllm_connector.connector",
      "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
      "kv_connector_extra_config": {"export_port": 7100}}'

Modules, one job each:
  params.py     what a request tells the connector (`kv_transfer_params["prefixgate"]`) and
                the `--kv-transfer-config` document; torch-free (the gateway's side uses it)
  pages.py      vLLM's paged KV cache (CPU backend) <-> prefixgate's wire pages (torch)
  store.py      the bounded host store of computed blocks, keyed by prefixgate block hashes
  export.py     the ExportBlocks server over that store, and the pulling client
  shift.py      shifted loads (context overflow): the model's RoPE, the layout held
                furthest, kept tokens' K/V gathered and rotated back (torch)
  connector.py  the `KVConnectorBase_V1` subclass vLLM instantiates (torch, vLLM)

Only params.py may be imported outside vLLM's environment: the others import torch or vLLM.
"""
