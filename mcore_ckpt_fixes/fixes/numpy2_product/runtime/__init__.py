"""numpy2-product in a job: the probe and apply (core.py) and the NumPy the patched modules see (numpy_with_product.py)."""
