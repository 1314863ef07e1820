"""safetensors -> sharded parameters. Each rank reads only its own slices (`get_slice`); in emulated
TP one process holds all C shards."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import safe_open
from torch import Tensor

from detaudit.backends.base import TPContext
from detaudit.config import ModelRef
from detaudit.errors import DetauditError


class ShardLoader:
    def __init__(self, path: Path, ctx: TPContext, device: torch.device) -> None:
        self.path = Path(path)
        self.ctx = ctx
        self.device = device
        files = sorted(self.path.glob("*.safetensors"))
        if not files:
            raise DetauditError(f"model directory {path} holds no *.safetensors file")
        self._files = files
        self._handles: dict[Path, object] = {}
        self._where: dict[str, Path] = {}
        self._read: set[str] = set()

    def __enter__(self) -> "ShardLoader":
        for f in self._files:
            try:
                h = safe_open(str(f), framework="pt", device="cpu")
            except Exception as e:
                raise DetauditError(f"cannot read {f}: {e}") from None
            self._handles[f] = h
            for k in h.keys():
                self._where[k] = f
        return self

    def __exit__(self, *exc) -> None:
        self._handles.clear()

    def _slice(self, name: str):
        f = self._where.get(name)
        if f is None:
            raise DetauditError(f"model {self.path} lacks parameter {name}")
        self._read.add(name)
        return self._handles[f].get_slice(name)

    def skip(self, name: str) -> None:
        """Mark a parameter as deliberately unused (e.g. a stored lm_head of tied embeddings)."""
        self._read.add(name)

    def unused(self) -> list[str]:
        """Parameters in the checkpoint that nothing has read: a computation the engine would ignore."""
        return sorted(n for n in self._where if n not in self._read and not n.endswith("rotary_emb.inv_freq"))

    def _to(self, t: Tensor) -> Tensor:
        return t.to(device=self.device, dtype=self.ctx.dtype).contiguous()

    def full(self, name: str) -> Tensor:
        return self._to(self._slice(name)[:])

    def shards(self, name: str, dim: int, replicas: int = 1) -> list[Tensor]:
        """This process's shards of a parameter split into C / `replicas` contiguous equal parts along
        `dim`, rank r holding part r // replicas (`replicas` > 1: KV heads shared by several ranks)."""
        sl = self._slice(name)
        shape = sl.get_shape()
        c = self.ctx.size
        parts = c // replicas
        if c % replicas or shape[dim] % parts:
            held = f" (each part held by {replicas} ranks)" if replicas > 1 else ""
            raise DetauditError(f"TP {c} does not divide dim {dim} ({shape[dim]}) of {name}{held}")
        n = shape[dim] // parts
        out = []
        for r in self.ctx.local_ranks:
            i = r // replicas
            t = sl[i * n : (i + 1) * n] if dim == 0 else sl[:, i * n : (i + 1) * n]
            out.append(self._to(t))
        return out


def open_weights(model: ModelRef, ctx: TPContext, device: torch.device):
    """The checkpoint's safetensors, or a synthetic model's seeded random weights (`detaudit.synthetic`)."""
    from detaudit import synthetic

    if synthetic.is_synthetic(model.path) and not synthetic.has_weights(model.path):  # (written ones: read them)
        return synthetic.RandomWeights(model.path, model.config, ctx, device)
    return ShardLoader(model.path, ctx, device)
