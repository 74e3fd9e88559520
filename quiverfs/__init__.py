"""Quiver: an informed, content-addressed SSD cache for deep-learning training data."""

__version__ = "0.1.0"
