"""Code every kvfleet service shares: the gRPC server scaffold, TLS and tokens, tracing setup,
Prometheus helpers. It imports no service and no client code."""
