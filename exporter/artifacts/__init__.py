"""The artifacts stage: the manifest, the staged output directory, verification of a written one."""

from __future__ import annotations
