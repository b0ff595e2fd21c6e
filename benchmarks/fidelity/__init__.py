"""Merge fidelity study: a trained tiny-LM checkpoint family, its tasks, and the budget study."""
