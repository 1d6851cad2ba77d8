"""Small utilities shared across layers (no imports of workers or trainer)."""
