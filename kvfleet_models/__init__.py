"""Model files both the scheduler and the workers read: configs, GGUF and safetensors loaders,
the model registry, the tokenizer, the tiny synthetic model and the numpy reference. No torch."""
