"""Who may do what (torch-free).

  auth      bearer tokens, tenants and namespaces, the internal credential
  identity  per-worker Ed25519 keys: signed registrations, ownership, leave; bounded sequences
  local     fresh local credentials for `prefixgate up --secure`
"""
