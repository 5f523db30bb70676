"""sinkjax: sink-aware attention in JAX/Flax."""
__version__ = "0.1.0"
