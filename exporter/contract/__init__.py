"""The I/O contract of kiln's graphs: names, dims and the step loop that carries the KV cache."""

from __future__ import annotations
