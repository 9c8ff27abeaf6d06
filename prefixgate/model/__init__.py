"""The model as the gateway sees it: which model, its tokenizer and its prompt shape
(torch-free; the worker's model code is in worker/).

  catalog    model names to a directory with tokenizer, template, config (ModelSpec)
  tokenizer  chat template + tokenizer.json, exactly as transformers renders them
  overflow   which tokens of an over-long chat prompt to drop (context overflow)
  detokenizer  incremental detokenization with stop strings (workers' replies, and the
             gateway's seam when it resumes a reply on another worker)
"""
