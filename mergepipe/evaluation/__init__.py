"""Scoring models: task suites, perplexity, and the models and tokenizers they need (mergepipe evaluate,
recipe searches, the fidelity study)."""
