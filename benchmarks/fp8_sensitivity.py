"""Where fp8 E4M3 loses top-1 agreement on a trained model: kiln's ``--fp8`` numbers simulated in
PyTorch (every Linear but the LM head: input per tensor, scale = calibrated amax / 448, weight per
output channel, amax / 448, values clipped to +-448 and rounded to E4M3 by torch's float8 cast),
then the same with one group of Linears left float at a time (by kind, by layer), and with other
activation ranges (percentiles of |x|). A guide for ``--fp8-float``: the export itself is what is
measured (``accuracy.py``).

    python benchmarks/fp8_sensitivity.py --model CKPT [--windows 16] [--calib 32]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np
import torch
from tokenizers import Tokenizer
from torch import Tensor, nn

from kiln.plugins import load_model, resolve_checkpoint

FP8_MAX = 448.0


def fp8(x: Tensor, scale: Tensor) -> Tensor:
    s = scale.to(torch.float16).to(torch.float32)  # kiln's scales are fp16
    return (x / s).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).to(torch.float32) * s


@contextmanager
def quantized(
    model: nn.Module,
    ranges: dict[str, float],
    keep: Callable[[str], bool],
    weights: bool = True,
    activations: bool = True,
) -> Iterator[None]:
    saved, hooks = {}, []
    for name, mod in model.named_modules():
        if not isinstance(mod, nn.Linear) or name == "lm_head" or keep(name):
            continue
        if weights:
            saved[name] = mod.weight.data.clone()
            amax = mod.weight.data.abs().amax(dim=1, keepdim=True)  # [N, 1]: per output channel
            mod.weight.data = fp8(mod.weight.data, torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))
        if activations:
            scale = torch.tensor(ranges[name] / FP8_MAX)
            hooks.append(mod.register_forward_pre_hook(lambda _m, args, s=scale: (fp8(args[0], s),)))
    try:
        yield
    finally:
        for h in hooks:
            h.remove()
        for name, mod in model.named_modules():
            if name in saved:
                mod.weight.data = saved[name]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True)
    parser.add_argument(
        "--windows", type=int, default=16, help="evaluation windows of 256 tokens from the end of heldout.txt"
    )
    parser.add_argument(
        "--calib", type=int, default=32, help="calibration windows of 128 tokens from its start (kiln's default)"
    )
    args = parser.parse_args()
    torch.set_grad_enabled(False)
    ckpt = resolve_checkpoint(args.model)
    model = load_model(args.model).module.eval()
    ids = Tokenizer.from_file(str(ckpt / "tokenizer.json")).encode((ckpt / "heldout.txt").read_text()).ids

    def run(x: Tensor) -> Tensor:
        return model(x, torch.ones_like(x), torch.arange(x.shape[1])[None].expand(x.shape[0], -1))[0]

    absval: dict[str, list[Tensor]] = {}
    hooks = [
        m.register_forward_pre_hook(lambda _m, a, n=n: absval.setdefault(n, []).append(a[0].abs().flatten()))
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear)
    ]
    calib = torch.tensor(ids[: args.calib * 128]).view(args.calib, 128)
    for row in calib:
        run(row[None])
    for h in hooks:
        h.remove()
    values = {n: torch.cat(v) for n, v in absval.items()}
    ranges = {n: float(v.max()) for n, v in values.items()}

    tail = ids[len(ids) - args.windows * 256 :]
    windows = torch.tensor(tail).view(args.windows, 256)
    ref = torch.cat([run(w[None]).argmax(-1) for w in windows])

    def top1(r: dict[str, float] = ranges, keep: Callable[[str], bool] = lambda n: False, **kw: bool) -> float:
        with quantized(model, r, keep, **kw):
            got = torch.cat([run(w[None]).argmax(-1) for w in windows])
        return float((got == ref).float().mean())

    rows: dict[str, float] = {
        "all fp8 (max ranges)": top1(),
        "weights only": top1(activations=False),
        "activations only": top1(weights=False),
    }
    for p in (99.99, 99.999):
        r = {n: float(np.percentile(v.numpy(), p)) for n, v in values.items()}
        rows[f"activation ranges: percentile {p}"] = top1(r)
    kinds = {
        "q/k/v": ("q_proj", "k_proj", "v_proj"),
        "o_proj": ("o_proj",),
        "gate/fc1 (up)": ("gate", "fc1"),
        "fc2 (down)": ("fc2",),
    }
    for label, names in kinds.items():
        rows[f"float: every {label}"] = top1(keep=lambda n, names=names: n.rsplit(".", 1)[-1] in names)
    layers = len(model.layers)
    for i in range(layers):
        rows[f"float: layers.{i}"] = top1(keep=lambda n, i=i: n.startswith(f"layers.{i}."))
    best = max(range(layers), key=lambda i: rows[f"float: layers.{i}"])
    for label, names in kinds.items():  # which Linears of the most sensitive layer
        rows[f"float: layers.{best} {label}"] = top1(
            keep=lambda n, names=names: n.startswith(f"layers.{best}.") and n.rsplit(".", 1)[-1] in names
        )
    print(json.dumps({"windows": args.windows, "calib_windows": args.calib, "top1_agreement": rows}, indent=2))


if __name__ == "__main__":
    main()
