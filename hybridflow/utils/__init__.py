"""Small utilities shared across layers (no imports of workers or trainer).

May import: nothing of hybridflow (the first tier).
"""
