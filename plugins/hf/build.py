"""The Hugging Face family's torch side: a checkpoint loaded through transformers and wrapped in
the decoder contract, its layer plan and meta template, and the tiny models of the tests
(imported only when a model is built: ``kiln plugins`` and the registry stay free of torch)."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import nn

from kiln.errors import CheckpointError
from kiln.plugins.base import DecoderSpec, LayerPlan, LoadedModel, non_finite
from kiln.plugins.files import checkpoint_tokenizer
from kiln.plugins.hf.config import read_spec, refuse
from kiln.plugins.hf.decoder import HFDecoder, HFSeq2Seq
from kiln.plugins.hf.moe import translations
from kiln.plugins.hf.multimodal import read_any_spec, refuse_wrapper, text_decoder, wrapped
from kiln.plugins.hf.seq2seq import SEQ2SEQ, SEQ2SEQ_TINY, read_seq2seq_spec, refuse_seq2seq
from kiln.plugins.hf.speech import SPEECH_TINY
from kiln.plugins.hf.tiny import TINY
from kiln.plugins.hf.weights import check_sizes, read_headers, refuse_loading_info
from kiln.plugins.hub_cache import HF_EXTRA

__all__ = ["config_spec", "load", "quiet", "read_config", "tiny_model", "tiny_transformers"]

FAMILY = "hf"


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise CheckpointError(f"Hugging Face checkpoints need transformers: {HF_EXTRA}") from None
    return transformers


@contextlib.contextmanager
def quiet(transformers: Any) -> Iterator[None]:
    """transformers' own logging and progress bars off (its load report, "Loading weights" bar
    and config notes), so an export prints only kiln's rows; what they would say kiln checks
    itself and says in one line. Restored afterwards."""
    logging = transformers.utils.logging
    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def read_config(transformers: Any, directory: Path, arch: str) -> Any:
    """The checkpoint's config as transformers reads it, its sizes and features checked
    (``refuse``): every refusal comes before any weight is read."""
    from huggingface_hub.errors import StrictDataclassError

    try:
        with quiet(transformers):
            config = transformers.AutoConfig.from_pretrained(directory, local_files_only=True)
    # a config's own arithmetic on its values (head_dim = hidden // heads with heads 0) fails as well
    except (
        StrictDataclassError,
        OSError,
        ValueError,
        TypeError,
        ArithmeticError,
        KeyError,
        AttributeError,
        IndexError,
    ) as exc:
        cause = exc.__cause__ if isinstance(exc, StrictDataclassError) and exc.__cause__ is not None else exc
        raise CheckpointError(
            f"{directory / 'config.json'}: transformers refuses this config ({' '.join(str(cause).split())})"
        ) from None
    _refuse(config, arch)
    return config


def config_spec(directory: Path, arch: str) -> DecoderSpec:
    """The spec of the checkpoint's config alone (no weight read)."""
    config = read_config(_transformers(), directory, arch)
    return read_seq2seq_spec(config, arch, FAMILY) if arch in SEQ2SEQ else read_any_spec(config, arch, FAMILY)


def load(path: Path, directory: Path, arch: str) -> LoadedModel:
    """The checkpoint in ``directory`` (architecture ``arch``) in its own dtype: config, tokenizer
    and the weights' headers checked before transformers builds the model."""
    weights = sorted(directory.glob("*.safetensors"))
    if not weights:
        raise CheckpointError(f"{directory}: no *.safetensors weights (kiln reads no pickled Hugging Face weights)")
    transformers = _transformers()
    config = read_config(transformers, directory, arch)
    tokenizer = checkpoint_tokenizer(directory)
    model_class = getattr(transformers, arch)
    with quiet(transformers):
        check_sizes(model_class, config, read_headers(directory), directory)
        try:
            model, info = model_class.from_pretrained(
                directory,
                config=config,
                local_files_only=True,
                use_safetensors=True,
                dtype="auto",
                attn_implementation="eager",
                output_loading_info=True,  # the checkpoint's dtype
            )
        except (OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"{directory}: transformers could not load it ({str(exc).splitlines()[0]})") from None
    refuse_loading_info(info, directory)
    for name, tensor in model.state_dict().items():
        if tensor.is_floating_point() and non_finite(tensor):
            raise CheckpointError(f"{directory}: {name} has non-finite values (NaN or Inf)")
    files = (directory / "config.json", *weights) + ((tokenizer,) if tokenizer else ())
    # beside model.onnx these make the export's onnx/ a directory Optimum's ORTModelForCausalLM loads
    # (not a multimodal wrapper's config.json: Optimum would load it as the wrapper, not its text decoder)
    serving = tuple(
        p
        for p in (directory / "config.json", directory / "generation_config.json")
        if p.is_file() and not (wrapped(arch) and p.name == "config.json")
    )
    return _loaded(model, arch, path, tokenizer, files, serving)


def tiny_model(case: str, seed: int, **overrides: Any) -> LoadedModel:
    """A tiny randomly initialised model of ``TINY[case]`` (for tests; no download), its config
    changed by ``overrides`` (``num_hidden_layers=4``); an architecture's name is its first case."""
    model = tiny_transformers(case, seed, **overrides)
    config: Any = model.config  # transformers' (untyped)
    arch = str(config.architectures[0])
    return _loaded(model, arch, Path(f"<tiny {arch}>"))


def tiny_transformers(case: str, seed: int, **overrides: Any) -> nn.Module:
    """``tiny_model``'s transformers model as transformers builds it (a multimodal case's
    wrapper, whole: what a test saves as a checkpoint)."""
    transformers = _transformers()
    torch.manual_seed(seed)
    cases = {**TINY, **SEQ2SEQ_TINY, **SPEECH_TINY}
    arch, make = cases[case] if case in cases else next(c for c in cases.values() if c[0] == case)
    config = make(transformers, **overrides)
    config.architectures = [arch]
    _refuse(config, arch)
    # eager attention, as load() uses: with SDPA, fully masked (left-padding) query rows differ
    # between PyTorch and the traced graph, and padded positions' keys with them
    model: nn.Module = (
        getattr(transformers, arch)._from_config(config, attn_implementation="eager").eval()
    )  # private: see _meta_template
    return model


def _refuse(config: Any, arch: str) -> None:
    if arch in SEQ2SEQ:
        refuse_seq2seq(config, arch)
    elif wrapped(arch):
        refuse_wrapper(config, arch)
    else:
        refuse(config, arch)


def _loaded(
    model: nn.Module,
    arch: str,
    source: Path,
    tokenizer: Path | None = None,
    files: tuple[Path, ...] = (),
    serving: tuple[Path, ...] = (),
) -> LoadedModel:
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    if arch in SEQ2SEQ:  # traced whole: its layer lists are the encoder's and the decoder's
        spec = dataclasses.replace(read_seq2seq_spec(model.config, arch, FAMILY), dtype=dtype)
        return LoadedModel(HFSeq2Seq(model).eval(), spec, source, tokenizer, files, serving_files=serving)
    part = None
    if wrapped(arch):  # its text decoder is what is exported; the wrapper's other modules go with it
        model, arch, part = text_decoder(model, arch)
    spec = dataclasses.replace(read_spec(model.config, arch, FAMILY), dtype=dtype, text_decoder_of=part)
    decoder = HFDecoder(model).eval()
    return LoadedModel(
        decoder,
        spec,
        source,
        tokenizer,
        files,
        layers=_layer_plan(model, arch),
        serving_files=serving,
        translations=translations(),
        decode_traced=decoder.decode_traced,
    )


def _scalars(layer: nn.Module) -> tuple[tuple[str, str, object], ...]:
    """The plain attributes of a layer's modules that its forward may read: what makes layers
    of one class compute differently (GPT-2's per-layer attention scale, SmolLM3's NoPE layers,
    a sliding window); ``layer_idx`` itself only indexes the cache, which the stamp renames."""
    return tuple(
        (path, name, value)
        for path, module in layer.named_modules()
        for name, value in sorted(vars(module).items())
        if isinstance(value, (int, float, str, bool, type(None)))
        and not name.startswith("_")
        and name not in ("layer_idx", "training")
    )


def _layer_plan(model: nn.Module, arch: str) -> LayerPlan | None:
    """The decoder layers are the one ``nn.ModuleList`` with a module per layer; layers of one
    class, parameter shapes, ``config.layer_types`` entry (sliding or full attention...) and plain
    attributes (``_scalars``) share a structure. The template is the model built from its config
    with fewer layers, on meta."""
    config: Any = model.config
    n_layers = int(config.num_hidden_layers)
    lists = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    lists = [
        (name, m) for name, m in lists if not any(name.startswith(f"{other}.") for other, _ in lists)
    ]  # not a list inside a layer (StableLM's per-head norms)
    if len(lists) != 1:
        return None
    path, layers = lists[0]
    kinds = list(getattr(config, "layer_types", None) or [None] * n_layers)
    signatures = tuple(
        (type(layer).__name__, tuple((n, tuple(t.shape)) for n, t in layer.state_dict().items()), kind, _scalars(layer))
        for layer, kind in zip(layers, kinds, strict=True)
    )
    return LayerPlan(f"model.{path}.{{}}", signatures, functools.partial(_meta_template, arch, config))


def _meta_template(arch: str, config: Any, n_layers: int) -> nn.Module:
    transformers = _transformers()
    template = copy.deepcopy(config)
    template.num_hidden_layers = n_layers
    # Mamba2's, and Bamba's (layer_types names its layers_block_type): from num_hidden_layers
    own = dict(getattr(template, "attribute_map", {})).get("layer_types", "layer_types")
    derived = isinstance(getattr(type(template), own, None), property)
    if getattr(template, "layer_types", None) and not derived:
        template.layer_types = list(template.layer_types)[:n_layers]
    with torch.device("meta"):
        # _from_config is private, but transformers has no public way to build a named class (``arch``,
        # not the Auto mapping's choice for the config) with an attention implementation and a dtype
        model = getattr(transformers, arch)._from_config(
            template, attn_implementation="eager", dtype=torch.float32
        )  # the graphs' dtype
    return HFDecoder(model.eval()).eval()
