"""kvfleet's OpenAI-compatible HTTP gateway: /v1/completions, /v1/chat/completions, /v1/models and
/health in front of the scheduler's public gRPC API."""
