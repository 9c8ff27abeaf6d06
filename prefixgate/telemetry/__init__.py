"""What prefixgate processes report about themselves.

  logs             text or JSON-lines logging, one handler per process
  metrics_export   Prometheus exposition with a model_name label on every series
  trace_recorder   served turns written as a replayable trace (--record-trace)
"""
