"""Manifests: build, hash and verify merge manifests; lineage."""
