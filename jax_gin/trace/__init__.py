"""`python -m jax_gin.trace merge a.json b.json -o all.json` (jax_gin/_trace.py). The context
manager is jax_gin.trace(path)."""
