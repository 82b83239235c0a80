"""Native kernels, one module per backend, registered against the ops they replace.

Each module is imported only when its backend is first used. Every kernel here is tested against
the portable implementation in ``tests/test_native.py``.
"""
