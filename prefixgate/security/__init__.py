"""Who may do what (torch-free).

  auth      bearer tokens, tenants and namespaces, the internal and peer credentials
  identity  per-worker Ed25519 keys: signed registrations, ownership, leave; bounded sequences
  tickets   pull tickets: which receiver may read which chain from which holder
  kv_pages  page digests: pulled KV pages tied to what their holder recorded
  local     fresh local credentials for `prefixgate up --secure`
"""
