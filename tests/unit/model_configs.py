"""Small synthetic model shapes the engine tests share (weights from tiny_weights with a seed)."""

from kvfleet_models.config import LlamaConfig

# Grouped-query attention: 4 query heads over 2 kv heads.
GQA_CFG = LlamaConfig(
    name="tiny-gqa",
    vocab_size=48,
    hidden_size=32,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    intermediate_size=64,
    max_position=128,
    rope_theta=500.0,
)
