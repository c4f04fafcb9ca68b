"""omni-cache."""
