"""Ray jobs: each reads a YAML config, builds Ray objects and calls into ``swiftkv``."""
