"""Research helpers kept apart from the product: synthetic families, evaluation, the naive baseline."""
