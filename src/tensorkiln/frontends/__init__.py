"""Frontends turn models from training frameworks into the tensorkiln IR."""
