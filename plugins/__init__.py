"""The registry of model families.

``load_model(path)`` reads the checkpoint's ``config.json`` and asks the registered families, in
``claim_order``, whether they claim it: third-party families first (a package that registers a
family means it for its configs, even for configs a built-in family would also take), then the
built-in ones from the most specific to the most general: ``native`` (an exact architecture
string), then ``hf`` (any config with ``architectures`` or ``model_type``). Families register
with ``register``; third-party packages add theirs through the ``kiln.plugins`` entry-point
group (each entry point names a ``ModelFamily`` instance or a zero-argument callable returning
one). ``FAMILIES`` is a ``kiln.registry.Registry``, the shape the targets and the precision kinds
share.

``config_spec(path)`` is the spec a checkpoint's config alone gives (no weight read), from the
families that can tell it: what an export checks its options against before loading.

Nothing is imported until the registry is first asked (``families``, ``claim_order``,
``load_model``): ``import kiln.plugins`` (which ``kiln.plugins.base`` implies) stays cheap, so
the CLI can read manifests and reject bad flags without importing torch.
"""

from __future__ import annotations

from importlib import resources
from pathlib import Path

from kiln.errors import CheckpointError
from kiln.plugins.base import DecoderSpec, LoadedModel, ModelFamily
from kiln.plugins.files import read_config, refuse_outside_links
from kiln.plugins.hub_cache import cached_snapshot, looks_like_repo_id
from kiln.registry import Registry

__all__ = [
    "DecoderSpec",
    "LoadedModel",
    "ModelFamily",
    "FAMILIES",
    "register",
    "families",
    "family_rows",
    "claim_order",
    "read_config",
    "resolve_checkpoint",
    "demo_heldout",
    "config_spec",
    "load_model",
    "DEMO",
]

DEMO = "demo"


def _family(obj: object) -> ModelFamily | None:
    """An entry point's ``ModelFamily`` instance, or what its zero-argument callable returns; None: neither."""
    if not isinstance(obj, ModelFamily) and callable(obj):
        try:
            obj = obj()
        except Exception:  # third-party code: any failure means "not a family factory"
            return None
    return obj if isinstance(obj, ModelFamily) else None


# most specific claim first; hf takes any Hugging Face-style config
FAMILIES: Registry[ModelFamily] = Registry(
    "ModelFamily",
    "kiln.plugins",
    {"native": "kiln.plugins.native:NATIVE", "hf": "kiln.plugins.hf:HF"},
    _family,
    named=False,  # an entry point's name may differ from its family's
    error=CheckpointError,
)


def register(family: ModelFamily) -> ModelFamily:
    """Add a family; a second family under the same name is a programming error."""
    FAMILIES.register(family.name, family)
    return family


def families() -> list[ModelFamily]:
    """Every registered family (built in and from entry points), in name order: what ``kiln plugins`` lists."""
    return sorted(FAMILIES.all(), key=lambda family: family.name)


# the rows of the last families ``family_rows`` walked, with those families (held: ids stay theirs)
_ROWS: tuple[list[ModelFamily], tuple[DecoderSpec, ...]] = ([], ())


def family_rows() -> tuple[DecoderSpec, ...]:
    """Every registered family's rows (``ModelFamily.specs``; a family without it has none), in
    ``families``' order: what the onnx target's refusals name as proved. Walked once per set of
    registered families (building every row is most of ``kiln plugins --json``'s time otherwise:
    each refused cell named the proved ones again)."""
    global _ROWS
    found = families()
    walked, rows = _ROWS
    if len(walked) != len(found) or any(a is not b for a, b in zip(walked, found, strict=True)):
        rows = tuple(spec for family in found if callable(specs := getattr(family, "specs", None)) for spec in specs())
        _ROWS = (found, rows)
    return rows


def claim_order() -> list[ModelFamily]:
    """The order ``load_model`` asks families: third-party ones (in name order), then the built-ins."""
    added = (FAMILIES.get(name) for name in FAMILIES.names() if name not in FAMILIES.builtins())
    third_party = sorted(added, key=lambda family: family.name)
    return third_party + [FAMILIES.get(name) for name in FAMILIES.builtins()]


def resolve_checkpoint(model: str | Path) -> Path:
    """``"demo"`` is the bundled demo checkpoint; an existing path is itself; ``ORG/NAME`` that is no
    path is a Hugging Face repo id, taken from the local Hugging Face cache (never downloaded)."""
    if str(model) == DEMO:
        path = Path(str(resources.files("kiln.demo") / "checkpoint"))
        if not (path / "config.json").is_file():
            raise CheckpointError(f"the bundled demo checkpoint is missing at {path}; reinstall kiln")
        return path
    path = Path(model)
    if path.exists():
        return path
    if looks_like_repo_id(str(model)):
        return cached_snapshot(str(model))
    raise CheckpointError(f"{path}: no such checkpoint file or directory")


def _claim(model: str | Path) -> tuple[Path, ModelFamily]:
    """The checkpoint's path (its links checked: nothing outside it is read) and the family that claims it."""
    path = resolve_checkpoint(model)
    refuse_outside_links(path)
    config = read_config(path)
    for family in claim_order():
        if family.claims(config):
            return path, family
    arch = config.get("architecture", config.get("architectures", config.get("model_type", "<none>")))
    names = ", ".join(f.name for f in families())
    raise CheckpointError(f"{path}: unknown architecture {arch!r}; supported families: {names}")


def config_spec(model: str | Path) -> DecoderSpec | None:
    """The spec the checkpoint's config gives, its values validated, before any weight is read;
    None when its family cannot tell (a family without ``config_spec``)."""
    path, family = _claim(model)
    read = getattr(family, "config_spec", None)
    spec: DecoderSpec | None = read(path) if callable(read) else None
    return spec


def demo_heldout(loaded: LoadedModel) -> Path | None:
    """The bundled demo's held-out text, when ``loaded`` is the bundled demo checkpoint (quality's
    text for the demo, and calibration data ``kiln check`` may read without being named)."""
    demo = resolve_checkpoint(DEMO)
    heldout = demo / "heldout.txt"
    return heldout if loaded.source.resolve() == demo.resolve() and heldout.is_file() else None


def load_model(model: str | Path) -> LoadedModel:
    """Find the family that claims the checkpoint and load it."""
    path, family = _claim(model)
    return family.load(path)
