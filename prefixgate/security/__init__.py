"""Who may do what (torch-free).

  auth      bearer tokens, tenants and namespaces, the internal credential
  identity  worker keyrings: signed registrations, signed ownership batches
  local     fresh local credentials for `prefixgate up --secure`
"""
