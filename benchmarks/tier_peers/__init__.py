"""Peers' in-memory checkpoint tiers, measured like :mod:`benchmarks.memory_tier` (one per module)."""
