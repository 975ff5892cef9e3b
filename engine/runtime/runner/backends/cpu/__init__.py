"""The CPU backend (``backend.py``) and its kernels; imported only where ``choose_backend`` picks it."""
