"""Serving formats for trained draft heads."""
