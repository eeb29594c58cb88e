"""Root conftest: makes the repository importable for tests run from a checkout."""
