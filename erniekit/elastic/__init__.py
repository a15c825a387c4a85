"""Elastic sub-models in one place (docs/elastic.md): the sub-model specs, applying and extracting
them, the training rule (submodels), and scoring every choice of a trained model (report)."""
