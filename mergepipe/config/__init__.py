"""mergekit-style YAML configs: parse, resolve into a plan, export."""
