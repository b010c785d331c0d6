"""Backend test cases we do not run, each with its reason. Patterns are regexes on test names."""

from __future__ import annotations

# pattern -> why it is excluded
EXCLUSIONS: dict[str, str] = {}

EXCLUDED = list(EXCLUSIONS)
