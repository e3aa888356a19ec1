"""lm-eval task configs of quantkit's local tasks (the YAML files) and their datasets (local.py)."""
