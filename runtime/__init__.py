"""Tools that run an export rather than write one: ``kiln generate``, ``kiln bench`` (with its
past-length sweep and memory roofline), and the feeds and directory readers they share."""

from __future__ import annotations
