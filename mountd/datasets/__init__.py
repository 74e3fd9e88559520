"""Registered datasets: their registrations, digests, trees, view pools and memory."""
