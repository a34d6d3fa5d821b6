"""Configuration of the native PLE decoder family (saved as ``config.json``)."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiln.errors import ConfigError
from kiln.jsonfile import read_json_object
from kiln.plugins.base import dim_error

__all__ = [
    "MLPKind",
    "NormKind",
    "NormPosition",
    "PositionKind",
    "PLEPlacement",
    "PLEConfig",
    "NativeConfig",
    "ARCHITECTURE",
]

ARCHITECTURE = "kiln-ple-decoder"


class MLPKind(str, enum.Enum):
    GELU = "gelu"
    SWIGLU = "swiglu"


class NormKind(str, enum.Enum):
    LAYERNORM = "layernorm"
    RMSNORM = "rmsnorm"


class NormPosition(str, enum.Enum):
    PRE = "pre"
    POST = "post"


class PositionKind(str, enum.Enum):
    NONE = "none"
    LEARNED = "learned"
    ROPE = "rope"


class PLEPlacement(str, enum.Enum):
    """Where the PLE residual sub-layer sits in the decoder layer."""

    BEFORE_ATTENTION = "before_attention"
    RESIDUAL = "residual"  # the seed's default: after (cross-)attention, before the MLP
    AFTER_MLP = "after_mlp"


@dataclasses.dataclass(frozen=True)
class PLEConfig:
    """Position-aware linear embedding: ``x * (1 + g(a_p)) + b_p``."""

    enabled: bool = True
    max_positions: int = 512  # rows of the position table
    placement: PLEPlacement = PLEPlacement.RESIDUAL
    bounded: bool = False  # g = tanh instead of identity
    projection: bool = False  # E[p] @ W + c instead of E[p]


@dataclasses.dataclass(frozen=True)
class NativeConfig:
    """The decoder of the seed documents. Every field is validated on construction."""

    vocab_size: int
    d_model: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    d_ff: int
    mlp: MLPKind = MLPKind.SWIGLU
    norm: NormKind = NormKind.RMSNORM
    norm_eps: float = 1e-5
    norm_position: NormPosition = NormPosition.PRE
    position: PositionKind = PositionKind.ROPE
    rope_theta: float = 10000.0
    ple: PLEConfig = dataclasses.field(default_factory=PLEConfig)
    cross_attention: bool = False  # attend to encoder_hidden_states [B, E, d_model] after self-attention
    tie_embeddings: bool = True
    bias: bool = False
    max_context: int = 512
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "d_ff", "max_context"):
            if problem := dim_error(name, getattr(self, name)):
                raise ConfigError(problem)
        if self.d_model % self.n_heads:
            raise ConfigError(f"d_model ({self.d_model}) must be divisible by n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ConfigError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads ({self.n_kv_heads})")
        if not (isinstance(self.norm_eps, float) and 0.0 < self.norm_eps < 1.0):
            raise ConfigError(f"norm_eps must be a float in (0, 1), found {self.norm_eps!r}")
        if self.position is PositionKind.ROPE:
            if self.head_dim % 2:
                raise ConfigError(f"rope needs an even head_dim, found {self.head_dim}")
            if not (isinstance(self.rope_theta, float) and self.rope_theta > 1.0):
                raise ConfigError(f"rope_theta must be a float > 1, found {self.rope_theta!r}")
        if self.ple.enabled and (problem := dim_error("ple.max_positions", self.ple.max_positions)):
            raise ConfigError(problem)
        for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
            value = getattr(self, name)
            if value is not None and not (isinstance(value, int) and 0 <= value < self.vocab_size):
                raise ConfigError(f"{name} must be a token id in [0, {self.vocab_size}), found {value!r}")

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict with enum values as strings; ``architecture`` names the family."""

        def plain(value: Any) -> Any:
            return value.value if isinstance(value, enum.Enum) else value

        out: dict[str, Any] = {"architecture": ARCHITECTURE}
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, PLEConfig):
                out[field.name] = {f.name: plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
            else:
                out[field.name] = plain(value)
        return out

    @classmethod
    def from_dict(cls, raw: Mapping[str, Any]) -> NativeConfig:
        """Build and validate a config; every unknown or mistyped key is a ``ConfigError``."""
        data = {k: v for k, v in raw.items() if k != "architecture"}
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise ConfigError(f"unknown config keys {unknown}; known keys are {sorted(known)}")
        missing = sorted(f.name for f in dataclasses.fields(cls) if f.name not in data and _required(f))
        if missing:
            raise ConfigError(f"config is missing required keys {missing}")
        ple_raw = data.get("ple", {})
        if not isinstance(ple_raw, Mapping):
            raise ConfigError(f"ple must be an object, found {ple_raw!r}")
        ple_known = {f.name for f in dataclasses.fields(PLEConfig)}
        ple_unknown = sorted(set(ple_raw) - ple_known)
        if ple_unknown:
            raise ConfigError(f"unknown ple keys {ple_unknown}; known keys are {sorted(ple_known)}")
        ple = dict(ple_raw)
        if "placement" in ple:
            ple["placement"] = _enum(PLEPlacement, "ple.placement", ple["placement"])
        for flag in ("enabled", "bounded", "projection"):
            if flag in ple and not isinstance(ple[flag], bool):
                raise ConfigError(f"ple.{flag} must be true or false, found {ple[flag]!r}")
        data["ple"] = PLEConfig(**ple)
        for name, kind in (
            ("mlp", MLPKind),
            ("norm", NormKind),
            ("norm_position", NormPosition),
            ("position", PositionKind),
        ):
            if name in data:
                data[name] = _enum(kind, name, data[name])
        for flag in ("tie_embeddings", "bias", "cross_attention"):
            if flag in data and not isinstance(data[flag], bool):
                raise ConfigError(f"{flag} must be true or false, found {data[flag]!r}")
        for name in ("norm_eps", "rope_theta"):
            if isinstance(data.get(name), int) and not isinstance(data.get(name), bool):
                data[name] = float(data[name])
        return cls(**data)

    @classmethod
    def load(cls, path: Path) -> NativeConfig:
        raw = read_json_object(path, ConfigError, f"{path}: config file not found")
        try:
            return cls.from_dict(raw)
        except ConfigError as exc:
            raise ConfigError(f"{path}: {exc.args[0]}") from None

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def _required(field: dataclasses.Field[Any]) -> bool:
    return field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING


def _enum(kind: type[enum.Enum], name: str, value: Any) -> Any:
    try:
        return kind(value)
    except ValueError:
        choices = ", ".join(str(m.value) for m in kind)
        raise ConfigError(f"{name} must be one of {choices}, found {value!r}") from None
