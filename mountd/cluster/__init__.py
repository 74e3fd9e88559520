"""Membership, ownership and heartbeats, and the peer tier."""
