"""Planner: budget, candidate blocks, selection strategies, bounds and EXPLAIN."""
