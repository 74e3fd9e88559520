"""Making and checking digests: ``quiver digest create|show|verify|diff``."""
